"""End to end with the real engine on a tiny random Llama, the real Prefect API (test server)
and real storage (local folder, moto S3 server): rows out = valid rows in, planted bad rows in
the errors dataset, ids unique, reruns skip committed shards, budget stops scheduling."""

from __future__ import annotations

import json
import os
import threading

import fsspec
import pyarrow.dataset as ds
import pytest
import s3fs
from pipeline_fixtures import (
    LONG_PROMPT_ROW,
    good_rows,
    run_config,
    tiny_engine,
    write_jsonl,
    write_parquet,
)

from flows.generate import generate_corpus, generate_shards
from schemas import ConfigError, parse_run_config
from tasks.engine_cache import loaded_engine_count
from tasks.failures import InputChanged
from tasks.layout import RunLayout
from tasks.planning import InputError

pytestmark = pytest.mark.usefixtures("prefect_server")


def make_input(root) -> tuple[set[str], list[str]]:
    """JSONL with planted bad rows + Parquet + a too-long prompt -> (valid ids, bad reasons)."""
    jsonl_rows, parquet_rows = good_rows(20), good_rows(12, start=500)
    reasons = write_jsonl(root / "part-a.jsonl", [*jsonl_rows, LONG_PROMPT_ROW], bad_every=4)
    write_parquet(root / "part-b.parquet", parquet_rows, row_group_size=5)
    return {row["id"] for row in jsonl_rows + parquet_rows}, [*reasons, "prompt_too_long"]


def read_dataset(fs, root: str, kind: str):
    return ds.dataset(f"{root}/{kind}", filesystem=fs, partitioning="hive").to_table()


def check_outputs(fs, root: str, valid_ids: set[str], reasons: list[str], summary: dict):
    data = read_dataset(fs, root, "data")
    ids = data.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == len(valid_ids) and set(ids) == valid_ids
    assert all(data.column("completion_tokens").to_pylist())
    errors = read_dataset(fs, root, "errors")
    assert sorted(r.split(":")[0] for r in errors.column("reason").to_pylist()) == sorted(reasons)
    metrics = read_dataset(fs, root, "metrics")
    assert metrics.num_rows == summary["shards_planned"] == summary["shards_committed"]
    assert sum(metrics.column("ok_rows").to_pylist()) == summary["ok_rows"] == len(valid_ids)
    assert sum(metrics.column("error_rows").to_pylist()) == summary["error_rows"] == len(reasons)
    assert summary["generated_tokens"] == sum(data.column("completion_tokens").to_pylist())
    row = metrics.slice(0, 1).to_pylist()[0]
    assert row["worker_id"].endswith(f":{os.getpid()}") and row["engine_version"]
    assert row["cost"] > 0 and row["device_type"] == "cpu" and row["target_weights_sha256"]
    assert row["started_at"] <= row["finished_at"] and row["wall_seconds"] > 0
    return data


def manifests(fs, root: str) -> dict[str, str]:
    return {p: json.loads(fs.cat_file(p))["attempt_id"] for p in fs.glob(f"{root}/manifests/*")}


def test_local_run_then_rerun_skips_committed_shards(tmp_path, tiny_llama_dir):
    valid_ids, reasons = make_input(tmp_path / "in")
    config = run_config(str(tmp_path / "in"), str(tmp_path / "out"), tiny_engine(tiny_llama_dir),
                        accelerator_slots=2)
    engines_before = loaded_engine_count()
    summary = generate_corpus(config)
    assert loaded_engine_count() - engines_before <= 1  # one engine for all shards
    fs = fsspec.filesystem("file")
    data = check_outputs(fs, str(tmp_path / "out"), valid_ids, reasons, summary)
    assert summary["stopped_on_budget"] is False and summary["shards_planned"] >= 4
    committed = manifests(fs, str(tmp_path / "out"))
    again = generate_corpus(config)
    assert manifests(fs, str(tmp_path / "out")) == committed  # nothing regenerated
    assert again["ok_rows"] == summary["ok_rows"]
    assert read_dataset(fs, str(tmp_path / "out"), "data").equals(data)
    assert not fs.glob(f"{tmp_path}/out/_attempts/**/*.parquet")

    from prefect import get_client

    with get_client(sync_client=True) as client:
        keys = {a.key for a in client.read_artifacts()}
    assert {"corpusgen-run-summary", "corpusgen-cost-report"} <= keys


def test_s3_run_keeps_credentials_out_of_outputs(s3_bucket, tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDPIPELINETEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "never-write-this-secret")
    valid_ids, reasons = make_input(tmp_path / "in")
    fs = s3fs.S3FileSystem(endpoint_url=s3_bucket["endpoint_url"])
    fs.put(str(tmp_path / "in") + "/", "corpus-test/in/", recursive=True)
    config = run_config(
        "s3://corpus-test/in/part-*", "s3://corpus-test/out", tiny_engine(tiny_llama_dir),
        storage={"endpoint_url": s3_bucket["endpoint_url"]},
    )
    summary = generate_corpus(config)
    check_outputs(fs, "corpus-test/out", valid_ids, reasons, summary)
    assert summary["data"].startswith("s3://corpus-test/out/data/run_date=")
    for path in fs.find("corpus-test/out"):
        content = fs.cat_file(path)
        assert b"never-write-this-secret" not in content and b"AKIDPIPELINETEST" not in content


def test_budget_stops_scheduling_and_keeps_committed_shards(tmp_path, tiny_llama_dir):
    write_jsonl(tmp_path / "in.jsonl", good_rows(40))
    config = run_config(
        str(tmp_path / "in.jsonl"), str(tmp_path / "out"), tiny_engine(tiny_llama_dir),
        pricing={"device_type": "cpu", "usd_per_device_hour": 3600.0},  # $1 per second
        cost_cap_usd=0.001,
    )
    summary = generate_corpus(config)
    assert summary["stopped_on_budget"] is True
    assert summary["shards_committed"] == 1
    assert summary["shards_not_scheduled"] == summary["shards_planned"] - 1
    data = read_dataset(fsspec.filesystem("file"), str(tmp_path / "out"), "data")
    assert data.num_rows == summary["ok_rows"] > 0


def test_generate_shards_runs_a_planned_batch(tmp_path, tiny_llama_dir):
    """What a deployment's worker runs: only the shards asked for, from the recorded plan."""
    write_jsonl(tmp_path / "in.jsonl", good_rows(24))
    config = run_config(str(tmp_path / "in.jsonl"), str(tmp_path / "out"),
                        tiny_engine(tiny_llama_dir))
    with pytest.raises(FileNotFoundError, match="no plan for run"):
        generate_shards(config, ["x"])
    from flows.generate import plan_run

    plan = plan_run(parse_run_config(config))
    wanted = [plan.shards[0].shard_id, plan.shards[2].shard_id]
    outcomes = generate_shards(config, wanted)
    assert [o["status"] for o in outcomes] == ["committed", "committed"]
    layout = RunLayout.locate(fsspec.filesystem("file"), str(tmp_path / "out"), plan.run_id)
    assert {layout.shard_id_of_manifest(p) for p in manifests(layout.fs, layout.root)} == set(
        wanted
    )


def test_invalid_config_and_missing_input_write_nothing(tmp_path, tiny_llama_dir):
    bad = run_config(str(tmp_path / "in.jsonl"), str(tmp_path / "out"),
                     tiny_engine(tiny_llama_dir), accelerator_slots=0)
    with pytest.raises(ConfigError, match="accelerator_slots"):
        generate_corpus(bad)
    missing = run_config(str(tmp_path / "nothing-*.jsonl"), str(tmp_path / "out"),
                         tiny_engine(tiny_llama_dir))
    with pytest.raises(InputError, match="matches no input files"):
        generate_corpus(missing)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_smollm2_end_to_end(tmp_path, smollm2_spec):
    """The packaged SmolLM2 on chat prompts: real text back; planted bad rows are error rows."""
    chats = [
        {"id": f"chat-{i}", "messages": [{"role": "user", "content": row["prompt"]}]}
        for i, row in enumerate(good_rows(4))
    ]
    bad = ['{"id": "broken", "messages": [', '{"id": "no-chat"}',
           '{"id": "bad-role", "messages": [{"role": "robot", "content": "hi"}]}']
    lines = [json.dumps(chat) for chat in chats[:2]] + bad + [json.dumps(c) for c in chats[2:]]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    engine = {**tiny_engine("unused"), "target": smollm2_spec.model_dump()}
    engine["bucket_grid"] = {"batch_sizes": [4], "prompt_lengths": [64], "cache_lengths": [80],
                             "draft_lengths": [2]}
    config = run_config(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), engine)
    config["input"] = {"uri": str(tmp_path / "in.jsonl"), "messages_field": "messages",
                       "id_field": "id"}
    summary = generate_corpus(config)
    data = check_outputs(fsspec.filesystem("file"), str(tmp_path / "out"),
                         {chat["id"] for chat in chats},
                         ["malformed_json", "missing_field", "wrong_type"], summary)
    texts = data.column("completion").to_pylist()
    assert all(sum(c.isalpha() for c in text) >= 8 for text in texts), texts


def test_s3_credentials_from_a_prefect_secret_block(s3_bucket, monkeypatch):
    """Keys held in a Prefect Secret block reach s3fs without touching config or environment."""
    from prefect.blocks.system import Secret

    from schemas.run import StorageSpec
    from tasks.storage import filesystem

    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    Secret(value={"key": "block-key", "secret": "block-secret"}).save("s3-test", overwrite=True)
    storage = StorageSpec(endpoint_url=s3_bucket["endpoint_url"], prefect_secret_block="s3-test")
    fs, path = filesystem("s3://corpus-test/x", storage)
    assert (fs.key, fs.secret, path) == ("block-key", "block-secret", "corpus-test/x")
    fs.pipe_file(f"{path}/probe", b"ok")
    assert fs.cat_file(f"{path}/probe") == b"ok"
    Secret(value="not-a-mapping").save("s3-bad", overwrite=True)
    with pytest.raises(ValueError, match=r'must hold \{"key"'):
        filesystem("s3://corpus-test/x", StorageSpec(prefect_secret_block="s3-bad"))


@pytest.mark.parametrize("leases", ["held", "lost to a stall"])
def test_two_concurrent_attempts_at_one_shard_commit_once(
    tmp_path, tiny_llama_dir, monkeypatch, leases
):
    """Two attempts start together (neither sees a manifest). With the shard's lease, the
    second generates nothing. Had the first stalled past its lease, so that both generate,
    exactly one still commits; the loser reports the winner's numbers and leaves no files."""
    from concurrent.futures import ThreadPoolExecutor

    from flows.generate import plan_run
    from tasks import leases as leases_module
    from tasks.layout import run_layout
    from tasks.shard import process_shard

    write_jsonl(tmp_path / "in.jsonl", good_rows(6))
    config = parse_run_config(run_config(str(tmp_path / "in.jsonl"), str(tmp_path / "out"),
                                         tiny_engine(tiny_llama_dir)))
    shard = plan_run.fn(config).shards[0]
    layout = run_layout(config)
    barrier = threading.Barrier(2)
    if leases == "lost to a stall":  # each attempt gets a lease of its own generation
        generations = iter(range(2))
        monkeypatch.setattr(leases_module, "take", lambda layout, shard_id, seconds:
                            leases_module.Lease(layout, shard_id, next(generations), "x", seconds))
        expected = ["committed", "lost"]
    else:
        expected = ["committed", "leased"]

    def attempt(_):
        barrier.wait()
        return process_shard(config, layout, shard)

    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(attempt, range(2)))
    assert sorted(o.status for o in outcomes) == expected
    if leases != "held":
        assert outcomes[0].summary == outcomes[1].summary
    assert len(layout.fs.glob(layout.manifests_glob)) == 1
    data = read_dataset(layout.fs, layout.root, "data")
    assert sorted(data.column("id").to_pylist()) == [row["id"] for row in good_rows(6)]
    assert not layout.fs.glob(f"{layout.root}/_attempts/**/*.parquet")


def test_an_input_file_changed_mid_run_fails_the_run_naming_the_file_and_its_shards(
    tmp_path, tiny_llama_dir, monkeypatch
):
    """A line prepended after the first commit shifts every byte range: the run must fail
    (not publish a shifted read), and the rerun is refused until the operator decides."""
    from tasks import shard as shard_module

    source = tmp_path / "in.jsonl"
    write_jsonl(source, good_rows(24))
    config = run_config(str(source), str(tmp_path / "out"), tiny_engine(tiny_llama_dir),
                        sharding={"rows_per_shard": 8})
    commit = shard_module.commit_shard

    def commit_then_prepend(*args, **kwargs):
        won = commit(*args, **kwargs)
        if not source.read_text().startswith('{"id": "new"'):
            source.write_text('{"id": "new", "prompt": "a line added mid-run"}\n'
                              + source.read_text())
        return won

    monkeypatch.setattr(shard_module, "commit_shard", commit_then_prepend)
    with pytest.raises(InputChanged) as failed:
        generate_corpus(config)
    message = str(failed.value)
    assert f"input file {str(source)!r} changed during the run" in message
    assert "3 shard(s) were planned from the old version" in message
    assert "--set run_id=<new id>" in message
    fs = fsspec.filesystem("file")
    assert len(manifests(fs, str(tmp_path / "out"))) == 1  # the later shards read nothing old
    with pytest.raises(InputError, match=r"planned on different input.*--set run_id=<new id>"):
        generate_corpus(config)
