"""Exactly-once shard commits on a local disk or S3.

An attempt writes its Parquet files under an attempt-unique staging folder, then commits by
creating the shard's manifest with a conditional create: S3 `If-None-Match: *` (s3fs mode "xb"),
locally a hard link of a fully written temp file (O_EXCL semantics, but the manifest can never be
seen half-written). Exactly one attempt wins; the winner moves its files to their published
names (idempotent, so a rerun finishes a publish cut short by a crash), a loser deletes its own.
Readers only see published files, which only ever come from a winning attempt.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem

from tasks.layout import PUBLISHED_KINDS, RunLayout
from tasks.storage import is_local


def _ensure_parent(fs: AbstractFileSystem, path: str) -> None:
    if is_local(fs):
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)


def create_exclusive(fs: AbstractFileSystem, path: str, data: bytes) -> bool:
    """Create `path` holding `data` only if it does not exist. True if this call created it."""
    if not is_local(fs):
        try:
            with fs.open(path, "xb") as file:  # single PUT with If-None-Match: *
                file.write(data)
        except FileExistsError:
            return False
        return True
    _ensure_parent(fs, path)
    directory, name = path.rsplit("/", 1)
    temp = f"{directory}/.{name}.{uuid.uuid4().hex}.tmp"
    with open(temp, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    try:
        os.link(temp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(temp)
    return True


def write_parquet(fs: AbstractFileSystem, path: str, table: pa.Table) -> None:
    """One object per file (no directory markers), written in a single call."""
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    _ensure_parent(fs, path)
    fs.pipe_file(path, buffer.getvalue().to_pybytes())


def read_manifest(layout: RunLayout, shard_id: str) -> dict[str, Any] | None:
    try:
        return json.loads(layout.fs.cat_file(layout.manifest(shard_id)))
    except FileNotFoundError:
        return None


def committed_shard_ids(layout: RunLayout) -> set[str]:
    return {layout.shard_id_of_manifest(path) for path in layout.fs.glob(layout.manifests_glob)}


def new_attempt_id() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]


def commit_shard(
    layout: RunLayout,
    shard_id: str,
    attempt_id: str,
    tables: dict[str, pa.Table],
    summary: dict[str, Any],
) -> bool:
    """Stage `tables` (kind -> table), then try to commit. True if this attempt won."""
    fs = layout.fs
    attempt_dir = layout.attempt_dir(shard_id, attempt_id)
    for kind, table in tables.items():
        write_parquet(fs, f"{attempt_dir}/{kind}.parquet", table)
    manifest = {
        "run_id": layout.run_id,
        "shard_id": shard_id,
        "attempt_id": attempt_id,
        "files": {kind: [layout.relative_published(kind, shard_id)] for kind in sorted(tables)},
        "committed_at": dt.datetime.now(dt.UTC).isoformat(),
        **summary,
    }
    if not create_exclusive(fs, layout.manifest(shard_id), json.dumps(manifest).encode()):
        _remove(fs, attempt_dir)
        return False
    publish(layout, manifest)
    return True


def publish(layout: RunLayout, manifest: dict[str, Any]) -> None:
    """Move a committed attempt's files to their published names. Safe to repeat."""
    fs, shard_id = layout.fs, manifest["shard_id"]
    attempt_dir = layout.attempt_dir(shard_id, manifest["attempt_id"])
    for kind in manifest["files"]:
        staged, final = f"{attempt_dir}/{kind}.parquet", layout.published(kind, shard_id)
        if fs.exists(staged):
            _ensure_parent(fs, final)
            fs.mv(staged, final)
        elif not fs.exists(final):
            raise RuntimeError(
                f"shard {shard_id} is committed (attempt {manifest['attempt_id']}) but its "
                f"{kind} file is missing both at {staged} and {final}"
            )
    _remove(fs, attempt_dir)


def _remove(fs: AbstractFileSystem, directory: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        fs.rm(directory, recursive=True)


def sweep_losing_attempts(layout: RunLayout) -> int:
    """Delete staged attempts of committed shards: they can never win (e.g. killed mid-write)."""
    fs, removed = layout.fs, 0
    committed = committed_shard_ids(layout)
    for attempt_dir in fs.glob(f"{layout.attempt_dir('*', '*')}"):
        shard_id, attempt_id = attempt_dir.rstrip("/").split("/")[-2:]
        if shard_id not in committed:
            continue
        manifest = read_manifest(layout, shard_id)
        if manifest and manifest["attempt_id"] != attempt_id:
            _remove(fs, attempt_dir)
            removed += 1
    return removed


def read_published(layout: RunLayout, kind: str, schema: pa.Schema) -> pa.Table:
    """All committed rows of one kind for this run (published files only)."""
    if kind not in PUBLISHED_KINDS:
        raise ValueError(f"kind must be one of {PUBLISHED_KINDS}, not {kind!r}")
    published = set(layout.fs.glob(f"{layout.published_dir(kind)}/*.parquet"))
    tables = []
    for shard_id in sorted(committed_shard_ids(layout)):
        path = layout.published(kind, shard_id)
        if path in published:
            with layout.fs.open(path, "rb") as file:
                tables.append(pq.read_table(file, schema=schema))
    return pa.concat_tables(tables) if tables else schema.empty_table()

