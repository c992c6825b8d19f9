"""Exactly once under the faults object storage really has, end to end: the real CLI and flow,
the tiny random Llama, a moto S3 server behind a fault-injecting proxy. Lost answers to the
conditional manifest PUT, 503 SlowDown, and SIGKILLs at every commit point, each followed by
reruns, end with every input id exactly once in data or errors and nothing committed lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as ds
import pytest
import s3fs
import yaml
from pipeline_fixtures import (
    good_rows,
    run_config,
    tiny_engine,
    write_jsonl,
)
from s3_fault_proxy import FaultRule, S3FaultProxy

from flows.generate import generate_corpus
from tasks.commit import verify_committed
from tasks.failures import RunFailed
from tasks.layout import RunLayout

pytestmark = pytest.mark.usefixtures("prefect_server")
BUCKET_ROOT = "corpus-test/out"


@pytest.fixture
def faulty_s3(s3_bucket):
    proxy = S3FaultProxy(s3_bucket["endpoint_url"])
    yield proxy, s3fs.S3FileSystem(endpoint_url=s3_bucket["endpoint_url"],
                                   skip_instance_cache=True)
    proxy.close()


def s3_config(tmp_path, fs, proxy, model_dir, rows: int, rows_per_shard: int) -> dict:
    write_jsonl(tmp_path / "in.jsonl", good_rows(rows))
    fs.put(str(tmp_path / "in.jsonl"), "corpus-test/in/in.jsonl")
    config = run_config("s3://corpus-test/in/in.jsonl", f"s3://{BUCKET_ROOT}",
                        tiny_engine(model_dir), sharding={"rows_per_shard": rows_per_shard},
                        storage={"endpoint_url": proxy.url}, run_id="faults",
                        shard_lease_seconds=3)  # a killed run's leases expire soon
    config["generation"]["sampling"]["max_new_tokens"] = 4
    return config


def assert_exactly_once(fs, expected_ids: set[str]) -> None:
    """Each input id once in data or errors, and every committed file as its manifest says."""
    ids = []
    for kind in ("data", "errors"):
        table = ds.dataset(f"{BUCKET_ROOT}/{kind}", filesystem=fs, partitioning="hive").to_table()
        ids += table.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "duplicate records"
    assert set(ids) == expected_ids
    assert verify_committed(RunLayout.locate(fs, BUCKET_ROOT, "faults")) == {}


def manifests(fs) -> dict[str, str]:
    return {path: json.loads(fs.cat_file(path))["attempt_id"]
            for path in fs.glob(f"{BUCKET_ROOT}/manifests/*.json")}


def corpusgen_run(config: dict, tmp_path: Path, api_url: str) -> subprocess.Popen:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PREFECT_API_URL": api_url}
    command = [str(Path(sys.executable).with_name("corpusgen")), "run", str(path)]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_lost_acks_and_slow_downs_end_exactly_once_in_one_run(
    tmp_path, faulty_s3, tiny_llama_dir
):
    """Every manifest PUT is applied but its answer lost (the retry gets 412), and staging and
    publishing get 503s: the run must still commit and publish every shard, once."""
    proxy, fs = faulty_s3
    config = s3_config(tmp_path, fs, proxy, tiny_llama_dir, rows=8, rows_per_shard=2)
    proxy.inject(
        FaultRule("lost_ack", "PUT", r"/manifests/", times=100, once_per_path=True),
        FaultRule("lost_ack", "PUT", r"/plan\.json", times=1),
        FaultRule("slow_down", "PUT", r"/_attempts/", times=4),
        FaultRule("slow_down", "*", r"/data/run_date", times=4),
    )
    summary = generate_corpus(config)
    assert proxy.faults("lost_ack") == summary["shards_planned"] + 1 > 2
    assert proxy.faults("slow_down") == 8
    assert summary["shards_committed"] == summary["shards_planned"]
    assert_exactly_once(fs, {row["id"] for row in good_rows(8)})


def test_a_committed_file_lost_for_good_fails_the_run_naming_the_shard(
    tmp_path, faulty_s3, tiny_llama_dir
):
    proxy, fs = faulty_s3
    config = s3_config(tmp_path, fs, proxy, tiny_llama_dir, rows=4, rows_per_shard=2)
    generate_corpus(config)
    lost = sorted(fs.glob(f"{BUCKET_ROOT}/data/**/*.parquet"))[0]
    fs.rm(lost)
    shard_id = lost.rsplit("/", 1)[-1].removesuffix(".parquet")
    with pytest.raises(RunFailed, match=f"{shard_id}: committed data file .* is missing"):
        generate_corpus(config)


@pytest.mark.slow
def test_sigkill_right_after_the_manifest_commit_is_finished_by_the_rerun(
    tmp_path, faulty_s3, tiny_llama_dir, prefect_server
):
    """The issue's case: the CLI dies the moment S3 applied its manifest PUT; the rerun must
    publish that attempt's staged files, not skip the shard with its records missing."""
    proxy, fs = faulty_s3
    config = s3_config(tmp_path, fs, proxy, tiny_llama_dir, rows=6, rows_per_shard=2)
    proxy.inject(FaultRule("kill", "PUT", r"/manifests/"))
    killed = corpusgen_run(config, tmp_path, prefect_server)
    proxy.kill_pid = killed.pid
    killed.communicate(timeout=300)
    assert killed.returncode == -9 and proxy.faults("kill") == 1
    committed = manifests(fs)
    assert len(committed) == 1 and not fs.glob(f"{BUCKET_ROOT}/data/**/*.parquet")

    rerun = corpusgen_run(config, tmp_path, prefect_server)
    output = rerun.communicate(timeout=300)[0].decode()
    assert rerun.returncode == 0, output
    assert {path: manifests(fs)[path] for path in committed} == committed  # not regenerated
    assert_exactly_once(fs, {row["id"] for row in good_rows(6)})


@pytest.mark.slow
def test_random_faults_and_sigkills_at_every_commit_point_end_exactly_once(
    tmp_path, faulty_s3, tiny_llama_dir, prefect_server
):
    """Seeded random faults: SIGKILL after staging a file, after the manifest commit, after a
    publish copy and during clean-up deletes; lost answers and SlowDown on manifests and staged
    files; random 503s on everything else. Rerun until a run exits 0 (each kill costs one)."""
    proxy, fs = faulty_s3
    config = s3_config(tmp_path, fs, proxy, tiny_llama_dir, rows=10, rows_per_shard=2)
    rules = [
        FaultRule("kill", "PUT", r"/_attempts/"),
        FaultRule("kill", "PUT", r"/manifests/"),
        FaultRule("kill", "PUT", r"/(data|errors|metrics)/run_date"),
        FaultRule("kill", "POST", r"\?delete"),
        FaultRule("lost_ack", "PUT", r"/manifests/", times=3),
        FaultRule("slow_down", "PUT", r"/manifests/", times=2),
        FaultRule("lost_ack", "PUT", r"/_attempts/", times=2),
    ]
    proxy.randomize(seed=20261203, rules=rules, rate=0.5, any_slow_down=0.03)
    outputs = []
    for _ in range(8):
        process = corpusgen_run(config, tmp_path, prefect_server)
        proxy.kill_pid = process.pid
        outputs.append(process.communicate(timeout=300)[0].decode())
        if process.returncode == 0:
            break
        assert process.returncode == -9, outputs[-1]  # only our kills may stop a run
    else:
        pytest.fail(f"no clean run after {len(outputs)} tries:\n{outputs[-1]}")
    assert proxy.faults("kill") == len(outputs) - 1 >= 2, proxy.events
    assert proxy.faults("lost_ack") >= 2, proxy.events
    assert_exactly_once(fs, {row["id"] for row in good_rows(10)})


def test_a_worker_batch_that_fails_names_each_shard_and_its_cause(tmp_path):
    """What a deployment's child flow reports to its parent (its state message)."""
    from flows.generate import generate_shards, plan_run
    from schemas import parse_run_config

    write_jsonl(tmp_path / "in.jsonl", good_rows(4))
    config = run_config(str(tmp_path / "in.jsonl"), str(tmp_path / "out"),
                        tiny_engine("/no/such/model"), sharding={"rows_per_shard": 2})
    plan = plan_run(parse_run_config(config))
    wanted = [shard.shard_id for shard in plan.shards]
    with pytest.raises(RunFailed) as failure:
        generate_shards(config, wanted)
    message = str(failure.value)
    assert f"{len(wanted)} shard(s) failed" in message
    assert all(f"{shard_id}: EngineLoadError: cannot load" in message for shard_id in wanted)
