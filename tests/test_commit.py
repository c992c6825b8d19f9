"""Exactly-once commits on a local disk and on S3 (a real moto server): conditional create,
concurrent attempts, crash between commit and publish, readers see committed files only."""

from __future__ import annotations

import json
import threading

import duckdb
import fsspec
import pyarrow as pa
import pyarrow.dataset as ds
import pytest
import s3fs

from schemas.arrow import DATA_SCHEMA
from tasks.commit import (
    commit_shard,
    committed_shard_ids,
    create_exclusive,
    new_attempt_id,
    publish,
    read_manifest,
    read_published,
    sweep_losing_attempts,
    write_parquet,
)
from tasks.layout import RunLayout


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """(filesystem, output root) on a local folder or in the moto bucket."""
    if request.param == "local":
        return fsspec.filesystem("file"), str(tmp_path / "out")
    options = request.getfixturevalue("s3_bucket")
    fs = s3fs.S3FileSystem(
        endpoint_url=options["endpoint_url"], key=options["key"], secret=options["secret"]
    )
    return fs, "corpus-test/out"


def data_table(shard_id: str, label: str, rows: int = 3) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {"id": f"{shard_id}-{i}", "shard_id": shard_id, "completion": label, "seed": i}
            for i in range(rows)
        ],
        schema=DATA_SCHEMA,
    )


def test_conditional_create_keeps_the_first_object(store):
    fs, root = store
    path = f"{root}/manifests/x.json"
    assert create_exclusive(fs, path, b"first")
    assert not create_exclusive(fs, path, b"second")
    assert fs.cat_file(path) == b"first"


def test_concurrent_attempts_commit_exactly_once(store):
    fs, root = store
    layout = RunLayout.locate(fs, root, "run1")
    attempts = 6
    barrier = threading.Barrier(attempts)
    outcome: dict[str, bool] = {}

    def attempt(index: int) -> None:
        attempt_id = new_attempt_id()
        barrier.wait()
        outcome[attempt_id] = commit_shard(
            layout, "shard-a", attempt_id, {"data": data_table("shard-a", attempt_id)}, {}
        )

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(attempts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [attempt_id for attempt_id, won in outcome.items() if won]
    assert len(outcome) == attempts and len(winners) == 1
    assert read_manifest(layout, "shard-a")["attempt_id"] == winners[0]
    assert committed_shard_ids(layout) == {"shard-a"}
    published = read_published(layout, "data", DATA_SCHEMA)
    assert published.column("completion").to_pylist() == [winners[0]] * 3
    assert not fs.glob(f"{root}/_attempts/**/*.parquet")  # losers discarded their files


def test_publish_finishes_after_a_crash_between_commit_and_publish(store):
    fs, root = store
    layout = RunLayout.locate(fs, root, "run1")
    attempt_id = new_attempt_id()
    write_parquet(fs, f"{layout.attempt_dir('s1', attempt_id)}/data.parquet", data_table("s1", "x"))
    manifest = {
        "shard_id": "s1",
        "attempt_id": attempt_id,
        "files": {"data": [layout.relative_published("data", "s1")]},
    }
    assert create_exclusive(fs, layout.manifest("s1"), json.dumps(manifest).encode())
    assert read_published(layout, "data", DATA_SCHEMA).num_rows == 0  # not yet visible
    publish(layout, manifest)
    publish(layout, manifest)  # a second rerun: nothing left to do, no error
    assert read_published(layout, "data", DATA_SCHEMA).num_rows == 3
    fs.rm(layout.published("data", "s1"))
    with pytest.raises(RuntimeError, match="missing both"):
        publish(layout, manifest)


def test_sweep_removes_only_attempts_that_can_no_longer_win(store):
    fs, root = store
    layout = RunLayout.locate(fs, root, "run1")
    killed, pending = new_attempt_id(), new_attempt_id()
    write_parquet(fs, f"{layout.attempt_dir('s1', killed)}/data.parquet", data_table("s1", "k"))
    write_parquet(fs, f"{layout.attempt_dir('s2', pending)}/data.parquet", data_table("s2", "p"))
    assert commit_shard(layout, "s1", new_attempt_id(), {"data": data_table("s1", "win")}, {})
    assert sweep_losing_attempts(layout) == 1
    assert fs.exists(f"{layout.attempt_dir('s2', pending)}/data.parquet")
    assert not fs.exists(layout.attempt_dir("s1", killed))


def test_hive_layout_reads_across_runs_with_pyarrow_and_duckdb(tmp_path):
    fs, root = fsspec.filesystem("file"), str(tmp_path / "out")
    for run_id in ("run1", "run2"):
        layout = RunLayout.locate(fs, root, run_id)
        for shard_id in ("a", "b"):
            tables = {"data": data_table(shard_id, run_id)}
            commit_shard(layout, shard_id, new_attempt_id(), tables, {})
        # a staged, never-committed attempt that readers must not see
        orphan = f"{layout.attempt_dir('c', new_attempt_id())}/data.parquet"
        write_parquet(fs, orphan, data_table("c", "orphan"))
    table = ds.dataset(f"{root}/data", partitioning="hive").to_table()
    assert table.num_rows == 12
    assert sorted(set(table.column("run_id").to_pylist())) == ["run1", "run2"]
    assert "orphan" not in table.column("completion").to_pylist()
    count = duckdb.connect().execute(
        f"SELECT count(*), count(DISTINCT run_id) FROM read_parquet('{root}/data/**/*.parquet', "
        "hive_partitioning = true)"
    ).fetchone()
    assert count == (12, 2)
