"""End to end with the real engine on a tiny random Llama and the real Prefect API: a run with a
dedup filter commits its shards to generated/, then data/ (kept) and filtered/ (dropped) once;
a second run with scope output drops what the first kept; plan and report show the filters."""

from __future__ import annotations

import csv
import io
import json
import re

import fsspec
import pyarrow.dataset as ds
import pytest
import yaml
from pipeline_fixtures import run_config, tiny_engine, write_jsonl
from typer.testing import CliRunner

from flows.cli import app
from flows.console import console, print_summary
from flows.generate import generate_corpus
from tasks.dedup import normalise
from tasks.filtering import read_log
from tasks.layout import RunLayout
from tasks.planning import InputError

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_server")]
PROMPTS = ["Name a river.", "Describe bread.", "Why do comets glow?", "Who plays chess?"]
DEDUP = [{"kind": "dedup", "method": "exact", "scope": "output"}]


def rows(prefix: str, prompts: list[str], copies: int) -> list[dict]:
    """Each prompt `copies` times under its own ids: greedy decoding answers them alike."""
    return [{"id": f"{prefix}-{i}-{copy}", "prompt": prompt}
            for i, prompt in enumerate(prompts) for copy in range(copies)]


def table(root, kind: str, run_id: str) -> list[dict]:
    found = ds.dataset(f"{root}/{kind}", partitioning="hive").to_table().to_pylist()
    return [row for row in found if row["run_id"] == run_id]


def keyed(records: list[dict]) -> set[tuple[str, int]]:
    return {(row["id"], row["sample_index"]) for row in records}


def expected_kept(generated: list[dict], earlier: dict[str, tuple]) -> set[tuple[str, int]]:
    """The smallest (id, sample_index) of each normalised completion not kept by an earlier
    run (`earlier`: normalised text -> its kept record)."""
    first: dict[str, tuple[str, int]] = {}
    for row in sorted(generated, key=lambda r: (r["id"], r["sample_index"])):
        first.setdefault(normalise(row["completion"]), (row["id"], row["sample_index"]))
    return {record for text, record in first.items() if text not in earlier}


def test_dedup_filters_a_run_once_and_the_next_run_against_it(tmp_path, tiny_llama_dir):
    out = tmp_path / "out"
    write_jsonl(tmp_path / "first.jsonl", rows("a", PROMPTS, 3))
    first = run_config(str(tmp_path / "first.jsonl"), str(out), tiny_engine(tiny_llama_dir),
                       sharding={"rows_per_shard": 3}, filters=DEDUP)
    first["generation"]["samples_per_prompt"] = 2  # greedy: sample 1 repeats sample 0
    summary = generate_corpus(first)
    run1 = summary["run_id"]

    generated = table(out, "generated", run1)
    kept, filtered = table(out, "data", run1), table(out, "filtered", run1)
    assert len(generated) == 24 and summary["ok_rows"] == 24
    assert keyed(kept) == expected_kept(generated, {}) and len(kept) <= len(PROMPTS)
    assert keyed(kept) | keyed(filtered) == keyed(generated)
    assert len(kept) + len(filtered) == len(generated)
    by_id = {(r["id"], r["sample_index"]): r for r in generated}
    for row in filtered:  # each names the kept record it repeats, from this run
        original = by_id[(row["duplicate_of_id"], row["duplicate_of_sample_index"])]
        assert row["duplicate_of_run_id"] == run1 and row["filter_reason"] == "duplicate"
        assert normalise(original["completion"]) == normalise(row["completion"])
        assert json.loads(row["filter_rule"]) == {"kind": "dedup", "method": "exact",
                                                  "threshold": 0.85, "scope": "output"}
    assert (summary["kept_rows"], summary["filtered_rows"], summary["duplicate_rows"]) == (
        len(kept), len(filtered), len(filtered))
    assert summary["filtered"].endswith(f"filtered/run_date={summary['run_date']}/run_id={run1}/")
    with console.capture() as printed:
        print_summary(summary)
    assert re.search(rf"kept / filtered +│ {len(kept)} / {len(filtered)} of 24 \(duplicates",
                     printed.get())
    assert "Kept records:" in printed.get() and "Filtered records:" in printed.get()

    again = generate_corpus(first)  # a rerun applies nothing twice
    layout = RunLayout.locate(fsspec.filesystem("file"), str(out), run1)
    assert [entry["run_id"] for entry in read_log(layout)] == [run1]
    assert again["kept_rows"] == summary["kept_rows"] and keyed(table(out, "data", run1)) == (
        keyed(kept))

    write_jsonl(tmp_path / "second.jsonl", rows("b", [PROMPTS[0], "Sing about bees."], 2))
    second = run_config(str(tmp_path / "second.jsonl"), str(out), tiny_engine(tiny_llama_dir),
                        sharding={"rows_per_shard": 2}, filters=DEDUP)
    run2 = generate_corpus(second)["run_id"]
    earlier = {normalise(r["completion"]): (r["id"], r["sample_index"]) for r in kept}
    generated2 = table(out, "generated", run2)
    assert keyed(table(out, "data", run2)) == expected_kept(generated2, earlier)
    from_run1 = [r for r in table(out, "filtered", run2) if r["duplicate_of_run_id"] == run1]
    assert {r["id"] for r in from_run1} >= {"b-0-0", "b-0-1"}  # PROMPTS[0] again

    runner = CliRunner()
    report = runner.invoke(app, ["report", str(out), "--format", "json"])
    assert report.exit_code == 0, report.output
    runs = {run["run_id"]: run for run in json.loads(report.stdout)["runs"]}
    assert runs[run1]["kept_rows"] == len(kept) and runs[run1]["filtered_rows"] == len(filtered)
    assert runs[run1]["duplicate_rate"] == pytest.approx(len(filtered) / 24)
    assert runs[run1]["kept_rate"] + runs[run1]["filtered_rate"] == pytest.approx(1)
    table_report = runner.invoke(app, ["report", str(out)])
    assert "Filters (of generated records)" in table_report.stdout
    csv_report = runner.invoke(app, ["report", str(out), "--format", "csv"])
    csv_runs = {row["run_id"]: row for row in csv.DictReader(io.StringIO(csv_report.stdout))
                if row["level"] == "run"}
    assert int(csv_runs[run1]["kept_rows"]) == len(kept)
    assert float(csv_runs[run1]["duplicate_rate"]) == pytest.approx(len(filtered) / 24)
    html = tmp_path / "dashboard.html"
    assert runner.invoke(app, ["report", str(out), "--html", str(html)]).exit_code == 0
    panel = html.read_text().split("<h2>Filters</h2>")[1].split("</section>")[0]
    assert run1 in panel and run2 in panel and f">{len(filtered)}<" in panel

    config_path = tmp_path / "first.yaml"
    config_path.write_text(yaml.safe_dump(first))
    plan = runner.invoke(app, ["plan", str(config_path)])
    assert plan.exit_code == 0, plan.output
    assert "filters[0] dedup exact scope=output: drops identical normalised completions" in (
        plan.output)
    assert "1 earlier run(s) kept" in plan.output and "filters already applied" in plan.output


def test_a_run_keeps_the_filters_it_was_planned_with(tmp_path, tiny_llama_dir):
    write_jsonl(tmp_path / "in.jsonl", rows("a", PROMPTS[:2], 1))
    config = run_config(str(tmp_path / "in.jsonl"), str(tmp_path / "out"),
                        tiny_engine(tiny_llama_dir), run_id="fixed", filters=DEDUP)
    assert generate_corpus(config)["kept_rows"] >= 1
    changed = {**config, "filters": [{"kind": "dedup", "method": "minhash"}]}
    with pytest.raises(InputError, match="run fixed was planned with filters"):
        generate_corpus(changed)
