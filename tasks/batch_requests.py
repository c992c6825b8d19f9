"""OpenAI Batch API files as input (`input.format: openai_batch`).

Each line is a request `{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body":
{"model", "messages", ...}}`: custom_id is the record id, body.messages the chat, and body's
sampling fields override generation.sampling (`n` overrides samples_per_prompt, `seed` the
record's seed). A line that cannot run as asked (another endpoint, a field the engine cannot
honour, another model, a bad value) is an error row naming the field: never a request run with
a field ignored.

The engine takes one SamplingParams per generate() call (per row, only the seed), so the
planner groups the requests by their sampling parameters: a shard holds one group
(Shard.group, the parameters as JSON) and generates it in one call; the lines that are error
rows form shards of their own (group INVALID). A shard is a byte range of the file and reads
only its group's lines in it, so shards of different groups may cover the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fsspec import AbstractFileSystem
from pydantic import ValidationError

from schemas.engine import SamplingParams
from schemas.run import OPENAI_BATCH, RUN_OUTPUT, RunConfig
from tasks.planning import Shard, shard_id_of
from tasks.records import (
    BadRecord,
    InvalidUtf8,
    Record,
    check_encodable,
    check_parsed,
    duplicate_reason,
    raw_items,
    read_shard,
    record_seed,
    truncate,
)

ENDPOINT = "/v1/chat/completions"
INVALID = "invalid"  # the group of the lines that are error rows
LINE_FIELDS = {"custom_id", "method", "url", "body"}
# body field -> the SamplingParams field it sets (max_completion_tokens wins over max_tokens)
SAMPLING_FIELDS = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
                   "temperature": "temperature", "top_p": "top_p", "stop": "stop"}
# OpenAI's bookkeeping (abuse monitoring, stored completions), not the completion's
BOOKKEEPING_FIELDS = {"user", "metadata", "store"}
# Fields honoured at these values only: each asks for what the engine does anyway.
NEUTRAL_VALUES = {"stream": False, "logprobs": False, "presence_penalty": 0,
                  "frequency_penalty": 0}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class BatchRequest:
    custom_id: str
    messages: list[dict[str, str]]
    group: str  # its sampling parameters as JSON: the requests of a group share a generate call
    seed: int | None
    samples: int | None  # body.n


@dataclass(frozen=True)
class BatchLine:
    """A line of the file, judged: a request, or the reason it is an error row."""

    offset: int
    raw: str
    record_id: str  # custom_id when readable, else source:offset
    group: str
    request: BatchRequest | None
    reason: str | None


def served_model_names(config: RunConfig) -> list[str]:
    """What body.model may say: the target's path, its last part, input.model_name."""
    path = config.generation.engine.target.path
    names = [path, path.rstrip("/").rsplit("/", 1)[-1].removeprefix("packaged:")]
    return list(dict.fromkeys([*names, *filter(None, [config.input.model_name])]))


def _response_format(value: Any) -> dict[str, Any]:
    """body.response_format as a SamplingParams field ({type: text} is free text, as without)."""
    if value is None or value == {"type": "text"}:
        return {}
    return {"response_format": value}


def _content(value: Any, where: str) -> str:
    """A message's content: a string, or text parts (joined by newlines)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(f"wrong_type: {where} must be a string or a list of text parts")
    texts = []
    for index, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"unsupported_field: {where}[{index}] is a {kind!r} part; the "
                             "engine reads text parts only")
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError("wrong_type: body.messages must be a non-empty list of messages")
    chat = []
    for index, message in enumerate(value):
        where = f"body.messages[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or (
            message["role"] not in ROLES
        ):
            raise ValueError(f"wrong_type: {where} must be {{'role': one of {sorted(ROLES)}, "
                             "'content': ...}")
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise ValueError(f"unsupported_field: {where}.{extra[0]}: the engine cannot honour "
                             "it")
        chat.append({"role": ROLES[message["role"]],
                     "content": _content(message.get("content"), f"{where}.content")})
    if not any(m["content"].strip() for m in chat):
        raise ValueError("empty_prompt: every message is empty")
    return chat


def _unsupported(body: dict[str, Any]) -> list[str]:
    known = {"model", "messages", "seed", "n", "response_format", *SAMPLING_FIELDS,
             *BOOKKEEPING_FIELDS}
    return [f"body.{name}" for name, value in body.items() if name not in known and not (
        name in NEUTRAL_VALUES and value in (None, NEUTRAL_VALUES[name]))]


def _integer(body: dict[str, Any], name: str, minimum: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or (
        minimum is not None and value < minimum
    ):
        limit = f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"invalid_value: body.{name} must be an integer{limit}, not {value!r}")
    return value


def _sampling(body: dict[str, Any], config: RunConfig) -> SamplingParams:
    """The config's sampling with the body's overrides; a bad value names its body field."""
    overrides, named = {}, {}
    for name, field in SAMPLING_FIELDS.items():  # in order: max_completion_tokens last
        if body.get(name) is not None:
            value = body[name]
            overrides[field] = [value] if field == "stop" and isinstance(value, str) else value
            named[field] = name
    if (response_format := _response_format(body.get("response_format"))):
        overrides.update(response_format)
        named["response_format"] = "response_format"
    defaults = config.generation.engine_sampling.model_dump()
    try:
        return SamplingParams.model_validate({**defaults, **overrides})
    except ValidationError as error:
        problem = error.errors()[0]
        field = named.get(str(problem["loc"][0]), str(problem["loc"][0]))
        message = problem["msg"].removeprefix("Value error, ")
        raise ValueError(f"invalid_value: body.{field}: {message}") from None


def parse_request(value: Any, config: RunConfig) -> BatchRequest:
    """A parsed line as a request; ValueError's message is the error row's reason."""
    if not isinstance(value, dict):
        raise ValueError(f"wrong_type: the line is {type(value).__name__}, expected a request "
                         "object")
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("missing_field: custom_id must be a non-empty string")
    if extra := sorted(set(value) - LINE_FIELDS):
        raise ValueError(f"unsupported_field: {extra[0]} is not part of a Batch API request")
    if value.get("method") != "POST":
        raise ValueError(f"unsupported_field: method {value.get('method')!r}; requests are POST")
    if value.get("url") != ENDPOINT:
        raise ValueError(f"unsupported_endpoint: url {value.get('url')!r}; only {ENDPOINT} "
                         "runs here")
    body = value.get("body")
    if not isinstance(body, dict):
        raise ValueError("wrong_type: body must be an object")
    if unsupported := _unsupported(body):
        raise ValueError(f"unsupported_field: {', '.join(unsupported)}: the engine cannot "
                         "honour " + ("it" if len(unsupported) == 1 else "them"))
    served = served_model_names(config)
    if body.get("model") is None:
        raise ValueError("missing_field: body.model")
    if body["model"] not in served:
        raise ValueError(f"unknown_model: body.model {body.get('model')!r} is not the target "
                         f"(one of {served}); set input.model_name to serve another name")
    messages = _messages(body.get("messages"))
    check_encodable(json.dumps(messages, ensure_ascii=False))
    sampling = _sampling(body, config)
    group = json.dumps(sampling.model_dump(mode="json"), sort_keys=True)
    return BatchRequest(custom_id, messages, group, _integer(body, "seed", None),
                        _integer(body, "n", 1))


def batch_lines(fs: AbstractFileSystem, shard: Shard, config: RunConfig) -> Iterator[BatchLine]:
    """Every line of the shard's byte range, judged, whatever its group."""
    for offset, raw, value in raw_items(fs, shard, config.input):
        readable = value.record if isinstance(value, InvalidUtf8) else value
        custom_id = readable.get("custom_id") if isinstance(readable, dict) else None
        fallback = custom_id if isinstance(custom_id, str) and custom_id else None
        try:
            check_parsed(value, shard.source)
            request = parse_request(value, config)
        except ValueError as error:
            record_id = fallback or f"{shard.source}:{offset}"
            yield BatchLine(offset, raw, record_id, INVALID, None, str(error))
        else:
            yield BatchLine(offset, raw, request.custom_id, request.group, request, None)


def read_requests(
    fs: AbstractFileSystem, shard: Shard, config: RunConfig
) -> tuple[list[Record], list[BadRecord]]:
    """The shard's group of lines as records (a chat, the request's seed and n) and error rows."""
    good: list[Record] = []
    bad: list[BadRecord] = []
    first_seen = dict(shard.duplicates)
    lines = (line for line in batch_lines(fs, shard, config) if line.group == shard.group)
    for row, line in enumerate(lines):
        reason = line.reason
        if row in first_seen:
            reason = duplicate_reason(line.record_id, first_seen[row])
        if reason is not None:
            bad.append(BadRecord(row, line.offset, line.record_id, reason, truncate(line.raw)))
            continue
        request = line.request
        seed = record_seed(config.seed, request.custom_id) if request.seed is None else (
            request.seed)
        good.append(Record(row, line.offset, request.custom_id, request.messages,
                           json.dumps(request.messages, ensure_ascii=False), seed,
                           samples=request.samples))
    return good, bad


def read_records(
    fs: AbstractFileSystem, shard: Shard, config: RunConfig
) -> tuple[list[Record], list[BadRecord]]:
    """A shard's records and error rows, from a batch file or any other input."""
    if shard.format == OPENAI_BATCH:
        return read_requests(fs, shard, config)
    if shard.format == RUN_OUTPUT:
        from tasks.chains import read_upstream

        return read_upstream(fs, shard, config)
    return read_shard(fs, shard, config.input, config.seed)


def shard_sampling(shard: Shard, config: RunConfig) -> SamplingParams:
    """The sampling parameters a shard generates with: its group's, or the config's."""
    if shard.group and shard.group != INVALID:
        return SamplingParams.model_validate_json(shard.group)
    return config.generation.engine_sampling


def plan_batch_file(
    fs: AbstractFileSystem, path: str, source: str, size: int, fingerprint: str,
    config: RunConfig,
) -> list[Shard]:
    """Shards of up to rows_per_shard lines of one group each, in file order. A custom_id
    used again is a duplicate_id error row in the later line's shard; the ids seen are held
    in memory (a Batch API file holds at most 50,000 requests)."""
    whole = Shard("", path, source, OPENAI_BATCH, 0, size, 0, 0, fingerprint)
    first_use: dict[str, str] = {}
    groups: dict[str, list[tuple[int, str | None]]] = {}  # group -> (offset, first use)
    ends: dict[int, int] = {}  # line offset -> where the next line starts
    previous = None
    for line in batch_lines(fs, whole, config):
        if previous is not None:
            ends[previous] = line.offset
        previous = line.offset
        groups.setdefault(line.group, []).append((line.offset, first_use.get(line.record_id)))
        first_use.setdefault(line.record_id, f"the line at byte {line.offset} of {source}")
    if previous is not None:
        ends[previous] = size
    shards = []
    rows_per_shard = config.sharding.rows_per_shard
    for group, lines in groups.items():
        for first in range(0, len(lines), rows_per_shard):
            chunk = lines[first : first + rows_per_shard]
            start, end = chunk[0][0], ends[chunk[-1][0]]
            duplicates = tuple((row, seen) for row, (_, seen) in enumerate(chunk) if seen)
            shards.append(Shard(shard_id_of(path, start, end, fingerprint, group), path, source,
                                OPENAI_BATCH, start, end, 0, len(chunk), fingerprint,
                                duplicates, group))
    return sorted(shards, key=lambda shard: shard.start)


def group_labels(shards: list[Shard]) -> dict[str, str]:
    """A short name per group for `corpusgen plan`: 1, 2, ... in file order; `errors`."""
    labels: dict[str, str] = {INVALID: "errors"}
    for shard in shards:
        labels.setdefault(shard.group, str(len(labels)))
    return labels


def plan_lines(fs: AbstractFileSystem, shards: list[Shard], config: RunConfig) -> list[str]:
    """What a batch-file run will do, in words: requests, error rows and why, and the
    parameter groups the engine's one-set-per-call sampling splits them into."""
    defaults = config.generation.sampling.model_dump(mode="json")
    requests = sum(shard.estimated_rows for shard in shards)
    reasons: dict[str, list[BadRecord]] = {}
    for shard in shards:
        if shard.group == INVALID or shard.duplicates:
            for bad in read_requests(fs, shard, config)[1]:
                reasons.setdefault(bad.reason.split(":", 1)[0], []).append(bad)
    failing = sum(len(rows) for rows in reasons.values())
    lines = [f"openai_batch: {requests} requests: {requests - failing} to generate, "
             f"{failing} error rows"]
    for reason, rows in sorted(reasons.items(), key=lambda item: -len(item[1])):
        lines.append(f"  {len(rows)} {reason}, e.g. {rows[0].record_id}: {rows[0].reason}")
    groups: dict[str, list[Shard]] = {}
    for shard in shards:
        if shard.group != INVALID:
            groups.setdefault(shard.group, []).append(shard)
    lines.append(f"parameter groups: {len(groups)} (the engine samples a whole batch with one "
                 "set of parameters, so each shard holds one group's requests)")
    labels = group_labels(shards)
    for group, of_group in groups.items():
        params = json.loads(group)
        changed = ", ".join(f"{k} {v}" for k, v in params.items() if v != defaults.get(k))
        rows = sum(shard.estimated_rows for shard in of_group)
        lines.append(f"  group {labels[group]}: {rows} requests in {len(of_group)} shard(s): "
                     f"{changed or 'generation.sampling as configured'}")
    return lines
