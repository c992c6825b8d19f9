"""Record ids are unique over a run's data: a later copy of an id becomes an error row
`duplicate_id` naming where the id was first seen, whichever shard either copy is in.

Found at plan time, in one streaming pass over the ids (only with `input.id_field`: ids made
of source:offset are unique by construction). "Later" is plan order: by file, then position.
Each id is hashed to 128 bits (a false match among 10^9 ids has odds below 10^-20) and the
hash, with the shard's index and the row, is appended to one of several bucket files on local
disk, chosen by the hash; each bucket is then read and sorted on its own. Memory stays at one
bucket (ENTRIES_PER_BUCKET x 32 bytes) whatever the input's size; disk holds 32 bytes an id.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem

from schemas.run import InputSpec
from tasks.planning import Shard
from tasks.records import id_field_value, raw_items

ENTRIES_PER_BUCKET = 1 << 21  # ~2M entries, 64 MB sorted in memory at a time
ENTRY = np.dtype([("high", "<u8"), ("low", "<u8"), ("shard", "<u8"), ("row", "<u8")])
CHUNK = 1 << 16  # entries buffered per bucket before they are appended to its file


def _id_hash(record_id: str) -> tuple[int, int]:
    digest = hashlib.blake2b(record_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")


def shard_ids(fs: AbstractFileSystem, shard: Shard, spec: InputSpec) -> Iterator[tuple[int, str]]:
    """(row, id) for every record of the shard that has a usable id, rows numbered as
    read_shard numbers them. Parquet reads the id column alone."""
    if shard.format == "parquet":
        with fs.open(shard.path, "rb") as file:
            table = pq.ParquetFile(file).read_row_groups(
                range(shard.start, shard.end), columns=[spec.id_field]
            )
        for row, value in enumerate(table.column(0).to_pylist()):
            if isinstance(value, str | int) and not isinstance(value, bool):
                yield row, str(value)
        return
    for row, (_, _, value) in enumerate(raw_items(fs, shard, spec)):
        record_id = id_field_value(value, spec.id_field)
        if record_id is not None:
            yield row, record_id


def find_duplicates(
    fs: AbstractFileSystem,
    shards: list[Shard],
    spec: InputSpec,
    entries_per_bucket: int = ENTRIES_PER_BUCKET,
) -> dict[str, dict[int, str]]:
    """shard id -> {row: where its id was first seen} for every later copy of an id."""
    if not spec.id_field or not shards:
        return {}
    estimated = sum(shard.estimated_rows for shard in shards)
    buckets = max(1, -(-2 * estimated // entries_per_bucket))  # room for estimates too low
    with tempfile.TemporaryDirectory(prefix="corpusgen-ids-") as tmp:
        files = [Path(tmp) / f"{bucket}.bin" for bucket in range(buckets)]
        pending: list[list[tuple[int, int, int, int]]] = [[] for _ in range(buckets)]

        def flush(bucket: int) -> None:
            with files[bucket].open("ab") as out:
                out.write(np.array(pending[bucket], dtype=ENTRY).tobytes())
            pending[bucket].clear()

        for index, shard in enumerate(shards):
            for row, record_id in shard_ids(fs, shard, spec):
                high, low = _id_hash(record_id)
                bucket = high % buckets
                pending[bucket].append((high, low, index, row))
                if len(pending[bucket]) >= CHUNK:
                    flush(bucket)
        for bucket in range(buckets):
            if pending[bucket]:
                flush(bucket)
        found: dict[str, dict[int, str]] = {}
        for file in files:
            if file.exists():
                _later_copies(np.fromfile(file, dtype=ENTRY), shards, found)
    return found


def _later_copies(
    entries: np.ndarray, shards: list[Shard], found: dict[str, dict[int, str]]
) -> None:
    """Within one bucket: every entry after the first (in plan order) of its hash."""
    entries = entries[np.lexsort((entries["row"], entries["shard"], entries["low"],
                                  entries["high"]))]
    same = (entries["high"][1:] == entries["high"][:-1]) & (
        entries["low"][1:] == entries["low"][:-1]
    )
    copies = np.flatnonzero(same) + 1
    if not len(copies):
        return
    starts = np.flatnonzero(np.concatenate([[True], ~same]))  # each hash's first entry
    firsts = starts[np.searchsorted(starts, copies, side="right") - 1]
    for copy_at, first_at in zip(copies.tolist(), firsts.tolist(), strict=True):
        origin = shards[int(entries["shard"][first_at])]
        copy = shards[int(entries["shard"][copy_at])]
        found.setdefault(copy.shard_id, {})[int(entries["row"][copy_at])] = (
            f"shard {origin.shard_id} row {int(entries['row'][first_at])}"
        )


def with_duplicates(fs: AbstractFileSystem, shards: list[Shard], spec: InputSpec) -> list[Shard]:
    """The shards with their later copies of ids recorded (what the plan stores). Without
    input.id_field ids are unique, or (openai_batch) checked by the batch planner."""
    if not spec.id_field:
        return shards
    found = find_duplicates(fs, shards, spec)
    return [replace(shard, duplicates=tuple(sorted(found.get(shard.shard_id, {}).items())))
            for shard in shards]
