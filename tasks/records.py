"""Read one shard's range and turn its records into prompts, or into error rows.

A bad record never stops the shard: it becomes an error row (shard, row, reason, raw value).
Record ids are the id field, else `source:offset` (byte offset for JSONL, row for Parquet), so
they are stable across reruns; so is the per-record seed derived from them.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pyarrow.parquet as pq
from fsspec import AbstractFileSystem

from schemas.run import InputSpec, template_fields
from tasks.planning import Shard

RAW_LIMIT = 500
CHAT_ROLES = {"system", "user", "assistant"}
Prompt = str | list[dict[str, str]] | list[int]  # token ids once rendered


@dataclass(frozen=True)
class Record:
    row: int
    offset: int  # its place in the input file: the data's input_offset
    record_id: str
    prompt: Prompt
    prompt_text: str  # chats as JSON until rendered; then the exact text sent
    seed: int
    sample_index: int = 0
    samples: int | None = None  # completions wanted (a batch request's n); None: the config's
    input_prompt: str = ""  # prompt_text as the input made it, before the chat template
    parent_id: str | None = None  # a chain step: the upstream record's id


@dataclass(frozen=True)
class BadRecord:
    row: int
    offset: int
    record_id: str  # the id field when readable, else source:offset
    reason: str
    raw: str


def truncate(text: str) -> str:
    return text if len(text) <= RAW_LIMIT else text[:RAW_LIMIT] + "…"


def record_seed(run_seed: int, record_id: str) -> int:
    """A per-record seed from (run seed, record id): stable across reruns and shard layouts."""
    digest = hashlib.sha256(f"{run_seed}:{record_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def with_samples(records: list[Record], samples: int, run_seed: int) -> list[Record]:
    """`samples` copies of each record (its own `samples` where set); copy i > 0 gets the seed
    of id `<id>#<i>`, so sample 0 keeps the seed a single-sample run uses and every sample
    stays stable across reruns."""
    return [
        replace(record, sample_index=i,
                seed=record.seed if i == 0 else record_seed(run_seed, f"{record.record_id}#{i}"))
        for record in records
        for i in range(record.samples or samples)
    ]


def _jsonl_lines(
    file: io.BufferedIOBase, start: int, end: int | None
) -> Iterator[tuple[int, bytes]]:
    """Lines whose first byte lies in [start, end): the newline-aligned reading of a byte range."""
    if start > 0:
        file.seek(start - 1)
        file.readline()  # finish the line that started before us (or eat the newline at start-1)
    position = file.tell()
    while end is None or position < end:
        line = file.readline()
        if not line:
            return
        yield position, line
        position += len(line)


@dataclass(frozen=True)
class InvalidUtf8:
    """A JSONL line whose bytes are not UTF-8, at this byte of the file; `record` is the line
    read with U+FFFD, when that parses (for the error row's id)."""

    byte: int
    record: Any = None


def raw_items(
    fs: AbstractFileSystem, shard: Shard, spec: InputSpec
) -> Iterator[tuple[int, str, Any]]:
    """(offset, raw text, parsed value or the parse error) for each record of the shard;
    a line with invalid UTF-8 yields InvalidUtf8 unless input.on_invalid_utf8 is replace."""
    replace_invalid = spec.on_invalid_utf8 == "replace"
    if shard.format in ("parquet", "run"):  # run: another run's data (tasks/chains.py)
        with fs.open(shard.path, "rb") as file:
            table = pq.ParquetFile(file).read_row_groups(range(shard.start, shard.end))
        for index, row in enumerate(table.to_pylist()):
            yield shard.first_row + index, json.dumps(row, default=str), row
        return
    compressed = shard.format == "jsonl.gz"
    with fs.open(shard.path, "rb", compression="gzip" if compressed else None) as file:
        start, end = (0, None) if compressed else (shard.start, shard.end)
        for offset, line in _jsonl_lines(file, start, end):
            text = line.decode("utf-8", errors="replace").rstrip("\r\n")
            if not text.strip():
                continue
            if not replace_invalid and "\ufffd" in text:
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as error:
                    try:
                        record = json.loads(text)
                    except json.JSONDecodeError:
                        record = None
                    yield offset, text, InvalidUtf8(offset + error.start, record)
                    continue
            try:
                yield offset, text, json.loads(text)
            except json.JSONDecodeError as error:
                yield offset, text, error


def id_field_value(value: Any, name: str) -> str | None:
    """A record's id as read_shard reads it, None where it has none usable."""
    if not isinstance(value, dict):
        return None
    found = value.get(name)
    if isinstance(found, str | int) and not isinstance(found, bool):
        return str(found)
    return None


def _field(record: dict, name: str, kinds: tuple[type, ...], expected: str) -> Any:
    if name not in record or record[name] is None:
        raise ValueError(f"missing_field: {name!r} is missing")
    value = record[name]
    if not isinstance(value, kinds) or isinstance(value, bool):
        raise ValueError(f"wrong_type: {name!r} is {type(value).__name__}, expected {expected}")
    return value


def _chat(value: Any, name: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"wrong_type: {name!r} must be a non-empty list of messages")
    for index, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or message.get("role") not in CHAT_ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise ValueError(
                f"wrong_type: {name}[{index}] must be {{'role': one of {sorted(CHAT_ROLES)}, "
                "'content': string}"
            )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def build_prompt(record: dict, spec: InputSpec) -> tuple[Prompt, str]:
    """The prompt for the engine and its text for the data table; ValueError says why not."""
    if spec.messages_field:
        value = _field(record, spec.messages_field, (list,), "a list of messages")
        messages = _chat(value, spec.messages_field)
        if not any(m["content"].strip() for m in messages):
            raise ValueError("empty_prompt: every message is empty")
        return messages, json.dumps(messages, ensure_ascii=False)
    if spec.template:
        values = {
            name: _field(record, name, (str, int, float), "string or number")
            for name in template_fields(spec.template)
        }
        prompt = spec.template.format_map(values)
    else:
        prompt = _field(record, spec.prompt_field, (str,), "string")
    if not prompt.strip():
        raise ValueError("empty_prompt: the prompt is empty")
    return prompt, prompt


def duplicate_reason(record_id: str, first_use: str) -> str:
    return (f"duplicate_id: {record_id!r} was first used by {first_use}; this later copy is "
            "not generated")


def check_parsed(value: Any, source: str) -> None:
    """ValueError (the error row's reason) for a line raw_items could not parse."""
    if isinstance(value, InvalidUtf8):
        raise ValueError(
            f"invalid_utf8: byte {value.byte} of {source} is not UTF-8; fix the file, or set "
            "input.on_invalid_utf8: replace to read it as U+FFFD"
        )
    if isinstance(value, json.JSONDecodeError):
        raise ValueError(f"malformed_json: {value.msg}: column {value.colno}")


def check_encodable(text: str) -> None:
    """JSON escapes can spell lone surrogates (\\ud800), which no UTF-8 output can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"invalid_utf8: the prompt holds {text[error.start]!r} (a lone surrogate from a "
            f"JSON escape) at character {error.start}; fix the record"
        ) from None


def read_shard(
    fs: AbstractFileSystem, shard: Shard, spec: InputSpec, run_seed: int
) -> tuple[list[Record], list[BadRecord]]:
    """Every record in the shard's range, split into usable prompts and error rows."""
    good: list[Record] = []
    bad: list[BadRecord] = []
    seen: set[str] = set()
    first_seen = dict(shard.duplicates)
    for row, (offset, raw, value) in enumerate(raw_items(fs, shard, spec)):
        record_id = f"{shard.source}:{offset}"
        try:
            if row in first_seen:
                record_id = id_field_value(value, spec.id_field) or record_id
                raise ValueError(duplicate_reason(record_id, first_seen[row]))
            if isinstance(value, InvalidUtf8):
                record_id = id_field_value(value.record, spec.id_field) or record_id
            check_parsed(value, shard.source)
            if not isinstance(value, dict):
                raise ValueError(f"wrong_type: record is {type(value).__name__}, expected object")
            if spec.id_field:
                record_id = str(_field(value, spec.id_field, (str, int), "string or integer"))
                if record_id in seen:
                    raise ValueError(f"duplicate_id: {record_id!r} already used in this shard")
                seen.add(record_id)
            prompt, text = build_prompt(value, spec)
            check_encodable(text)
        except ValueError as error:
            bad.append(BadRecord(row, offset, record_id, str(error), truncate(raw)))
            continue
        good.append(Record(row, offset, record_id, prompt, text, record_seed(run_seed, record_id)))
    return good, bad
