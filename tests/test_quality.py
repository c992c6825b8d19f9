"""Runs guard their own quality and say what happened: every row failing exits non-zero, the
report works on zero tokens, error reasons are counted, engine load is billed once and apart,
shards in flight together never bill the same second twice; provenance and n samples per prompt.
Real engine (tiny random Llama, packaged SmolLM2), real Prefect test server, local storage."""

from __future__ import annotations

import json
import time

import pyarrow.dataset as ds
import pytest
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
from generation import kernels
from generation.packing import row_exact_kernel
from schemas import parse_run_config
from tasks.quality import QualityError, ends_in_loop, quality_problems

pytestmark = pytest.mark.usefixtures("prefect_server")
runner = CliRunner()


def read(root, kind: str) -> list[dict]:
    return ds.dataset(f"{root}/{kind}", partitioning="hive").to_table().to_pylist()


def summary_with(**values) -> dict:
    return {"run_id": "r", "ok_rows": 0, "error_rows": 0, "empty_completions": 0,
            "looping_completions": 0, "error_reasons": [], "errors": "out/errors/", **values}


def fresh_engine(model_dir, batch_sizes: list[int]) -> dict:
    """An engine config no other test loads (the process caches one engine per config)."""
    engine = tiny_engine(model_dir)
    return {**engine, "bucket_grid": {**engine["bucket_grid"], "batch_sizes": batch_sizes}}


def test_guards_name_what_failed_and_pass_within_the_limits():
    assert quality_problems(summary_with(ok_rows=10, error_rows=10, empty_completions=5,
                                         looping_completions=5), 0.5, 0.5, 0.5) == []
    (problem,) = quality_problems(
        summary_with(ok_rows=1, error_rows=3,
                     error_reasons=[{"reason": "missing_field", "rows": 3}]), 0.5, 0.5, 0.5)
    assert "3 of 4 rows failed (75% > max_error_fraction 50%" in problem
    assert "missing_field 3" in problem
    (problem,) = quality_problems(summary_with(ok_rows=4, empty_completions=4), 0.5, 0.5, 0.5)
    assert "4 of 4 completions are empty" in problem and "input.chat_template" in problem
    assert quality_problems(summary_with(ok_rows=4, empty_completions=1), 0.5, 0.0, 0.5)
    (problem,) = quality_problems(summary_with(ok_rows=4, looping_completions=3), 0.5, 0.5, 0.5)
    assert "3 of 4 completions end in a loop" in problem and "max_looping_fraction" in problem
    assert quality_problems(summary_with(ok_rows=4, looping_completions=1), 0.5, 0.5, 0.0)


PARIS = "The capital of France is Paris. "


@pytest.mark.parametrize(("text", "loops"), [
    (" Kitemap Kitemap Kitemap Kitemap Kitemap", True),  # SmolLM2 on the README's run
    (PARIS * 5 + "The capital of", True),  # cut off mid-phrase by max_new_tokens
    ("Sure! Here is a long answer. " * 1 + PARIS * 4, True),  # the loop is most of it
    (" 1, 1, 1, 1, 1, 1, 1, 1, 1,\n\n", True),
    ("A long and useful answer about the sea, its tides and its salt. " * 3 + PARIS * 4, False),
    ("The sea is vast and deep!!!!", False),  # a repeated character, not half of it
    ("1. bread\n2. milk\n3. eggs\n4. butter\n", False),  # rows differ
    ("| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |", False),
    ("#include <iostream>\n#include <string>\n#include <vector>\n#include <map>\n", False),
    ("yes", False),
    ("", False),
])
def test_a_completion_ends_in_a_loop_when_a_phrase_repeats_to_its_end(text, loops):
    assert ends_in_loop(text) == loops


def test_summary_figures_are_named_and_blank_when_undefined():
    from reporting.summary import (
        COUNT_FIELDS,
        FIGURE_FIELDS,
        FILTER_FIELDS,
        cost_report_markdown,
        summary_figures,
    )

    summary = {**summary_with(error_rows=6, error_reasons=[{"reason": "missing_field", "rows": 6}]),
               **dict.fromkeys(COUNT_FIELDS, 0), "error_rows": 6, **dict.fromkeys(FIGURE_FIELDS),
               **dict.fromkeys(FILTER_FIELDS),  # a run without filters
               "shards_committed": 1, "shards_planned": 1, "stopped_on_budget": False,
               "cost": 0.0001, "engine_load_cost": 0.0002, "total_cost": 0.0003,
               "data": "d/", "metrics": "m/"}
    figures = dict(summary_figures(summary))
    assert figures["rows ok / error"] == "0 / 6 of 6"
    assert figures["error reasons"] == "missing_field 6"
    assert figures["acceptance rate"] == figures["total cost per 1M tokens"] == "n/a"
    assert figures["total cost"] == "$0.000300"
    assert "kept / filtered" not in figures
    markdown = cost_report_markdown(summary, 0.4, "cpu")
    assert "| engine load cost | $0.000200 (n/a s) |" in markdown


def test_every_row_failing_exits_non_zero_and_report_on_zero_tokens_exits_0(
    tmp_path, tiny_llama_dir
):
    rows = [{"id": f"r{i}", "text": "no prompt field"} for i in range(5)]
    write_jsonl(tmp_path / "in.jsonl", [*rows, LONG_PROMPT_ROW])
    config = run_config(str(tmp_path / "in.jsonl"), str(tmp_path / "out"),
                        tiny_engine(tiny_llama_dir))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = runner.invoke(app, ["run", str(path)])
    assert result.exit_code == 1, result.output
    assert "failed its quality guards: 6 of 6 rows failed" in result.output
    assert "missing_field 5, prompt_too_long 1" in result.output
    (metrics,) = read(tmp_path / "out", "metrics")
    assert metrics["generated_tokens"] == 0 and metrics["ok_rows"] == 0
    assert metrics["error_reasons"] == [{"reason": "missing_field", "rows": 5},
                                        {"reason": "prompt_too_long", "rows": 1}]
    assert metrics["tokens_per_second"] == 0.0  # no tokens in a measured time: a rate of 0
    assert metrics["cost_per_1m_tokens"] is None  # no tokens: undefined
    assert metrics["acceptance_rate"] is None and metrics["mean_accepted_length"] is None

    table = runner.invoke(app, ["report", str(tmp_path / "out")])
    assert table.exit_code == 0, table.output
    assert "0 tokens" in table.output and "Error rows by reason" in table.output
    report = json.loads(runner.invoke(app, ["report", str(tmp_path / "out"), "--format", "json"])
                        .stdout)
    assert report["total"]["generated_tokens"] == 0
    assert report["total"]["cost_per_1m_tokens"] is None
    assert [(run["status"], run["shards_planned"]) for run in report["runs"]] == [
        ("failed_quality_guard", 1)
    ]
    totals = {r["reason"]: r["rows"] for r in report["error_reasons"] if r["level"] == "total"}
    assert totals == {"missing_field": 5, "prompt_too_long": 1}


def test_engine_load_billed_once_apart_and_no_second_billed_twice(tmp_path, tiny_llama_dir):
    """4 shards, 2 in flight, one engine: the loading shard carries the load; the shards'
    device-seconds fit in the run's wall time x devices (waiting for the engine bills nothing)."""
    write_jsonl(tmp_path / "in.jsonl", good_rows(16))
    engine = fresh_engine(tiny_llama_dir, [1, 2])
    config = run_config(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), engine,
                        sharding={"rows_per_shard": 4}, accelerator_slots=2, devices_per_slot=2)
    config["generation"]["warmup"] = True
    started = time.perf_counter()
    summary = generate_corpus(config)
    run_wall = time.perf_counter() - started
    metrics = read(tmp_path / "out", "metrics")
    assert len(metrics) == 4
    loads = sorted(m["engine_load_seconds"] for m in metrics)
    assert loads[:3] == [0.0, 0.0, 0.0] and loads[3] > 0
    assert sum(m["device_seconds"] for m in metrics) <= run_wall * 2
    load_shard = max(metrics, key=lambda m: m["engine_load_seconds"])
    assert load_shard["engine_load_cost"] == pytest.approx(
        load_shard["engine_load_seconds"] * 2 / 3600 * load_shard["price_per_device_hour"])
    assert summary["total_cost"] == pytest.approx(summary["cost"] + summary["engine_load_cost"])
    assert summary["engine_load_seconds"] == pytest.approx(loads[3])
    for m in metrics:
        assert m["device_seconds"] == pytest.approx(m["wall_seconds"] * 2)
    # load + warm-up of every shape outlasts generating 4 rows x 8 tokens: excluded, not included
    assert load_shard["wall_seconds"] < load_shard["engine_load_seconds"]
    report = json.loads(runner.invoke(app, ["report", str(tmp_path / "out"), "--format", "json"])
                        .stdout)
    assert report["total"]["total_cost"] == pytest.approx(summary["total_cost"])


def test_shards_waiting_for_the_engine_bill_nothing(tmp_path, tiny_llama_dir):
    """What local dispatch with accelerator_slots=2 does (two shard tasks in threads, one
    engine), without Prefect's overhead hiding the difference: counting the wait for the
    engine's lock billed every second about twice."""
    from concurrent.futures import ThreadPoolExecutor

    from flows.generate import plan_run
    from tasks.layout import run_layout
    from tasks.shard import process_shard

    write_jsonl(tmp_path / "in.jsonl", good_rows(24))
    engine = fresh_engine(tiny_llama_dir, [2, 4])  # its load is timed too
    config = parse_run_config(run_config(
        str(tmp_path / "in.jsonl"), str(tmp_path / "out"), engine,
        sharding={"rows_per_shard": 6}, generation={
            "engine": engine, "warmup": False, "sampling": {"max_new_tokens": 32}}))
    shards, layout = plan_run.fn(config).shards, run_layout(config)
    started = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(lambda shard: process_shard(config, layout, shard), shards))
    wall = time.perf_counter() - started
    assert [o.status for o in outcomes] == ["committed"] * 4
    metrics = read(tmp_path / "out", "metrics")
    billed = sum(m["device_seconds"] + m["engine_load_seconds"] for m in metrics)
    assert billed <= wall
    assert sum(m["generated_tokens"] for m in metrics) > 4 * 6 * 8  # the engine did real work


def test_samples_per_prompt_and_provenance(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("PREFECT__WORKER_NAME", "gaudi-pool-worker-7")
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "3")
    write_jsonl(tmp_path / "in.jsonl", good_rows(3))
    config = run_config(str(tmp_path / "in.jsonl"), str(tmp_path / "out"),
                        tiny_engine(tiny_llama_dir))
    config["generation"]["samples_per_prompt"] = 3
    config["generation"]["sampling"] = {"max_new_tokens": 8, "temperature": 1.0}
    generate_corpus(config)
    data = read(tmp_path / "out", "data")
    assert len(data) == 9
    assert len({(r["id"], r["sample_index"]) for r in data}) == 9
    for record_id in {r["id"] for r in data}:
        samples = sorted((r for r in data if r["id"] == record_id),
                         key=lambda r: r["sample_index"])
        assert [s["sample_index"] for s in samples] == [0, 1, 2]
        assert len({s["seed"] for s in samples}) == 3
        assert len({s["completion"] for s in samples}) > 1  # own seeds, own samples
    single = tmp_path / "single"
    write_jsonl(single / "in.jsonl", good_rows(3))
    one = run_config(str(single / "in.jsonl"), str(single / "out"), tiny_engine(tiny_llama_dir))
    one["generation"]["sampling"] = config["generation"]["sampling"]
    generate_corpus(one)
    first = {(r["id"], r["seed"], r["completion"]) for r in data if r["sample_index"] == 0}
    assert first == {(r["id"], r["seed"], r["completion"]) for r in read(single / "out", "data")}
    (metrics,) = read(tmp_path / "out", "metrics")
    assert metrics["worker_name"] == "gaudi-pool-worker-7"
    assert metrics["device_card"] == "HABANA_VISIBLE_MODULES=3"
    assert metrics["flow_run_id"]
    assert metrics["chat_template"] == "chat"
    assert json.loads(metrics["sampling_params"])["samples_per_prompt"] == 3
    assert json.loads(metrics["sampling_params"])["temperature"] == 1.0
    # What ran where: the engine's kernels (an fp32 target's row-exact linears) and the CPU.
    assert metrics["cpu_kernels"] == f"target={row_exact_kernel()}"
    assert metrics["cpu_model"] == kernels.cpu_model()
    assert metrics["cpu_isa"] == kernels.cpu_isa()
    prompt = data[0]["prompt"]
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_plain_prompts_on_smollm2_get_answers_and_raw_text_trips_the_empty_guard(
    tmp_path, smollm2_spec
):
    """The issue's corpus shape (plain questions, `prompt_field`) on the packaged chat model at
    temperature 0: <= 5 % empty through the chat template; sent raw, the guard fails the run."""
    questions = [
        "What is the capital of France?", "Name three primary colors.",
        "Why do leaves change color in autumn?", "What does a thermometer measure?",
        "Give one tip for sleeping well.", "What is 12 times 12?",
        "Which planet is closest to the sun?", "What is photosynthesis?",
        "Name a famous composer.", "How many days are in a leap year?",
        "What language is spoken in Brazil?", "What is the boiling point of water?",
        "Suggest a name for a pet cat.", "What do bees make?",
        "Why is the sea salty?", "What is a haiku?",
    ]
    rows = [{"id": f"q{i:02d}", "text": q} for i, q in enumerate(questions)]
    write_jsonl(tmp_path / "in.jsonl", rows)
    engine = {**tiny_engine("unused"), "target": smollm2_spec.model_dump()}
    engine["bucket_grid"] = {"batch_sizes": [8], "prompt_lengths": [64], "cache_lengths": [96],
                             "draft_lengths": [2]}
    config = run_config(str(tmp_path / "in.jsonl"), str(tmp_path / "chat"), engine,
                        sharding={"rows_per_shard": 16})
    del config["max_looping_fraction"]  # a real model's answers pass the default guard too
    config["input"] = {"uri": str(tmp_path / "in.jsonl"), "prompt_field": "text",
                       "id_field": "id"}
    config["generation"].update(warmup=False, sampling={"max_new_tokens": 12})
    summary = generate_corpus(config)
    data = read(tmp_path / "chat", "data")
    empty = [r["id"] for r in data if not r["completion"].strip()]
    assert len(data) == 16 and len(empty) <= 0.05 * len(data), empty
    assert summary["empty_completions"] == len(empty)
    raw = {**config, "output": str(tmp_path / "raw"),
           "input": {**config["input"], "chat_template": "off"}}
    with pytest.raises(QualityError, match=r"completions are empty"):
        generate_corpus(raw)
    (metrics,) = read(tmp_path / "raw", "metrics")
    assert metrics["chat_template"] == "raw" and metrics["empty_completions"] > 8


@pytest.mark.slow
def test_completions_stuck_in_a_loop_fail_the_run_and_the_report_says_so(tmp_path, smollm2_spec):
    """SmolLM2 at temperature 0 sent raw text that repeats (the README run's list copy got
    "Kitemap" to the end) continues the repetition to max_new_tokens: 6 of 8 completions loop here,
    so the run exits 1 naming the guard; its shard stays committed and the report marks the
    run as failing its guard. The same model answering questions through its chat template
    passes (the test above)."""
    repeats = ["Kitemap Kitemap Kitemap", "1, 1, 1, 1, 1, 1, 1, 1,", "0 0 0 0 0 0 0 0",
               "x, x, x, x, x, x,", "red, red, red, red, red,", "1 1 1 1 1 1 1 1"]
    prompts = [*repeats, "The sky is blue because", "Once upon a time"]
    write_jsonl(tmp_path / "in.jsonl",
                [{"id": f"p{i}", "prompt": p} for i, p in enumerate(prompts)])
    engine = {**tiny_engine("unused"), "target": smollm2_spec.model_dump()}
    engine["bucket_grid"] = {"batch_sizes": [8], "prompt_lengths": [32], "cache_lengths": [96],
                             "draft_lengths": [2]}
    config = run_config(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), engine)
    del config["max_looping_fraction"]  # the default guard, 0.5
    config["input"]["chat_template"] = "off"
    config["generation"].update(warmup=False, sampling={"max_new_tokens": 40})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = runner.invoke(app, ["run", str(path)])
    assert result.exit_code == 1, result.output
    data = {r["id"]: r["completion"] for r in read(tmp_path / "out", "data")}
    looping = sorted(i for i, text in data.items() if ends_in_loop(text))
    # 6 here (AVX2 EPYC); at least 5 whatever the CPU's rounding, and only repeating prompts
    assert len(looping) >= 5 and set(looping) <= {f"p{i}" for i in range(len(repeats))}, data
    assert f"{len(looping)} of 8 completions end in a loop" in result.output
    (metrics,) = read(tmp_path / "out", "metrics")
    assert metrics["looping_completions"] == len(looping) and metrics["ok_rows"] == 8
    report = json.loads(runner.invoke(app, ["report", str(tmp_path / "out"), "--format", "json"])
                        .stdout)
    assert [run["status"] for run in report["runs"]] == ["failed_quality_guard"]


def test_report_reads_outputs_written_before_the_new_columns(tmp_path):
    """Metrics files from before empty_completions/engine_load_* existed: those read as null."""
    import pyarrow.parquet as pq

    from bench.metrics_history import metrics_row, write_shard

    path = write_shard(str(tmp_path), metrics_row("old-run", "s0"))
    old = pq.read_table(path)
    pq.write_table(old.select(old.column_names[: old.column_names.index("finished_at") + 1]), path)
    result = runner.invoke(app, ["report", str(tmp_path), "--format", "json"])
    assert result.exit_code == 0, result.output
    total = json.loads(result.stdout)["total"]
    assert total["generated_tokens"] == 1000 and total["empty_completions"] is None
    assert total["engine_load_cost"] == 0 and total["total_cost"] == pytest.approx(total["cost"])
