"""Shard leases on a local disk and on S3: one live holder per shard, taken over once it
expires, renewed while held; and two runs of one config split the shards instead of both
generating everything, also when one of them is SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest
import yaml
from pipeline_fixtures import good_rows, run_config, tiny_engine, write_jsonl

from tasks import leases
from tasks.commit import create_exclusive
from tasks.layout import RunLayout

CORPUSGEN = str(Path(sys.executable).with_name("corpusgen"))


def test_one_live_holder_per_shard_and_an_expired_lease_is_taken_over(store):
    fs, root = store
    layout = RunLayout(fs, root, "r1", "2026-12-06")
    first = leases.take(layout, "s1", seconds=1.0)
    assert first is not None and first.generation == 0
    assert leases.take(layout, "s1", seconds=1.0) is None  # held and live
    assert leases.take(layout, "s2", seconds=1.0) is not None  # other shards are free
    time.sleep(1.2)
    second = leases.take(layout, "s1", seconds=30.0)
    assert second is not None and second.generation == 1  # expired: the next generation
    assert leases.take(layout, "s1", seconds=30.0) is None
    second.release()
    third = leases.take(layout, "s1", seconds=30.0)
    assert third is not None and third.generation == 2


def test_a_held_lease_is_renewed_until_released(store):
    fs, root = store
    layout = RunLayout(fs, root, "r1", "2026-12-06")
    lease = leases.take(layout, "s1", seconds=1.5)
    with leases.held(lease):
        time.sleep(2.5)  # past the first expiry: renewals keep it live
        assert leases.take(layout, "s1", seconds=1.5) is None
    assert json.loads(fs.cat_file(lease.path))["expires_at"] == 0.0
    assert leases.take(layout, "s1", seconds=1.5) is not None


def test_the_waiter_gets_the_shard_when_it_is_committed_elsewhere_or_its_lease_expires(store):
    fs, root = store
    layout = RunLayout(fs, root, "r1", "2026-12-06")
    leases.take(layout, "s1", seconds=1.0)
    started = time.monotonic()
    lease = leases.wait_for(layout, "s1", 10.0, lambda: False, poll=0.2)
    assert lease is not None and lease.generation == 1 and time.monotonic() - started >= 0.8
    create_exclusive(fs, layout.manifest("s1"), b"{}")  # committed by the holder meanwhile
    assert leases.wait_for(layout, "s1", 10.0, lambda: False, poll=0.2) is None


def start_run(config_path: Path, api_url: str) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_API_URL": api_url}
    return subprocess.Popen([CORPUSGEN, "run", str(config_path)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def lease_config(tmp_path: Path, model_dir: Path, shards: int, lease_seconds: float) -> Path:
    write_jsonl(tmp_path / "in.jsonl", good_rows(shards * 4))
    engine = tiny_engine(model_dir)
    engine["bucket_grid"]["batch_sizes"] = [1]
    config = run_config(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), engine,
                        sharding={"rows_per_shard": 4}, shard_lease_seconds=lease_seconds)
    config["generation"]["sampling"]["max_new_tokens"] = 24
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def committed_by(root: Path) -> dict[str, str]:
    metrics = ds.dataset(root / "metrics", partitioning="hive").to_table()
    return dict(zip(metrics.column("shard_id").to_pylist(),
                    metrics.column("worker_id").to_pylist(), strict=True))


@pytest.mark.slow
def test_two_runs_of_one_config_split_the_shards_and_generate_each_once(
    tmp_path, tiny_llama_dir, prefect_server
):
    config = lease_config(tmp_path, tiny_llama_dir, shards=8, lease_seconds=60)
    runs = [start_run(config, prefect_server) for _ in range(2)]
    outputs = [run.communicate(timeout=400)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    workers = committed_by(tmp_path / "out")
    assert len(workers) == 8 and len(set(workers.values())) == 2, workers  # both did some
    for output in outputs:  # nobody generated a shard the other one committed
        assert " lost:" not in output and "another attempt" not in output, output
    ids = ds.dataset(tmp_path / "out" / "data", partitioning="hive").to_table().column("id")
    assert len(ids) == len(set(ids.to_pylist())) == 32


@pytest.mark.slow
def test_a_sigkilled_holders_shards_are_taken_over_when_its_lease_expires(
    tmp_path, tiny_llama_dir, prefect_server
):
    config = lease_config(tmp_path, tiny_llama_dir, shards=4, lease_seconds=4)
    root = tmp_path / "out"
    first = start_run(config, prefect_server)
    deadline = time.monotonic() + 240
    while not list(root.glob("leases/*.json")):
        assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    held = {p.name.split(".")[1] for p in root.glob("leases/*.json")
            if json.loads(p.read_text())["expires_at"] > time.time()}
    committed = {p.name.split(".")[1] for p in root.glob("manifests/*.json")}
    second = start_run(config, prefect_server)
    output = second.communicate(timeout=400)[0]
    assert second.returncode == 0, output
    assert len(committed_by(root)) == 4
    assert held - committed, "the kill landed after the lease holder committed"
    ids = ds.dataset(root / "data", partitioning="hive").to_table().column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 16
