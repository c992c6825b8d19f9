"""`corpusgen plan` estimates: rows and prompt tokens from the tokenizer alone, expected tokens,
time and cost from an earlier real run under the same output (tiny random Llama, Prefect)."""

from __future__ import annotations

import pyarrow.dataset as ds
import yaml
from pipeline_fixtures import (
    LONG_PROMPT_ROW,
    good_rows,
    run_config,
    tiny_engine,
    write_jsonl,
)
from typer.testing import CliRunner

from flows.cli import app
from flows.generate import generate_corpus
from generation.loading import load_tokenizer
from schemas import parse_run_config
from tasks.prompting import render_prompt

runner = CliRunner()


def test_plan_estimates_before_and_after_a_run(tmp_path, tiny_llama_dir, prefect_server):
    rows = good_rows(10)
    write_jsonl(tmp_path / "in.jsonl", [*rows, LONG_PROMPT_ROW, {"id": "x", "text": "no prompt"}])
    config = run_config(str(tmp_path / "in.jsonl"), str(tmp_path / "out"),
                        tiny_engine(tiny_llama_dir), sharding={"rows_per_shard": 6})
    config["generation"]["samples_per_prompt"] = 2
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    tokenizer = load_tokenizer(tiny_llama_dir)
    spec = parse_run_config(config).input
    tokens = sum(len(render_prompt(tokenizer, row["prompt"], spec)[1]) for row in rows)

    before = runner.invoke(app, ["plan", str(path)])
    assert before.exit_code == 0, before.output
    assert "rows: 12 read, 1 unusable, 1 prompts too long for the grid; 20 completions" \
        in before.output
    assert f"prompt tokens (chat prompts): {tokens:,}" in before.output
    assert "generated tokens: at most 160" in before.output  # 20 x max_new_tokens 8
    assert "no committed runs with this model pair and device" in before.output
    assert not (tmp_path / "out").exists()

    generate_corpus(config)
    metrics = ds.dataset(tmp_path / "out" / "metrics", partitioning="hive").to_table()
    generated = sum(metrics.column("generated_tokens").to_pylist())
    ok = sum(metrics.column("ok_rows").to_pylist())
    finished = runner.invoke(app, ["plan", str(path)])
    assert finished.exit_code == 0, finished.output
    assert "is complete: all 2 shards are committed; 0 rows left to generate, $0" \
        in " ".join(finished.output.split())
    assert "expected cost" not in finished.output
    after = runner.invoke(app, ["plan", str(path), "--set", "seed=1"])  # a new run, same pair
    assert after.exit_code == 0, after.output
    expected = round(min(generated / ok, 8) * 20)
    assert f"expected generated tokens: {expected:,} " in after.output
    assert "in 1 earlier run(s)" in after.output and "expected cost: $" in after.output
    other_device = runner.invoke(app, ["plan", str(path), "--set", "seed=1", "--set",
                                       "pricing.device_type=gaudi2"])
    assert "no committed runs with this model pair and device" in other_device.output
