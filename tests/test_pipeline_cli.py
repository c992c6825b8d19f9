"""The `corpusgen` CLI: plan prints without writing, bad configs/inputs exit 2 with the reason,
and the demo runs end to end with the packaged SmolLM2."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pyarrow.dataset as ds
import pytest
import s3fs
import yaml
from pipeline_fixtures import good_rows, tiny_engine, write_jsonl
from s3_fault_proxy import FaultRule, S3FaultProxy
from typer.testing import CliRunner

from flows.cli import app

runner = CliRunner()


def write_config(tmp_path, **overrides) -> Path:
    config = {
        "input": {"uri": str(tmp_path / "in.jsonl"), "prompt_field": "prompt", "id_field": "id"},
        "generation": {"engine": {"target": {"path": "unused"}}},
        "output": str(tmp_path / "out"),
        "sharding": {"rows_per_shard": 10},
        **overrides,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_plan_prints_shards_and_buckets_and_writes_nothing(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", good_rows(45))
    result = runner.invoke(app, ["plan", str(write_config(tmp_path)), "--set",
                                 "sharding.rows_per_shard=15"])
    assert result.exit_code == 0, result.output
    assert ": 3 shards" in result.output and "estimated rows: 45" in result.output
    assert "batch [1, 2, 4, 8]" in result.output
    assert not (tmp_path / "out").exists()


def test_bad_config_and_missing_input_exit_2_with_the_reason(tmp_path):
    result = runner.invoke(app, ["plan", str(write_config(tmp_path, seed="x", extra=1))])
    assert result.exit_code == 2
    assert "seed:" in result.output and "extra: unknown field" in result.output
    result = runner.invoke(app, ["run", str(write_config(tmp_path))])
    assert result.exit_code == 2 and "matches no input files" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_judge_demo_generates_judges_and_keeps_end_to_end(tmp_path, smollm2_spec,
                                                               prefect_server):
    """`corpusgen demo --example judge`: the chat demo, then SmolLM2 grading each answer."""
    env = {**os.environ, "PREFECT_API_URL": prefect_server}
    command = [str(Path(sys.executable).with_name("corpusgen")), "demo", "--example", "judge",
               "--output", str(tmp_path / "demo")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Kept records:" in result.stdout and "Filtered records:" in result.stdout
    answers = ds.dataset(tmp_path / "demo" / "generate" / "data", partitioning="hive").to_table()
    assert answers.num_rows == 24 and len(set(answers.column("id").to_pylist())) == 24
    judged = {kind: read_rows(tmp_path / "demo" / "judge" / kind)
              for kind in ("data", "filtered", "errors")}
    assert sorted(r["parent_id"] for r in judged["data"] + judged["filtered"]) + sorted(
        r["id"].rsplit("#", 1)[0] for r in judged["errors"]) == sorted(  # id#sample_index
        answers.column("id").to_pylist())
    assert judged["data"] and judged["filtered"]  # the demo shows both sides of the rule
    for record in judged["data"]:
        assert json.loads(record["completion"])["score"] >= 3
    for record in judged["filtered"]:
        assert json.loads(record["completion"])["score"] < 3
        assert record["filter_reason"].endswith("not >= 3")


def read_rows(path: Path) -> list[dict]:
    return ds.dataset(path, partitioning="hive").to_table().to_pylist() if path.exists() else []


def corpusgen(args: list[str], env: dict[str, str], timeout: int = 600):
    command = [str(Path(sys.executable).with_name("corpusgen")), *args]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    return result.returncode, result.stdout + result.stderr


def s3_input_config(tmp_path, endpoint_url: str, fs) -> Path:
    write_jsonl(tmp_path / "in.jsonl", good_rows(4))
    fs.put(str(tmp_path / "in.jsonl"), "corpus-test/in/in.jsonl")
    return write_config(tmp_path, input={"uri": "s3://corpus-test/in/*.jsonl",
                                         "prompt_field": "prompt"},
                        output="s3://corpus-test/out", storage={"endpoint_url": endpoint_url})


def test_a_missing_s3_input_is_named_with_its_scheme(s3_bucket, tmp_path):
    config = write_config(tmp_path, input={"uri": "s3://corpus-test/nothing/*.jsonl",
                                           "prompt_field": "prompt"},
                          storage={"endpoint_url": s3_bucket["endpoint_url"]})
    result = runner.invoke(app, ["plan", str(config)])
    assert result.exit_code == 2
    assert "'s3://corpus-test/nothing/*.jsonl' matches no input files" in result.output


def test_missing_or_refused_s3_credentials_give_one_line_naming_the_variables(
    s3_bucket, tmp_path
):
    fs = s3fs.S3FileSystem(endpoint_url=s3_bucket["endpoint_url"], skip_instance_cache=True)
    no_credentials = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_EC2_METADATA_DISABLED": "true",
    }
    status, output = corpusgen(
        ["run", str(s3_input_config(tmp_path, s3_bucket["endpoint_url"], fs))], no_credentials
    )
    assert status == 2, output
    assert "NoCredentialsError" in output, output
    assert "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in output, output
    assert len(output.strip().splitlines()) <= 3 and "Traceback" not in output, output

    proxy = S3FaultProxy(s3_bucket["endpoint_url"])
    proxy.inject(FaultRule("deny", "*", ".*", times=1000))
    try:
        status, output = corpusgen(["run", str(s3_input_config(tmp_path, proxy.url, fs))],
                                   dict(os.environ))
    finally:
        proxy.close()
    assert status == 2 and proxy.faults("deny") > 0, output
    assert "credentials missing or refused" in output and "AWS_SECRET_ACCESS_KEY" in output
    assert len(output.strip().splitlines()) <= 3 and "Traceback" not in output, output


@pytest.mark.slow
def test_a_bad_model_path_fails_the_run_in_one_line_without_retries(
    tmp_path, prefect_server
):
    write_jsonl(tmp_path / "in.jsonl", good_rows(4))
    config = write_config(tmp_path, generation={"engine": {"target": {"path": "/no/such/model"}}},
                          shard_retries=2)
    status, output = corpusgen(["run", str(config)], {**os.environ,
                                                      "PREFECT_API_URL": prefect_server})
    last_line = output.strip().splitlines()[-1]
    assert status == 1, output
    assert "1 shard(s) failed" in last_line and "cannot load the engine" in last_line, output
    assert "/no/such/model" in last_line and "Traceback" not in output, output
    assert "Retry 1/" not in output  # a missing model is not an I/O hiccup
    assert not list((tmp_path / "out").glob("manifests/*.json"))


def without_api_url(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}, **extra}


def test_a_local_server_that_does_not_start_in_time_is_explained(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", good_rows(2))
    env = without_api_url(PREFECT_HOME=str(tmp_path / "prefect"),
                          PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="0")
    status, output = corpusgen(["run", str(write_config(tmp_path))], env)
    assert status == 1, output
    assert "Prefect's local server did not answer within 0 s" in output, output
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" in output
    assert "Traceback" not in output, output


def test_a_local_server_that_dies_at_start_is_reported_at_once_with_its_cause(tmp_path):
    """Its database cannot be opened: the server exits, and the CLI says so in seconds, not
    after the 120 s start-up timeout."""
    write_jsonl(tmp_path / "in.jsonl", good_rows(2))
    (tmp_path / "not-a-dir").write_text("")
    env = without_api_url(PREFECT_API_DATABASE_CONNECTION_URL=(
        f"sqlite+aiosqlite:///{tmp_path}/not-a-dir/prefect.db"))
    started = time.monotonic()
    status, output = corpusgen(["run", str(write_config(tmp_path))], env)
    assert status == 1, output
    assert time.monotonic() - started < 60, output
    last = output.strip().splitlines()[-1]
    assert last.startswith("Prefect's local server exited with code"), output
    assert "Traceback" not in output, output


def test_a_local_server_whose_port_is_taken_before_it_binds_starts_on_another(monkeypatch):
    """CI lost a run this way: the port was free when chosen, another process took it during
    the server's migrations, and uvicorn exited 3 with "address already in use"."""
    from flows import local_server

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        choose, ports = local_server.free_listen_port, iter([taken])
        monkeypatch.setattr(
            local_server, "free_listen_port", lambda avoid: next(ports, 0) or choose(avoid)
        )
        server = local_server.LocalServer()
        try:
            server.wait_healthy(timeout=240)
            assert server.port != taken
            assert httpx.get(f"{server.api_url}/health").status_code == 200
        finally:
            server.stop()
            server.log.unlink(missing_ok=True)


@pytest.mark.slow
def test_a_local_module_named_like_the_stdlib_does_not_break_the_server(
    tmp_path, tiny_llama_dir
):
    """An `inspect.py` in the working directory shadowed the standard library in Prefect's
    temporary server; ours keeps the working directory off its import path."""
    write_jsonl(tmp_path / "in.jsonl", good_rows(2))
    (tmp_path / "inspect.py").write_text("raise SystemExit('this is not the stdlib inspect')\n")
    config = write_config(tmp_path, generation={"engine": tiny_engine(tiny_llama_dir),
                                                "sampling": {"max_new_tokens": 2}})
    command = [str(Path(sys.executable).with_name("corpusgen")), "run", str(config)]
    result = subprocess.run(command, cwd=tmp_path, env=without_api_url(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Generated records:" in result.stdout


@pytest.mark.parametrize("problem", ["output is a file", "output not writable", "input unreadable"])
def test_a_path_the_operator_must_fix_is_one_line_and_exit_2(tmp_path, problem):
    write_jsonl(tmp_path / "in.jsonl", good_rows(2))
    overrides: dict = {}
    if problem == "output is a file":
        (tmp_path / "taken").write_text("")
        overrides["output"] = str(tmp_path / "taken")
        expected = f"output {str(tmp_path / 'taken')!r} is a file, not a directory"
    elif problem == "output not writable":
        overrides["output"] = "/sys/corpusgen-out"  # refused even to root
        expected = "output '/sys/corpusgen-out' is not writable (Operation not permitted"
    else:  # a file that exists but that no user, root included, may read
        overrides["input"] = {"uri": "/proc/1/mem", "format": "jsonl", "prompt_field": "prompt"}
        expected = "input file '/proc/1/mem' cannot be read (Permission denied)"
    result = runner.invoke(app, ["run", str(write_config(tmp_path, **overrides))])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), result.output
    debug = runner.invoke(app, ["--debug", "run", str(write_config(tmp_path, **overrides))])
    assert debug.exit_code != 0 and debug.exception is not None  # --debug: the real error


def test_an_empty_input_is_said_plainly_by_plan_and_run_alike(tmp_path):
    (tmp_path / "in.jsonl").write_text("")
    config = str(write_config(tmp_path))
    for command in ("plan", "run"):
        result = runner.invoke(app, [command, config])
        assert result.exit_code == 2, result.output
        assert result.output.strip() == (
            f"input.uri {str(tmp_path / 'in.jsonl')!r} has no rows: 1 file(s), all empty; "
            "nothing to generate"
        )
    assert not (tmp_path / "out" / "manifests").exists()
