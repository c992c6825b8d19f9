"""Cut the input into shards without reading it all.

Parquet shards are runs of whole row groups, JSONL shards are byte ranges starting at line starts
(a line belongs to the range its first byte falls in), a .gz file is one shard.
Shard ids hash (path, range, fingerprint) so a rerun on unchanged input plans the same ids and
skips what is already committed; a changed file (ETag, or size + mtime) gets new ids.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow.parquet as pq
from fsspec import AbstractFileSystem

from schemas.run import OPENAI_BATCH, RunConfig
from tasks.commit import create_exclusive
from tasks.failures import InputChanged
from tasks.layout import RunLayout
from tasks.storage import is_local

SAMPLE_BYTES = 256 * 1024
BOUNDARY_WINDOW = 64 * 1024  # a shard boundary moves to the next line start within this
FIRST_WINDOW = 2 * 1024  # read first at each boundary; enough for most lines
GLOB_CHARS = "*?["
EXTENSIONS = {
    ".parquet": "parquet",
    ".jsonl.gz": "jsonl.gz",
    ".json.gz": "jsonl.gz",
    ".ndjson.gz": "jsonl.gz",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
}


class InputError(ValueError):
    """The input can't be planned (missing, unknown format, unreadable)."""


class EmptyInput(InputError):
    """Every input file is empty: `plan` and `run` both refuse it (exit 2)."""


@dataclass(frozen=True)
class Shard:
    shard_id: str
    path: str
    source: str  # path relative to the input root: part of record ids
    format: str
    start: int  # jsonl: byte offset; parquet: first row group; jsonl.gz: 0
    end: int  # exclusive; jsonl: byte offset; parquet: row group; jsonl.gz: file size
    first_row: int  # parquet: index of the shard's first row in its file
    estimated_rows: int
    fingerprint: str
    # (row, where its id was first seen) for the shard's later copies of an id seen before
    # in plan order: error rows `duplicate_id` (tasks/duplicates.py)
    duplicates: tuple[tuple[int, str], ...] = ()
    # openai_batch: the one group of the file's lines the shard reads in its range, the
    # sampling parameters they share as JSON (or INVALID: lines that are error rows); see
    # tasks/batch_requests.py
    group: str = ""
    # a chain step (input.format run): the upstream run has samples > 1, so ids are
    # parent_id#sample_index (tasks/chains.py)
    sample_ids: bool = False


@dataclass(frozen=True)
class Plan:
    run_id: str
    run_date: str
    config_hash: str
    shards: list[Shard]
    # The run's quality guards, so `corpusgen report` can say whether it passed them.
    max_error_fraction: float = 0.5
    max_empty_fraction: float = 0.5
    max_looping_fraction: float = 0.5
    # The run's filters (config.filters as JSON): fixed for the run, as they decide data/.
    filters: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        shards = [
            Shard(**{**shard, "duplicates": tuple(map(tuple, shard.get("duplicates", ())))})
            for shard in data["shards"]
        ]
        return cls(**{**data, "shards": shards})

    def select(self, shard_ids: list[str]) -> list[Shard]:
        by_id = {shard.shard_id: shard for shard in self.shards}
        unknown = [shard_id for shard_id in shard_ids if shard_id not in by_id]
        if unknown:
            raise ValueError(f"shard ids not in the plan of run {self.run_id}: {unknown[:5]}")
        return [by_id[shard_id] for shard_id in shard_ids]


def detect_format(path: str, configured: str) -> str:
    if configured == OPENAI_BATCH and EXTENSIONS.get("." + path.rsplit(".", 1)[-1]) != "jsonl":
        raise InputError(
            f"input file {path!r}: input.format openai_batch reads uncompressed JSONL (.jsonl), "
            "as the Batch API takes it"
        )
    if configured != "auto":
        return configured
    for extension, fmt in EXTENSIONS.items():
        if path.endswith(extension):
            return fmt
    raise InputError(
        f"input file {path!r}: unknown extension; use .jsonl, .jsonl.gz or .parquet, "
        "or set input.format"
    )


def display_uri(fs: AbstractFileSystem, path: str) -> str:
    """`path` as the user wrote it: with its s3:// scheme (fsspec strips it), local as is."""
    return path if is_local(fs) else fs.unstrip_protocol(path)


def list_input_files(fs: AbstractFileSystem, pattern: str) -> tuple[list[str], str]:
    """Files matching a path, directory or glob (sorted), and the root they are named from."""
    magic = min((pattern.find(c) for c in GLOB_CHARS if c in pattern), default=-1)
    if magic >= 0:
        files = [p for p in fs.glob(pattern) if fs.isfile(p)]
        root = pattern[:magic].rsplit("/", 1)[0]
    elif fs.isdir(pattern):
        files = [p for p in fs.find(pattern) if any(p.endswith(e) for e in EXTENSIONS)]
        root = pattern
    elif fs.isfile(pattern):
        files, root = [pattern], pattern.rsplit("/", 1)[0]
    else:
        files, root = [], pattern
    if not files:
        raise InputError(
            f"input.uri {display_uri(fs, pattern)!r} matches no input files; check the path or glob"
        )
    return sorted(files), root


def check_paths(config: RunConfig) -> None:
    """Before anything runs: every input file opens for reading, not all are empty, and a
    local output is a writable directory. InputError names the path and the fix (exit 2)."""
    from tasks.storage import filesystem

    input_fs, input_path = filesystem(config.input.uri, config.storage)
    files, _ = list_input_files(input_fs, input_path)
    for path in files:
        try:
            with input_fs.open(path, "rb") as file:
                file.read(1)
        except OSError as error:
            raise InputError(
                f"input file {display_uri(input_fs, path)!r} cannot be read "
                f"({error.strerror or type(error).__name__}); fix its permissions or input.uri"
            ) from None
    if all(input_fs.size(path) == 0 for path in files):
        raise _empty_input(input_fs, input_path, files)
    output_fs, output = filesystem(config.output, config.storage)
    if is_local(output_fs):
        _check_writable_directory(output)
    from tasks.chains import check_fields

    check_fields(config)  # an upstream run to read, and every field named exists


def _check_writable_directory(path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise InputError(f"output {path!r} is a file, not a directory; set output to a directory")
    probe = os.path.join(path, f".corpusgen-write-check-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "wb"):
            pass
        os.unlink(probe)
    except OSError as error:
        raise InputError(
            f"output {path!r} is not writable ({error.strerror or type(error).__name__}"
            f"{f': {error.filename}' if error.filename and error.filename != probe else ''}); "
            "choose another output or fix its permissions"
        ) from None


def _fingerprint(info: dict) -> str:
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return f"etag:{etag.strip(chr(34))}"
    modified = info.get("mtime") or info.get("LastModified") or info.get("created")
    return f"size:{info['size']}:mtime:{modified}"


def check_unchanged(fs: AbstractFileSystem, shards: list[Shard], run_id: str) -> None:
    """Raise InputChanged when a file the shards were planned from has another fingerprint
    now (before a shard reads, before it commits, and at the end of a run)."""
    planned: dict[str, list[Shard]] = {}
    for shard in shards:
        planned.setdefault(shard.path, []).append(shard)
    for path, of_file in planned.items():
        fs.invalidate_cache(path)
        try:
            now = _fingerprint(fs.info(path))
        except FileNotFoundError:
            now = "deleted"
        if now != of_file[0].fingerprint:
            names = ", ".join(shard.shard_id for shard in of_file[:5])
            more = f" and {len(of_file) - 5} more" if len(of_file) > 5 else ""
            raise InputChanged(
                f"run {run_id}: input file {display_uri(fs, path)!r} changed during the run "
                f"(planned as {of_file[0].fingerprint}, now {now}); {len(of_file)} shard(s) "
                f"were planned from the old version: {names}{more}. Committed shards are kept. "
                "Restore the file to finish this run, or start a new run on the new file "
                "(--set run_id=<new id>, or another output)"
            )


def shard_id_of(path: str, start: int, end: int, fingerprint: str, group: str = "") -> str:
    key = f"{path}|{start}|{end}|{fingerprint}" + (f"|{group}" if group else "")
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _bytes_per_row(sample: bytes) -> float:
    lines = sample.count(b"\n")
    return len(sample) / lines if lines else max(len(sample), 1)


def _line_starts(fs, path: str, offsets: list[int], size: int) -> list[int]:
    """For each offset, the first line start at or after it, found within BOUNDARY_WINDOW bytes;
    offsets with none found are dropped. Reads a short window first (most lines are short) and
    the full window only where that found no newline; ranged reads run concurrently on S3."""
    starts, pending = [], offsets
    for window_bytes in (FIRST_WINDOW, BOUNDARY_WINDOW):
        if not pending:
            break
        ends = [min(offset - 1 + window_bytes, size) for offset in pending]
        windows = fs.cat_ranges([path] * len(pending), [offset - 1 for offset in pending], ends)
        unresolved = []
        for offset, window in zip(pending, windows, strict=True):
            newline = window.find(b"\n")
            if newline >= 0:
                if offset + newline < size:
                    starts.append(offset + newline)
            elif offset - 1 + window_bytes < size:  # the window stopped short of the file's end
                unresolved.append(offset)
        pending = unresolved
    return sorted(set(starts))


def _plan_jsonl(fs, path, source, size, fingerprint, rows_per_shard) -> list[Shard]:
    """Even byte ranges moved to line starts, so that every shard holds at least one line (one
    huge line does not make a run of empty shards)."""
    with fs.open(path, "rb") as file:
        bytes_per_row = _bytes_per_row(file.read(SAMPLE_BYTES))
    count = max(round(size / (bytes_per_row * rows_per_shard)), 1)
    step = -(-size // count)  # even ranges, no sliver at the end
    bounds = [0, *_line_starts(fs, path, list(range(step, size, step)), size), size]
    shards = []
    for start, end in itertools.pairwise(bounds):
        shards.append(
            Shard(shard_id_of(path, start, end, fingerprint), path, source, "jsonl", start, end, 0,
                  max(round((end - start) / bytes_per_row), 1), fingerprint)
        )
    return shards


def _plan_gzip(fs, path, source, size, fingerprint) -> list[Shard]:
    with fs.open(path, "rb") as file:
        compressed = file.read(SAMPLE_BYTES)
    inflater = zlib.decompressobj(wbits=31)
    try:
        lines = inflater.decompress(compressed).count(b"\n")
    except zlib.error as error:
        where = display_uri(fs, path)
        raise InputError(f"input file {where!r} is not valid gzip: {error}") from None
    consumed = len(compressed) - len(inflater.unconsumed_tail)
    estimated = round(lines * size / max(consumed, 1))
    shard_id = shard_id_of(path, 0, size, fingerprint)
    return [Shard(shard_id, path, source, "jsonl.gz", 0, size, 0, estimated, fingerprint)]


def _plan_parquet(fs, path, source, fingerprint, rows_per_shard) -> list[Shard]:
    try:
        with fs.open(path, "rb") as file:
            metadata = pq.ParquetFile(file).metadata
    except Exception as error:
        where = display_uri(fs, path)
        raise InputError(f"input file {where!r} is not readable Parquet: {error}") from None
    shards, group, first_row, rows = [], 0, 0, 0
    for index in range(metadata.num_row_groups):
        rows += metadata.row_group(index).num_rows
        last = index == metadata.num_row_groups - 1
        if rows >= rows_per_shard or last:
            end = index + 1
            shards.append(
                Shard(shard_id_of(path, group, end, fingerprint), path, source, "parquet", group,
                      end, first_row, rows, fingerprint)
            )
            group, first_row, rows = end, first_row + rows, 0
    return shards


def plan_shards(fs: AbstractFileSystem, config: RunConfig, input_path: str) -> list[Shard]:
    # Imported here: it reads lines with tasks.records, which imports this module.
    from tasks.batch_requests import plan_batch_file
    from tasks.chains import is_chained, plan_upstream, upstream_root

    if is_chained(config, fs):
        return plan_upstream(fs, config, upstream_root(input_path))
    files, root = list_input_files(fs, input_path)
    shards: list[Shard] = []
    for path in files:
        fmt = detect_format(path, config.input.format)
        info = fs.info(path)
        source = path[len(root) :].lstrip("/") or path.rsplit("/", 1)[-1]
        fingerprint = _fingerprint(info)
        rows_per_shard = config.sharding.rows_per_shard
        if info["size"] == 0:
            continue
        if fmt == OPENAI_BATCH:
            shards += plan_batch_file(fs, path, source, info["size"], fingerprint, config)
        elif fmt == "parquet":
            shards += _plan_parquet(fs, path, source, fingerprint, rows_per_shard)
        elif fmt == "jsonl.gz":
            shards += _plan_gzip(fs, path, source, info["size"], fingerprint)
        else:
            shards += _plan_jsonl(fs, path, source, info["size"], fingerprint, rows_per_shard)
    if not shards:
        raise _empty_input(fs, input_path, files)
    return shards


def _empty_input(fs: AbstractFileSystem, input_path: str, files: list[str]) -> EmptyInput:
    return EmptyInput(
        f"input.uri {display_uri(fs, input_path)!r} has no rows: {len(files)} file(s), all "
        "empty; nothing to generate"
    )


def write_plan(layout: RunLayout, plan: Plan) -> Plan:
    """Record the plan before generating. An existing plan for the run must match (same shard
    ids): otherwise the input changed under a run that is being resumed."""
    if create_exclusive(layout.fs, layout.plan_path, plan.to_json().encode()):
        return plan
    existing = Plan.from_json(layout.fs.cat_file(layout.plan_path).decode())
    if [s.shard_id for s in existing.shards] != [s.shard_id for s in plan.shards]:
        raise InputError(
            f"run {plan.run_id} was planned on different input ({layout.plan_path}); the input "
            "changed since. Restore it, or start a new run: --set run_id=<new id>, or another "
            "output"
        )
    if existing.filters != plan.filters:
        raise InputError(
            f"run {plan.run_id} was planned with filters {existing.filters or 'none'}, the "
            f"config has {plan.filters or 'none'}; a run keeps its filters (its shards commit "
            "for them): restore them, or start a new run: --set run_id=<new id>"
        )
    return existing


def new_plan(layout: RunLayout, config: RunConfig, shards: list[Shard]) -> Plan:
    return Plan(layout.run_id, layout.run_date, config.config_hash(), shards,
                config.max_error_fraction, config.max_empty_fraction,
                config.max_looping_fraction,
                [rule.model_dump(mode="json") for rule in config.filters])
