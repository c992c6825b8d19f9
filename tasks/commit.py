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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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
    """Create `path` holding `data` only if it does not exist. True if `path` now holds `data`.

    The answer to a conditional create can be lost after it took effect (a dropped connection,
    then a retry that gets 412 / EEXIST), so on any failure the object is read back: holding our
    bytes means we created it (callers make `data` unique, e.g. with an attempt id). An error
    with nothing written is raised, so the caller retries."""
    try:
        _create(fs, path, data)
        return True
    except FileExistsError:
        pass
    except Exception:
        if not fs.exists(path):
            raise
    return fs.cat_file(path) == data


def _create(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    if not is_local(fs):
        with fs.open(path, "xb") as file:  # single PUT with If-None-Match: *
            file.write(data)
        return
    _ensure_parent(fs, path)
    directory, name = path.rsplit("/", 1)
    temp = f"{directory}/.{name}.{uuid.uuid4().hex}.tmp"
    with open(temp, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    try:
        os.link(temp, path)
    finally:
        os.unlink(temp)


def write_parquet(fs: AbstractFileSystem, path: str, table: pa.Table) -> int:
    """One object per file (no directory markers), written in a single call. Returns its size."""
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    _ensure_parent(fs, path)
    payload = buffer.getvalue().to_pybytes()
    fs.pipe_file(path, payload)
    return len(payload)


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
    """Stage `tables` (kind -> table), then try to commit. True if this attempt won.

    The manifest records each file's rows and bytes, so a run can verify what it published."""
    fs = layout.fs
    attempt_dir = layout.attempt_dir(shard_id, attempt_id)
    sizes = {kind: write_parquet(fs, f"{attempt_dir}/{kind}.parquet", table)
             for kind, table in tables.items()}
    manifest = {
        "run_id": layout.run_id,
        "shard_id": shard_id,
        "attempt_id": attempt_id,
        "files": {kind: [layout.relative_published(kind, shard_id)] for kind in sorted(tables)},
        "rows": {kind: tables[kind].num_rows for kind in sorted(tables)},
        "bytes": {kind: sizes[kind] for kind in sorted(tables)},
        "committed_at": dt.datetime.now(dt.UTC).isoformat(),
        **summary,
    }
    if not create_exclusive(fs, layout.manifest(shard_id), json.dumps(manifest).encode()):
        remove_dir(fs, attempt_dir)  # the manifest names another attempt: ours can never win
        return False
    publish(layout, manifest)
    return True


class CommittedFilesMissing(RuntimeError):
    """A committed shard's file is neither staged nor published: it cannot be repaired."""


def publish(layout: RunLayout, manifest: dict[str, Any]) -> None:
    """Move a committed attempt's files to their published names. Safe to repeat, and safe
    while another process finishes the same publish (whoever moves a file first wins)."""
    fs, shard_id = layout.fs, manifest["shard_id"]
    attempt_dir = layout.attempt_dir(shard_id, manifest["attempt_id"])
    missing = [kind for kind in manifest["files"] if not move_staged(
        fs, f"{attempt_dir}/{kind}.parquet", layout.published(kind, shard_id))]
    if missing:
        raise CommittedFilesMissing(
            f"shard {shard_id} is committed (attempt {manifest['attempt_id']}) but its "
            f"{'/'.join(missing)} file(s) are missing both in {attempt_dir} and published; "
            f"delete {layout.manifest(shard_id)} to have the next run regenerate the shard"
        )
    remove_dir(fs, attempt_dir)


def move_staged(fs: AbstractFileSystem, staged: str, final: str) -> bool:
    """Move a committed attempt's file to its published name. True once it is there, moved now
    or earlier: safe to repeat, and to race (whoever moves it first wins)."""
    _ensure_parent(fs, final)
    try:
        fs.mv(staged, final)
    except FileNotFoundError:
        return fs.exists(final)
    return True


def remove_dir(fs: AbstractFileSystem, directory: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        fs.rm(directory, recursive=True)


def _published_sizes(layout: RunLayout) -> dict[str, int]:
    """Path -> size of every published file of the run: one fresh listing per kind. s3fs
    caches listings: another process publishing since an earlier listing (a rerun beside a
    cancelled run's workers) made a stale one say a published file did not exist."""
    layout.fs.invalidate_cache()
    sizes: dict[str, int] = {}
    for kind in PUBLISHED_KINDS:
        with contextlib.suppress(FileNotFoundError):
            found = layout.fs.find(layout.published_dir(kind), detail=True)
            sizes.update({path: info["size"] for path, info in found.items()})
    return sizes


def _read_manifests(layout: RunLayout, shard_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Manifests of `shard_ids`, fetched concurrently on S3 (one call)."""
    paths = {layout.manifest(shard_id): shard_id for shard_id in shard_ids}
    contents = layout.fs.cat(list(paths)) if paths else {}
    return {paths[path]: json.loads(content) for path, content in contents.items()}


def finish_publishes(layout: RunLayout) -> dict[str, str]:
    """Publish every committed shard whose published files are missing: a crash or a lost
    connection between commit and publish, in this run or an earlier one. Idempotent.
    Returns shard id -> what happened (published, or why it could not be)."""
    published = _published_sizes(layout)

    def finished(shard_id: str) -> bool:  # its records are data/, or generated/ with filters
        return all(layout.published(kind, shard_id) in published for kind in ("errors", "metrics")
                   ) and any(layout.published(kind, shard_id) in published
                             for kind in ("data", "generated"))

    unfinished = [shard_id for shard_id in sorted(committed_shard_ids(layout))
                  if not finished(shard_id)]
    outcome = {}
    for shard_id, manifest in _read_manifests(layout, unfinished).items():
        if all(layout.published(kind, shard_id) in published for kind in manifest["files"]):
            continue  # a manifest that lists fewer kinds, all published
        try:
            publish(layout, manifest)
            outcome[shard_id] = "published from staging"
        except CommittedFilesMissing as error:
            outcome[shard_id] = str(error)
    return outcome


def sweep_losing_attempts(layout: RunLayout) -> int:
    """Delete staged attempts of committed shards that the manifest does not name: they can never
    win (e.g. killed mid-write). The named attempt's files are never touched."""
    fs, removed = layout.fs, 0
    committed = committed_shard_ids(layout)
    for attempt_dir in fs.glob(f"{layout.attempt_dir('*', '*')}"):
        shard_id, attempt_id = attempt_dir.rstrip("/").split("/")[-2:]
        if shard_id not in committed:
            continue
        manifest = read_manifest(layout, shard_id)
        if manifest and manifest["attempt_id"] != attempt_id:
            remove_dir(fs, attempt_dir)
            removed += 1
    return removed


def _parquet_rows(fs: AbstractFileSystem, path: str) -> int:
    return pq.read_metadata(path, filesystem=fs).num_rows


def verify_committed(layout: RunLayout) -> dict[str, str]:
    """Check that every committed shard's files exist with the rows and bytes its manifest
    recorded. Returns shard id -> problem for each shard that fails the check."""
    published = _published_sizes(layout)
    manifests = _read_manifests(layout, sorted(committed_shard_ids(layout)))
    problems: dict[str, list[str]] = {}
    expected_rows: dict[str, tuple[str, int]] = {}
    for shard_id, manifest in manifests.items():
        for kind in manifest["files"]:
            path = layout.published(kind, shard_id)
            want = manifest.get("bytes", {}).get(kind)
            if path not in published:
                problems.setdefault(shard_id, []).append(
                    f"committed {kind} file {path} is missing (neither staged nor published: "
                    f"delete {layout.manifest(shard_id)} to have the next run regenerate it)"
                )
            elif want is not None and published[path] != want:
                problems.setdefault(shard_id, []).append(
                    f"{kind} file {path} has {published[path]} bytes, the manifest {want}"
                )
            elif kind in manifest.get("rows", {}):
                expected_rows[path] = (shard_id, manifest["rows"][kind])
    layout.fs.invalidate_cache()  # opening checks the listing cache; find() may not fill it
    with ThreadPoolExecutor(max_workers=16) as pool:
        counted = dict(zip(expected_rows, pool.map(
            lambda path: _parquet_rows(layout.fs, path), expected_rows), strict=True))
    for path, (shard_id, want) in expected_rows.items():
        if counted[path] != want:
            problems.setdefault(shard_id, []).append(
                f"{path} has {counted[path]} rows, the manifest {want}"
            )
    return {shard_id: "; ".join(found) for shard_id, found in problems.items()}


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



@dataclass(frozen=True)
class Recovered:
    """What a run finds committed when it starts, after repairing cut-short publishes."""

    manifests: dict[str, dict[str, Any]]  # shard id -> its manifest
    repairs: dict[str, str]  # shard id -> what finishing its publish did


def recover(layout: RunLayout) -> Recovered:
    """Before dispatching (after datatrove's skip-if-done): finish every publish a crash cut
    short, in this run or an earlier one, and read what is committed (those shards are
    skipped and their cost counts against the cap)."""
    repairs = finish_publishes(layout)
    return Recovered(_read_manifests(layout, sorted(committed_shard_ids(layout))), repairs)


def finalize(layout: RunLayout) -> dict[str, str]:
    """After dispatching: finish publishes, delete attempts that can no longer win, and check
    every committed shard's files against its manifest. Returns shard id -> problem."""
    finish_publishes(layout)
    sweep_losing_attempts(layout)
    return verify_committed(layout)
