"""A run killed with SIGKILL mid-way and rerun equals an uninterrupted run: same ids, same
greedy completions, no duplicates, and shards committed before the kill are not regenerated."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import pyarrow.dataset as ds
import pytest
import yaml
from pipeline_fixtures import (
    good_rows,
    run_config,
    tiny_engine,
    write_jsonl,
)

from flows.generate import generate_corpus

SHARDS = 12


def attempts(root) -> dict[str, str]:
    return {p.name: json.loads(p.read_text())["attempt_id"] for p in root.glob("manifests/*.json")}


def completions(root) -> dict[str, str]:
    table = ds.dataset(root / "data", partitioning="hive").to_table(columns=["id", "completion"])
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "duplicate records"
    return dict(zip(ids, table.column("completion").to_pylist(), strict=True))


def corpusgen_run(config_path, api_url) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_API_URL": api_url, "DO_NOT_TRACK": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    command = [str(Path(sys.executable).with_name("corpusgen")), "run", str(config_path)]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_sigkill_then_rerun_equals_an_uninterrupted_run(
    tmp_path, tiny_llama_dir, prefect_server
):
    rows = good_rows(SHARDS * 3)
    write_jsonl(tmp_path / "in.jsonl", rows)
    config = run_config(str(tmp_path / "in.jsonl"), str(tmp_path / "killed"),
                        tiny_engine(tiny_llama_dir), sharding={"rows_per_shard": 3},
                        shard_lease_seconds=3)  # the killed run's leases expire soon
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(config))

    process = corpusgen_run(config_path, prefect_server)
    deadline = time.monotonic() + 300
    while not attempts(tmp_path / "killed") and process.poll() is None:
        assert time.monotonic() < deadline, "no shard committed within 300 s"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    before = attempts(tmp_path / "killed")
    assert 0 < len(before) < SHARDS, f"kill landed after {len(before)} of {SHARDS} shards"

    rerun = corpusgen_run(config_path, prefect_server)
    output = rerun.communicate(timeout=600)[0].decode()
    assert rerun.returncode == 0, output
    after = attempts(tmp_path / "killed")
    assert len(after) == SHARDS
    assert {name: after[name] for name in before} == before  # committed shards not regenerated
    assert "Generated records:" in output
    assert not fsspec.filesystem("file").glob(f"{tmp_path}/killed/_attempts/**/*.parquet")

    uninterrupted = {**config, "output": str(tmp_path / "clean")}
    generate_corpus(uninterrupted)
    resumed = completions(tmp_path / "killed")
    assert resumed == completions(tmp_path / "clean")
    assert set(resumed) == {row["id"] for row in rows}
