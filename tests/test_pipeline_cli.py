"""The `corpusgen` CLI: plan prints without writing, bad configs/inputs exit 2 with the reason,
and the demo runs end to end with the packaged SmolLM2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as ds
import pytest
import yaml
from pipeline_fixtures import good_rows, prefect_server, write_jsonl  # noqa: F401
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
def test_demo_runs_end_to_end(tmp_path, smollm2_spec, prefect_server):  # noqa: F811
    env = {**os.environ, "PREFECT_API_URL": prefect_server}
    command = [str(Path(sys.executable).with_name("corpusgen")), "demo", "--output",
               str(tmp_path / "demo"), "--set", "generation.sampling.max_new_tokens=4"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Generated records:" in result.stdout and "Metrics:" in result.stdout
    data = ds.dataset(tmp_path / "demo" / "data", partitioning="hive").to_table()
    assert data.num_rows == 24 and len(set(data.column("id").to_pylist())) == 24
