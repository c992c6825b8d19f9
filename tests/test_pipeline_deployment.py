"""dispatch.mode=deployment: the parent plans, sends batches of shards to a served
`generate_shards` deployment (separate processes), waits, and summarises committed metrics."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pyarrow.dataset as ds
import pytest
from pipeline_fixtures import (
    good_rows,
    run_config,
    tiny_engine,
    write_jsonl,
)

from flows.generate import generate_corpus

SERVE = "from flows.generate import generate_shards; generate_shards.serve(name='pipeline-test')"


@pytest.fixture
def served_deployment(prefect_server, tmp_path):
    """`generate_shards.serve()` in its own process; its log (child runs too) in serve.log."""
    env = {**os.environ, "PREFECT_API_URL": prefect_server}
    log = (tmp_path / "serve.log").open("wb")
    server = subprocess.Popen([sys.executable, "-c", SERVE], env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    from prefect import get_client

    deadline = time.monotonic() + 120
    with get_client(sync_client=True) as client:
        while True:
            try:
                client.read_deployment_by_name("generate-shards/pipeline-test")
                break
            except Exception:
                assert server.poll() is None and time.monotonic() < deadline, "serve failed"
                time.sleep(0.5)
    yield "generate-shards/pipeline-test"
    server.terminate()
    server.wait(timeout=30)
    log.close()


@pytest.mark.slow
def test_batches_run_in_deployment_processes(tmp_path, tiny_llama_dir, served_deployment):
    rows = good_rows(16)
    write_jsonl(tmp_path / "in.jsonl", rows)
    config = run_config(
        str(tmp_path / "in.jsonl"), str(tmp_path / "out"), tiny_engine(tiny_llama_dir),
        sharding={"rows_per_shard": 4}, accelerator_slots=2,
        dispatch={"mode": "deployment", "deployment": served_deployment, "shards_per_run": 2},
    )
    summary = generate_corpus(config)
    assert summary["shards_committed"] == summary["shards_planned"] == 4
    assert summary["ok_rows"] == len(rows)
    data = ds.dataset(tmp_path / "out" / "data", partitioning="hive").to_table()
    assert sorted(data.column("id").to_pylist()) == sorted(row["id"] for row in rows)
    metrics = ds.dataset(tmp_path / "out" / "metrics", partitioning="hive").to_table()
    workers = set(metrics.column("worker_id").to_pylist())
    assert f":{os.getpid()}" not in "".join(workers)  # generated in the deployment's processes
    from prefect import get_client

    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name("corpusgen-accelerators")
    assert limit.limit == 2 and limit.active_slots == 0  # sized from config, slots given back
