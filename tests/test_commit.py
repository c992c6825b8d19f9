"""Exactly-once commits on a local disk and on S3 (a real moto server): conditional create,
concurrent attempts, crash between commit and publish, readers see committed files only."""

from __future__ import annotations

import errno
import json
import os
import threading

import duckdb
import fsspec
import pyarrow as pa
import pyarrow.dataset as ds
import pytest
import s3fs
from s3_fault_proxy import FaultRule, S3FaultProxy

from schemas.arrow import DATA_SCHEMA
from tasks.commit import (
    commit_shard,
    committed_shard_ids,
    create_exclusive,
    finish_publishes,
    new_attempt_id,
    publish,
    read_manifest,
    read_published,
    sweep_losing_attempts,
    verify_committed,
    write_parquet,
)
from tasks.layout import RunLayout


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


@pytest.fixture
def faulty_s3(s3_bucket):
    """(proxy, filesystem through it, output root): S3 whose answers a test can lose."""
    proxy = S3FaultProxy(s3_bucket["endpoint_url"])
    fs = s3fs.S3FileSystem(endpoint_url=proxy.url, key="testing", secret="testing",
                           skip_instance_cache=True)
    yield proxy, fs, "corpus-test/out"
    proxy.close()


@pytest.mark.parametrize("fault", ["lost_ack", "slow_down"])
def test_a_commit_whose_answer_is_lost_or_throttled_still_wins_and_publishes(faulty_s3, fault):
    """The conditional PUT is applied but its answer lost (the retry gets 412), or throttled:
    the attempt must see that it won, publish, and keep its files."""
    proxy, fs, root = faulty_s3
    layout = RunLayout.locate(fs, root, "run1")
    proxy.inject(FaultRule(fault))
    assert commit_shard(layout, "s1", new_attempt_id(), {"data": data_table("s1", "x")}, {})
    assert proxy.faults(fault) == 1
    assert read_published(layout, "data", DATA_SCHEMA).num_rows == 3
    assert verify_committed(layout) == {}


def test_a_local_link_with_an_ambiguous_error_reads_the_manifest_back(tmp_path, monkeypatch):
    """An NFS-style link that took effect but reported an error counts as ours, and only ours."""
    fs, path = fsspec.filesystem("file"), str(tmp_path / "manifests" / "m.json")
    real_link = os.link

    def link_then_fail(source, target):
        real_link(source, target)
        raise OSError(errno.EIO, "lost reply")

    monkeypatch.setattr(os, "link", link_then_fail)
    assert create_exclusive(fs, path, b"ours")
    assert not create_exclusive(fs, path, b"theirs")
    monkeypatch.setattr(os, "link", lambda *_: (_ for _ in ()).throw(OSError(errno.EIO, "x")))
    with pytest.raises(OSError, match="x"):  # nothing was written: the caller must retry
        create_exclusive(fs, str(tmp_path / "manifests" / "other.json"), b"ours")


def test_finish_publishes_repairs_what_staging_holds_and_verify_names_what_it_cannot(store):
    fs, root = store
    layout = RunLayout.locate(fs, root, "run1")
    for shard_id in ("s1", "s2", "s3"):
        attempt_id = new_attempt_id()
        tables = {kind: data_table(shard_id, kind) for kind in ("data", "errors", "metrics")}
        sizes = {kind: write_parquet(fs, f"{layout.attempt_dir(shard_id, attempt_id)}/"
                                         f"{kind}.parquet", table)
                 for kind, table in tables.items()}
        manifest = {"shard_id": shard_id, "attempt_id": attempt_id,
                    "files": {k: [layout.relative_published(k, shard_id)] for k in tables},
                    "rows": {k: 3 for k in tables}, "bytes": sizes}
        assert create_exclusive(fs, layout.manifest(shard_id), json.dumps(manifest).encode())
    publish(layout, read_manifest(layout, "s1"))  # s1 finished; s2, s3 crashed before publish
    fs.rm(f"{layout.attempt_dir('s3', read_manifest(layout, 's3')['attempt_id'])}/data.parquet")
    loser = f"{layout.attempt_dir('s2', new_attempt_id())}/data.parquet"
    write_parquet(fs, loser, data_table("s2", "loser"))

    outcome = finish_publishes(layout)
    assert outcome["s2"] == "published from staging" and "s1" not in outcome
    assert "missing both" in outcome["s3"] and "data file" in outcome["s3"]
    assert sweep_losing_attempts(layout) == 1 and not fs.exists(loser)
    assert set(verify_committed(layout)) == {"s3"}
    assert "data file" in verify_committed(layout)["s3"]  # errors and metrics were published
    assert "metrics" not in verify_committed(layout)["s3"]
    assert finish_publishes(layout).keys() == {"s3"}  # idempotent: s2 stays published
    fs.pipe_file(layout.published("errors", "s1"), b"truncated")
    assert "bytes" in verify_committed(layout)["s1"]
