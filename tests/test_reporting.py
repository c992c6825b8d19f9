"""Pricing table and cost/acceptance reporting over the committed metrics dataset."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import statistics
from collections import Counter

import duckdb
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from engine_helpers import SMALL_GRID, engine_for, varied_prompts
from pipeline_fixtures import (
    good_rows,
    run_config,
    tiny_engine,
    write_jsonl,
)
from typer.testing import CliRunner

from bench.metrics_history import (
    daily_history,
    metrics_row,
    three_runs,
    write_shard,
)
from bench.workloads import COPY_PROMPTS
from flows.cli import app
from flows.generate import generate_corpus
from generation import Engine
from generation.metrics import EngineStats
from generation.schedule import plain_decode_steps
from reporting.dashboard import render_dashboard
from reporting.metrics import (
    NoMetricsError,
    build_report,
    open_committed_metrics,
    summarize_metrics,
    views_sql,
)
from schemas import BucketGrid, DraftSpec, EngineConfig, SamplingParams
from schemas.arrow import METRICS_SCHEMA
from schemas.pricing import (
    DEFAULT_PRICES_PATH,
    OVERRIDE_SOURCE,
    UnknownDeviceError,
    load_prices,
    parse_price_overrides,
    price_for,
)
from schemas.run import StorageSpec
from tasks.storage import filesystem


def test_packaged_prices_cover_required_devices_with_date_and_source():
    prices = load_prices()
    assert {"cpu", "cuda-h100", "gaudi2", "gaudi3"} <= set(prices)
    for device_type, price in prices.items():
        assert price.usd_per_hour > 0, device_type
        assert isinstance(price.as_of, dt.date)
        assert price.source.strip()
    assert "placeholder" in prices["gaudi2"].source


def test_price_overrides_replace_the_entry_and_say_so():
    prices = load_prices(overrides={"gaudi2": 1.25})
    assert prices["gaudi2"].usd_per_hour == 1.25
    assert prices["gaudi2"].source == OVERRIDE_SOURCE == "report override (--price)"
    assert prices["cpu"] == load_prices()["cpu"]


def test_unknown_device_errors_list_the_known_ones():
    with pytest.raises(UnknownDeviceError, match=r"'tpu'.*known device types: cpu, cuda-a100"):
        load_prices(overrides={"tpu": 1.0})
    with pytest.raises(UnknownDeviceError, match="gaudi3"):
        price_for(load_prices(), "gaudi4")


def test_bad_price_file_names_the_device(tmp_path):
    path = tmp_path / "prices.yaml"
    path.write_text("gaudi2:\n  usd_per_hour: -1\n  as_of: 2026-01-01\n  source: contract\n")
    with pytest.raises(ValueError, match="'gaudi2'"):
        load_prices(path)
    assert DEFAULT_PRICES_PATH.exists()


@pytest.mark.parametrize("item", ["gaudi2", "gaudi2=abc", "=1.0", "cpu=-2"])
def test_price_flag_parsing_rejects_malformed_items(item):
    with pytest.raises(ValueError, match="DEVICE=USD_PER_HOUR"):
        parse_price_overrides([item])


def test_price_flag_parsing():
    assert parse_price_overrides(["gaudi2=1.5", " cpu =0"]) == {"gaudi2": 1.5, "cpu": 0.0}


# --- report figures over committed metrics ------------------------------------------------------


@pytest.fixture
def local_runs(tmp_path) -> str:
    """Three committed runs, plus a metrics file whose shard never committed."""
    root = str(tmp_path / "out")
    for row in three_runs():
        write_shard(root, row)
    write_shard(root, metrics_row("run-b", "run-b-s9", generated_tokens=10**9), committed=False)
    return root


def _by(rows, key):
    return {row[key]: row for row in rows}


def assert_hand_computed_figures(report: dict) -> None:
    """The fixture's rows, summed by hand (see three_runs for the inputs)."""
    runs = _by(report["runs"], "run_id")
    assert list(runs) == ["run-a", "run-b", "run-c"]

    run_a = runs["run-a"]  # cpu at $0.40/h, 20 s + 25 s, no draft
    assert run_a["generated_tokens"] == 800 + 1200
    assert run_a["cost"] == pytest.approx((20 + 25) / 3600 * 0.40)
    assert run_a["cost_per_1m_tokens"] == pytest.approx((20 + 25) / 3600 * 0.40 / 2000 * 1e6)
    assert run_a["tokens_per_second"] == pytest.approx(2000 / 45)
    assert run_a["acceptance_rate"] is None and run_a["mean_accepted_length"] is None
    assert run_a["padding_waste"] == pytest.approx((0.25 * 1000 + 0.1 * 1400) / 2400)

    run_b = runs["run-b"]  # gaudi2 at $1.30/h on 2 devices, 6 s + 8 s, 3 error rows
    assert run_b["generated_tokens"] == 900 + 1000
    assert run_b["device_seconds"] == pytest.approx(2 * 6 + 2 * 8)
    assert run_b["cost"] == pytest.approx((2 * 6 + 2 * 8) / 3600 * 1.30)
    assert run_b["cost_per_1m_tokens"] == pytest.approx(28 / 3600 * 1.30 / 1900 * 1e6)
    assert run_b["acceptance_rate"] == pytest.approx((600 + 500) / (1200 + 800))
    assert run_b["mean_accepted_length"] == pytest.approx(1 + (600 + 500) / (300 + 200))
    assert (run_b["input_rows"], run_b["ok_rows"], run_b["error_rows"]) == (22, 19, 3)

    run_c = runs["run-c"]  # cuda-h100 at $2.99/h, 4 s
    assert run_c["cost"] == pytest.approx(4 / 3600 * 2.99)
    assert run_c["tokens_per_second"] == pytest.approx(5000 / 4)

    total = report["total"]
    assert total["shards"] == 5 and total["generated_tokens"] == 8900 and total["error_rows"] == 3
    total_cost = 45 / 3600 * 0.40 + 28 / 3600 * 1.30 + 4 / 3600 * 2.99
    assert total["cost"] == pytest.approx(total_cost)
    assert total["cost_per_1m_tokens"] == pytest.approx(total_cost / 8900 * 1e6)
    assert total["acceptance_rate"] == pytest.approx((600 + 500 + 600) / (1200 + 800 + 1200))

    per_position = {
        (row["run_id"], row["position"]): row["acceptance_rate"]
        for row in report["position_acceptance"]
    }
    assert per_position[("run-b", 0)] == pytest.approx((250 + 300) / (400 + 400))
    assert per_position[("run-b", 2)] == pytest.approx(150 / 400)
    assert per_position[(None, 0)] == pytest.approx((250 + 300 + 250) / 1200)
    assert ("run-a", 0) not in per_position  # no draft, no positions

    pairs = {(p["target_model"], p["draft_kind"], p["device_type"]) for p in report["model_pairs"]}
    assert pairs == {
        ("tiny-llama", "none", "cpu"),
        ("tiny-llama", "model", "gaudi2"),
        ("tiny-llama", "prompt_lookup", "cuda-h100"),
    }
    buckets = {(b["device_type"], b["batch_bucket"]): b for b in report["bucket_throughput"]}
    assert buckets[("cpu", 2)]["tokens_per_second"] == pytest.approx(800 / 20)
    assert report["costliest_shards"][0]["shard_id"] == "run-b-s1"  # 16 device-s x $1.30
    assert {s["shard_id"] for s in report["shards"]} == {r["shard_id"] for r in three_runs()}
    assert {p["device_type"]: p["usd_per_hour"] for p in report["prices"]} == {
        "cpu": [0.40],
        "cuda-h100": [2.99],
        "gaudi2": [1.30],
    }


def test_report_figures_equal_hand_computation_and_skip_uncommitted_files(local_runs):
    assert_hand_computed_figures(build_report(open_committed_metrics(local_runs)))


def test_report_prices_override_recomputes_cost_and_says_which_prices(local_runs):
    report = build_report(open_committed_metrics(local_runs, price_overrides={"gaudi2": 2.0}))
    runs = _by(report["runs"], "run_id")
    assert runs["run-b"]["cost"] == pytest.approx(28 / 3600 * 2.0)
    assert runs["run-a"]["cost"] == pytest.approx(45 / 3600 * 0.40)  # recorded price kept
    prices = _by(report["prices"], "device_type")
    assert prices["gaudi2"] == {
        "device_type": "gaudi2",
        "usd_per_hour": [2.0],
        "source": "report override (--price)",
    }
    assert prices["cpu"]["source"] == "recorded in the metrics at run time"


def test_report_filters_by_run_and_date(local_runs):
    report = build_report(open_committed_metrics(local_runs, run_ids=["run-a", "run-c"]))
    assert [r["run_id"] for r in report["runs"]] == ["run-a", "run-c"]
    report = build_report(open_committed_metrics(local_runs, since=dt.date(2026, 12, 1)))
    assert [r["run_id"] for r in report["runs"]] == ["run-b", "run-c"]
    with pytest.raises(NoMetricsError, match="runs available: run-a, run-b, run-c"):
        open_committed_metrics(local_runs, run_ids=["run-z"])


def test_report_without_committed_shards_says_what_it_looked_for(tmp_path):
    write_shard(str(tmp_path), metrics_row("run-a", "s0"), committed=False)
    with pytest.raises(NoMetricsError, match=r"manifests/.*committed"):
        open_committed_metrics(str(tmp_path))


def test_report_rejects_prices_for_unknown_devices(local_runs):
    with pytest.raises(UnknownDeviceError, match="known device types"):
        open_committed_metrics(local_runs, price_overrides={"gaudi9": 1.0})


def test_summary_artifact_numbers_equal_the_report(local_runs):
    rows = [row for row in three_runs() if row["run_id"] == "run-b"]
    summary = summarize_metrics(pa.Table.from_pylist(rows, schema=METRICS_SCHEMA))
    report = build_report(open_committed_metrics(local_runs, run_ids=["run-b"]))
    assert summary == report


def test_views_sql_is_usable_as_is_by_a_bi_tool(local_runs):
    """The printed views, run in a fresh DuckDB, give the report's numbers."""
    con = duckdb.connect()
    con.execute(views_sql(local_runs))
    cost, tokens = con.execute(
        "SELECT cost, generated_tokens FROM cost_rollup WHERE level = 'total'"
    ).fetchone()
    assert tokens == 8900
    assert cost == pytest.approx(build_report(open_committed_metrics(local_runs))["total"]["cost"])


def test_report_over_moto_s3_matches_hand_computation(s3_bucket):
    root = "s3://corpus-test/out"
    for row in three_runs():
        write_shard(root, row, s3_bucket)
    write_shard(root, metrics_row("run-b", "run-b-s9", generated_tokens=10**9), s3_bucket, False)
    fs, _ = filesystem(root, StorageSpec(endpoint_url=s3_bucket["endpoint_url"]))
    assert_hand_computed_figures(build_report(open_committed_metrics(root, fs)))


# --- the `corpusgen report` command ---------------------------------------------------------------


def invoke(*args: str):
    return CliRunner().invoke(app, ["report", *args], catch_exceptions=False)


def test_cli_json_with_price_override_and_html(local_runs, tmp_path):
    html = tmp_path / "dash.html"
    result = invoke(local_runs, "--format", "json", "--price", "gaudi2=2.0", "--html", str(html))
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    runs = _by(report["runs"], "run_id")
    assert runs["run-b"]["cost"] == pytest.approx(28 / 3600 * 2.0)
    assert runs["run-b"]["run_date"] == "2026-12-01"
    assert _by(report["prices"], "device_type")["gaudi2"]["source"] == "report override (--price)"
    assert "report override (--price)" in html.read_text()


def test_cli_csv_is_the_flat_rollup(local_runs):
    result = invoke(local_runs, "--format", "csv", "--since", "2026-12-01")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [(r["level"], r["run_id"]) for r in rows if r["level"] == "run"] == [
        ("run", "run-b"),
        ("run", "run-c"),
    ]
    total = next(r for r in rows if r["level"] == "total")
    assert float(total["cost"]) == pytest.approx(28 / 3600 * 1.30 + 4 / 3600 * 2.99)
    assert int(total["error_rows"]) == 3


def test_cli_table_names_runs_prices_and_errors(local_runs):
    result = invoke(local_runs, "--run", "run-b")
    assert result.exit_code == 0, result.output
    for expected in (
        "Runs",
        "run-b",
        "$5.32",
        "recorded in the metrics at run time",
        "3 error rows",
    ):
        assert expected in result.stdout
    assert "run-a" not in result.stdout


def test_cli_reports_over_s3_with_endpoint_flag(s3_bucket):
    root = "s3://corpus-test/out"
    for row in three_runs():
        write_shard(root, row, s3_bucket)
    result = invoke(root, "--endpoint-url", s3_bucket["endpoint_url"], "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["total"]["generated_tokens"] == 8900


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--price", "tpu=3"], "known device types: cpu"),
        (["--price", "gaudi2"], "DEVICE=USD_PER_HOUR"),
        (["--run", "nope"], "runs available: run-a, run-b, run-c"),
        (["--storage-option", "novalue"], "KEY=VALUE"),
    ],
)
def test_cli_bad_input_is_a_clear_error(local_runs, args, message):
    result = invoke(local_runs, *args)
    assert result.exit_code == 2
    assert message in result.stderr


def test_cli_views_prints_sql_for_this_output(local_runs):
    result = invoke(local_runs, "--views")
    assert result.exit_code == 0
    assert f"read_json('{local_runs}/manifests/*.json'" in result.stdout
    assert "CREATE OR REPLACE VIEW cost_rollup" in result.stdout


# --- over the real pipeline's outputs ------------------------------------------------------------


def check_run_against_outputs(out: str, run: dict, summary: dict) -> None:
    """A report's run row agrees with the flow's summary, the data rows and the metrics rows."""
    data = ds.dataset(f"{out}/data", partitioning="hive").to_table().to_pylist()
    data = [row for row in data if row["run_id"] == run["run_id"]]
    metrics = ds.dataset(f"{out}/metrics", partitioning="hive").to_table().to_pylist()
    metrics = [row for row in metrics if row["run_id"] == run["run_id"]]
    tokens = sum(row["completion_tokens"] for row in data)
    assert run["generated_tokens"] == summary["generated_tokens"] == tokens > 0
    assert run["ok_rows"] == len(data) and run["error_rows"] == summary["error_rows"]
    assert run["cost"] == pytest.approx(summary["cost"])
    cost = sum(m["device_seconds"] / 3600 * m["price_per_device_hour"] for m in metrics)
    assert run["cost"] == pytest.approx(cost)
    assert run["cost_per_1m_tokens"] == pytest.approx(cost / tokens * 1e6)
    assert run["accepted"] == sum(row["accepted"] for row in data)
    assert run["proposed"] == sum(row["proposed"] for row in data)


@pytest.mark.usefixtures("prefect_server")
def test_report_over_two_real_pipeline_runs(tmp_path, tiny_llama_dir):
    write_jsonl(tmp_path / "in" / "plain.jsonl", good_rows(10))
    write_jsonl(tmp_path / "in" / "bad.jsonl", good_rows(10, start=100), bad_every=3)
    out = str(tmp_path / "out")
    engine = tiny_engine(tiny_llama_dir)
    plain = generate_corpus(run_config(str(tmp_path / "in" / "plain.jsonl"), out, engine,
                                       run_id="plain"))  # fmt: skip
    drafted = generate_corpus(run_config(
        str(tmp_path / "in" / "bad.jsonl"), out,
        {**engine, "draft": {"kind": "prompt_lookup"}, "num_draft_tokens": 2},
        run_id="drafted", pricing={"device_type": "cpu", "usd_per_device_hour": 3.6},
    ))  # fmt: skip

    report = build_report(open_committed_metrics(out))
    runs = _by(report["runs"], "run_id")
    assert set(runs) == {"plain", "drafted"}
    check_run_against_outputs(out, runs["plain"], plain)
    check_run_against_outputs(out, runs["drafted"], drafted)
    assert runs["drafted"]["error_rows"] == 3 and runs["plain"]["error_rows"] == 0
    assert runs["drafted"]["cost"] == pytest.approx(runs["drafted"]["device_seconds"] / 3600 * 3.6)
    assert runs["drafted"]["acceptance_rate"] == pytest.approx(
        runs["drafted"]["accepted"] / runs["drafted"]["proposed"]
    )
    assert runs["plain"]["speedup_vs_plain"] == pytest.approx(1.0)
    assert runs["plain"]["cost_saved"] == pytest.approx(0.0)
    assert runs["drafted"]["estimated_shards"] == runs["drafted"]["shards"]  # warmed up
    assert runs["drafted"]["speedup_vs_plain"] > 0
    positions = [p for p in report["position_acceptance"] if p["run_id"] == "drafted"]
    assert [p["position"] for p in positions] == [0, 1]
    assert render_dashboard(report, out).count('class="plotly-graph-div"') == 8

    # A third run stopped by its cost cap after one shard: the JSON report says which run
    # an operator can trust.
    generate_corpus(run_config(str(tmp_path / "in" / "bad.jsonl"), out, engine, run_id="capped",
                               sharding={"rows_per_shard": 3}, cost_cap_usd=1e-9))
    result = CliRunner().invoke(app, ["report", out, "--format", "json"])
    statuses = {run["run_id"]: (run["status"], run["shards"], run["shards_planned"])
                for run in json.loads(result.stdout)["runs"]}
    assert statuses["plain"] == ("ok", runs["plain"]["shards"], runs["plain"]["shards"])
    assert statuses["drafted"][0] == "ok"  # 3 error rows of 13: within its guard
    assert statuses["capped"][0] == "incomplete" and statuses["capped"][1] < statuses["capped"][2]


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_report_over_a_smollm2_run_with_prompt_lookup(tmp_path, smollm2_spec):
    write_jsonl(tmp_path / "in.jsonl", good_rows(4), bad_every=2)
    out = str(tmp_path / "out")
    engine = {**tiny_engine(smollm2_spec.path), "draft": {"kind": "prompt_lookup"}}
    summary = generate_corpus(run_config(str(tmp_path / "in.jsonl"), out, engine, run_id="smol"))
    (run,) = build_report(open_committed_metrics(out))["runs"]
    check_run_against_outputs(out, run, summary)
    assert run["error_rows"] == 2 and run["model_pairs"] == f"{smollm2_spec.path} <- prompt_lookup"


# --- the speculation payoff: what plain decoding would have cost ----------------------------------


def test_saved_seconds_are_the_plain_estimate_minus_all_decoding_with_the_draft():
    stats = EngineStats(decode_seconds=0.25, draft_seconds=0.5, verify_seconds=1.0, rounds=3)
    stats.draft_prefill_seconds = 0.25
    stats.record_plain_estimate(2.5)
    stats.record_plain_estimate(0.5)  # a second generate() call
    assert stats.plain_decode_seconds == pytest.approx(3.0)
    assert stats.seconds_saved_by_speculation == pytest.approx(3.0 - 0.25 - 0.5 - 1.0 - 0.25)
    stats.record_plain_estimate(None)
    assert stats.seconds_saved_by_speculation is None  # one unpriced call: no estimate
    assert EngineStats(decode_seconds=2.0).seconds_saved_by_speculation == 0.0  # decoded plain


def test_plain_estimate_is_unknown_without_warm_up(tiny_llama_dir):
    """No warm-up: no [b, 1] times to price the plain steps with."""
    engine = engine_for(tiny_llama_dir, draft={"kind": "prompt_lookup"}, num_draft_tokens=2)
    engine.generate(varied_prompts(3), SamplingParams(max_new_tokens=6))
    assert engine.stats.rounds > 0 and engine.stats.seconds_saved_by_speculation is None
    engine.warmup()
    engine.generate(varied_prompts(3), SamplingParams(max_new_tokens=6))
    assert engine.stats.plain_decode_seconds > 0


def test_plain_steps_are_priced_at_warm_up_times_scaled_by_the_load_now(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir)
    engine.warmup()
    runner = engine.target
    mark = runner.load_mark()
    assert runner.load_since(mark) is None  # nothing ran since
    engine.generate(varied_prompts(3), SamplingParams(max_new_tokens=6))
    load = runner.load_since(mark)
    assert load > 0
    b, attend = SMALL_GRID.batch_sizes[-1], SMALL_GRID.cache_lengths[0]
    warm = runner.warm_seconds[("decode", b, 1, attend)]
    assert runner.warm_priced_seconds(Counter({(b, attend): 3}), load) == pytest.approx(
        3 * warm * load
    )
    assert runner.warm_priced_seconds(Counter({(b, attend): 3}), None) is None
    assert runner.warm_priced_seconds(Counter({(b + 1, attend): 3}), load) is None  # unwarmed


REPLAY_GRID = BucketGrid(  # SmolLM2's copy prompts are 88-91 tokens: contexts cross 128
    batch_sizes=[1, 2, 4], prompt_lengths=[96], cache_lengths=[128, 256], draft_lengths=[4]
)


@pytest.mark.slow
def test_a_drafted_run_counts_the_steps_plain_decoding_takes(smollm2_spec):
    """Rows accept unevenly under prompt lookup, so one finishes rounds before another: plain
    steps counted per round as tokens / live rows came to 44.75 where plain decoding of four of
    these prompts takes 34. Replaying the schedule on the rows' lengths gives plain's steps,
    shape by shape, refills and compactions included."""
    prompts, params = COPY_PROMPTS + COPY_PROMPTS[:2], SamplingParams(max_new_tokens=48)
    plain, lookup = (
        Engine.from_config(EngineConfig(
            target=smollm2_spec, draft=draft, device="cpu", bucket_grid=REPLAY_GRID,
            num_draft_tokens=4 if draft else "auto",
        ))
        for draft in (None, DraftSpec(kind="prompt_lookup"))
    )  # fmt: skip
    before = Counter(plain.target.shapes)
    plain_completions = plain.generate(prompts, params)
    plain_steps = Counter({
        (b, attend): n
        for (kind, b, _, attend), n in (plain.target.shapes - before).items() if kind == "decode"
    })  # fmt: skip
    drafted = lookup.generate(prompts, params)
    assert [c.token_ids for c in drafted] == [c.token_ids for c in plain_completions]
    assert lookup.stats.rounds > 0 and len({len(c.token_ids) for c in drafted}) > 1
    assert lookup.stats.plain_decode_steps == plain.stats.steps_per_k[0] == plain_steps.total()
    replayed = plain_decode_steps(
        [(c.prompt_tokens, len(c.token_ids)) for c in drafted],
        REPLAY_GRID.batch_sizes,
        REPLAY_GRID.cache_lengths,
    )
    assert replayed == plain_steps
    assert {b for b, _ in replayed} == {1, 2, 4} and {a for _, a in replayed} == {128, 256}


def test_report_savings_per_run_and_model_pair(local_runs):
    report = build_report(open_committed_metrics(local_runs, price_overrides={"gaudi2": 2.0}))
    runs = _by(report["runs"], "run_id")
    run_b = runs["run-b"]  # 2 devices, plain estimates 9 s and 12 s against 6 s and 8 s of wall
    assert run_b["estimated_shards"] == 2
    assert run_b["plain_cost_estimate"] == pytest.approx(2 * (9 + 12) / 3600 * 2.0)
    assert run_b["cost_saved"] == pytest.approx(2 * (9 + 12 - 6 - 8) / 3600 * 2.0)
    assert run_b["speedup_vs_plain"] == pytest.approx(21 / 14)
    run_a = runs["run-a"]  # plain decoding: its own time is the plain figure, nothing saved
    assert run_a["speedup_vs_plain"] == pytest.approx(1.0) and run_a["cost_saved"] == 0
    run_c = runs["run-c"]  # drafted without an estimate: unknown, not zero
    assert run_c["estimated_shards"] == 0
    assert run_c["cost_saved"] is None and run_c["speedup_vs_plain"] is None
    total = report["total"]  # only shards with an estimate count towards the savings
    assert total["estimated_shards"] == 4
    assert total["speedup_vs_plain"] == pytest.approx((20 + 25 + 2 * 21) / (20 + 25 + 2 * 14))
    shard = _by(report["shards"], "shard_id")["run-b-s1"]
    assert shard["speedup_vs_plain"] == pytest.approx(12 / 8)


def test_report_reads_metrics_written_before_the_payoff_columns(tmp_path):
    """Older shards lack columns added later: they read as nulls, not as an error."""
    root = str(tmp_path)
    old_schema = pa.schema([f for f in METRICS_SCHEMA if not f.name.startswith("plain_")])
    row = metrics_row("run-old", "s0")
    path = write_shard(root, row)
    pq.write_table(pa.Table.from_pylist([row], schema=old_schema), path)
    (run,) = build_report(open_committed_metrics(root))["runs"]
    assert run["generated_tokens"] == 1000 and run["speedup_vs_plain"] is None


def test_trends_flag_a_run_notably_worse_than_its_previous_runs(tmp_path):
    root = str(tmp_path)
    for row in daily_history(days=10, shards_per_run=2, slow_day=8):
        write_shard(root, row)
    report = build_report(open_committed_metrics(root))
    trends = report["trends"]
    assert len(trends) == 20 and {t["series"] for t in trends} == {
        "packaged:smollm2-135m-instruct <- prompt_lookup · cuda-h100",
        "qwen2.5-coder-1.5b <- qwen2.5-coder-0.5b · gaudi2",
    }
    smol = [t for t in trends if t["run_id"].startswith("smol")]
    assert [t["baseline_runs"] for t in smol] == [0, 1, 2, 3, 4, 5, 6, 7, 7, 7]
    slow = smol[8]
    median = statistics.median(t["cost_per_1m_tokens"] for t in smol[1:8])
    assert slow["baseline_cost_per_1m_tokens"] == pytest.approx(median)
    assert slow["cost_change"] == pytest.approx(slow["cost_per_1m_tokens"] / median - 1)
    assert slow["cost_change"] > 0.4
    assert (
        slow["regression"] == f"cost/1M tokens {100 * slow['cost_change']:+.0f}%; "
        f"tokens/s {100 * slow['throughput_change']:+.0f}%"
    )
    assert [r["run_id"] for r in report["regressions"]] == ["smol-lookup-008"]  # noise: +-5 %


def test_trends_need_three_previous_runs_before_flagging(tmp_path):
    root = str(tmp_path)
    for row in daily_history(days=3, shards_per_run=1, slow_day=2):
        write_shard(root, row)
    report = build_report(open_committed_metrics(root))
    slow = next(t for t in report["trends"] if t["run_id"] == "smol-lookup-002")
    assert slow["cost_change"] > 0.4 and slow["regression"] is None
    assert report["regressions"] == []


def test_cli_over_a_history_lists_regressions_savings_and_writes_the_dashboard(tmp_path):
    root = str(tmp_path / "out")
    for row in daily_history(days=6, shards_per_run=1, slow_day=5):
        write_shard(root, row)
    html = tmp_path / "dash.html"
    result = invoke(root, "--html", str(html))
    assert result.exit_code == 0, result.output
    assert "Regressions" in result.stdout and "smol-lookup-005" in result.stdout
    assert "speculation saved $" in result.stdout and "of 12 shards" in result.stdout
    page = html.read_text()
    assert page.count('class="plotly-graph-div"') == 8 and "smol-lookup-005" in page
