"""The filter step's dedup on committed Parquet records (local disk and moto S3): which records
are kept does not depend on shard order, duplicates are found exactly and near, an output's
index makes dedup incremental across runs, and a step killed anywhere and rerun applies once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from flows.cli import app
from schemas.arrow import DATA_SCHEMA, FILTERED_SCHEMA
from schemas.run import parse_run_config
from tasks import dedup, filtering
from tasks.commit import commit_shard, new_attempt_id
from tasks.filtering import apply_filters, read_log
from tasks.layout import RunLayout
from tasks.planning import Plan, Shard, write_plan

ROOT = Path(__file__).resolve().parent.parent
BASE = ("The river carries fine sand and small stones down from the hills every spring, and "
        "the town by the bridge counts the boats that pass under it")
NEAR = BASE + " today"  # one word more: Jaccard of 3-word shingles 25/26
FAR = BASE.replace("small", "tiny")  # one word changed mid-text: 22/28 = 0.79
OTHER = "Bread rises because yeast eats the sugar in the dough and breathes out carbon dioxide"


def config(output: str, method: str = "minhash", scope: str = "run", **extra) -> dict:
    rule = {"kind": "dedup", "method": method, "scope": scope, **extra}
    return {
        "input": {"uri": "unused.jsonl", "prompt_field": "prompt"},
        "generation": {"engine": {"target": {"path": "packaged:smollm2-135m-instruct"}}},
        "output": output,
        "filters": [rule],
    }


def record(record_id: str, completion: str, sample_index: int = 0) -> dict:
    return {"id": record_id, "prompt": f"prompt of {record_id}", "completion": completion,
            "finish_reason": "stop", "seed": 7, "sample_index": sample_index}


def commit_run(fs, root: str, run_id: str, shards: list[list[dict]]) -> tuple[RunLayout, Plan]:
    """Commit each list of records as one shard's generated/ file, as a run with filters does,
    and write the run's plan: what the filter step finds once every shard is committed."""
    layout = RunLayout.locate(fs, root, run_id)
    planned = []
    for number, rows in enumerate(shards):
        shard_id = f"{run_id}-s{number}"
        table = pa.Table.from_pylist([{**row, "shard_id": shard_id} for row in rows], DATA_SCHEMA)
        assert commit_shard(layout, shard_id, new_attempt_id(), {"generated": table}, {})
        planned.append(Shard(shard_id, "in.jsonl", "in.jsonl", "jsonl", number, number + 1, 0,
                             len(rows), "f"))
    plan = write_plan(layout, Plan(run_id, layout.run_date, "hash", planned))
    return layout, plan


def apply(fs, root: str, run_id: str, shards: list[list[dict]], **rule) -> dict:
    layout, plan = commit_run(fs, root, run_id, shards)
    run = parse_run_config({**config(root, **rule), "run_id": run_id})
    return apply_filters(run, layout, plan)


def dataset(fs, root: str, kind: str, run_id: str) -> list[dict]:
    table = ds.dataset(f"{root}/{kind}", filesystem=fs, partitioning="hive").to_table()
    rows = [row for row in table.to_pylist() if row["run_id"] == run_id]
    return sorted(rows, key=lambda row: (row["id"], row["sample_index"]))


def kept_and_dropped(fs, root: str, run_id: str) -> tuple[list, dict]:
    kept = [(r["id"], r["sample_index"]) for r in dataset(fs, root, "data", run_id)]
    dropped = {(r["id"], r["sample_index"]): (r["duplicate_of_run_id"], r["duplicate_of_id"],
                                              r["duplicate_of_sample_index"], r["filter_reason"])
               for r in dataset(fs, root, "filtered", run_id)}
    return kept, dropped


def assert_split_once(fs, root: str, layout: RunLayout, plan: Plan) -> None:
    """data/ and filtered/ hold every generated record exactly once between them, file by file,
    and no staged filter attempt is left behind."""
    for shard in plan.shards:
        read = {kind: pq.read_table(layout.published(kind, shard.shard_id), filesystem=fs)
                for kind in ("generated", "data", "filtered")}
        generated = sorted(read["generated"].to_pylist(), key=str)
        split = read["data"].to_pylist() + read["filtered"].select(DATA_SCHEMA.names).to_pylist()
        assert sorted(split, key=str) == generated
    assert not fs.glob(f"{layout.filter_attempt_dir('*')}")


def test_normalised_text_ignores_case_punctuation_spacing_and_width():
    assert dedup.normalise("  Hello,\tWORLD!  «Ｆｏｏ»  ") == "hello world foo"
    assert dedup.normalise("end.Start") == "end start"
    assert dedup.shingles("a b") == [b"a b"] and dedup.shingles("") == []


def test_each_cluster_keeps_its_smallest_id_and_the_rest_go_to_filtered(store):
    fs, root = store
    shards = [
        [record("c", BASE), record("a", OTHER, 1)],
        [record("b", "the RIVER carries fine sand, and small stones down from the hills every "
                     "spring and the town by the bridge counts the boats that pass under it."),
         record("a", OTHER, 0), record("d", NEAR)],
        [record("e", "Something unrelated: glaciers carve valleys over thousands of years")],
    ]
    entry = apply(fs, root, "run1", shards)
    kept, dropped = kept_and_dropped(fs, root, "run1")
    assert kept == [("a", 0), ("b", 0), ("e", 0)]
    assert dropped == {("a", 1): ("run1", "a", 0, "near_duplicate"),
                       ("c", 0): ("run1", "b", 0, "near_duplicate"),
                       ("d", 0): ("run1", "b", 0, "near_duplicate")}
    rules = {r["filter_rule"] for r in dataset(fs, root, "filtered", "run1")}
    assert [json.loads(rule) for rule in rules] == [
        {"kind": "dedup", "method": "minhash", "threshold": 0.85, "scope": "run"}]
    assert (entry["input_rows"], entry["kept_rows"], entry["filtered_rows"],
            entry["duplicate_rows"]) == (6, 3, 3, 3)
    layout = RunLayout.locate(fs, root, "run1")
    assert_split_once(fs, root, layout, Plan.from_json(fs.cat_file(layout.plan_path).decode()))
    assert pq.read_schema(layout.published("filtered", "run1-s1"), filesystem=fs).equals(
        FILTERED_SCHEMA)


def test_exact_drops_only_identical_normalised_text(tmp_path):
    fs, root = fsspec.filesystem("file"), str(tmp_path / "out")
    apply(fs, root, "run1", [[record("a", BASE), record("b", BASE.upper() + "!"),
                              record("c", NEAR)]], method="exact")
    kept, dropped = kept_and_dropped(fs, root, "run1")
    assert kept == [("a", 0), ("c", 0)] and dropped == {("b", 0): ("run1", "a", 0, "duplicate")}


def test_the_threshold_is_the_jaccard_of_3_word_shingles(tmp_path):
    fs, root = fsspec.filesystem("file"), str(tmp_path / "out")
    apply(fs, root, "strict", [[record("a", BASE), record("b", FAR)]])
    assert kept_and_dropped(fs, root, "strict")[0] == [("a", 0), ("b", 0)]
    apply(fs, root, "loose", [[record("a", BASE), record("b", FAR)]], threshold=0.6)
    assert kept_and_dropped(fs, root, "loose")[0] == [("a", 0)]


def varied_records(count: int, seed: int = 0) -> list[dict]:
    """Short records in which about a third repeat or nearly repeat an earlier one."""
    rng = np.random.default_rng(seed)
    words = [f"{a}{b}{c}" for a in "bcdfg" for b in "aeiou" for c in "lmnrst"]
    texts: list[str] = []
    for _ in range(count):
        if texts and rng.random() < 0.35:  # an earlier text, as is or with a word more
            source = texts[rng.integers(len(texts))]
            texts.append(source + " again" if rng.random() < 0.5 else source)
        else:
            texts.append(" ".join(rng.choice(words, rng.integers(12, 30))))
    return [record(f"id-{rng.integers(10**9):09d}-{i}", text, i % 2)
            for i, text in enumerate(texts)]


def test_the_same_records_are_kept_whatever_the_shard_order(tmp_path):
    fs, root = fsspec.filesystem("file"), str(tmp_path / "out")
    rows = varied_records(300)
    outcomes = []
    for run, split in (("plain", rows), ("shuffled", list(np.random.default_rng(1).permutation(
            np.array(rows, dtype=object)))), ("reversed", rows[::-1])):
        size = {"plain": 40, "shuffled": 17, "reversed": 300}[run]
        apply(fs, root, run, [list(split[i : i + size]) for i in range(0, len(split), size)])
        kept, dropped = kept_and_dropped(fs, root, run)
        outcomes.append((kept, {k: v[1:] for k, v in dropped.items()}))
    assert outcomes[0] == outcomes[1] == outcomes[2]
    assert 80 < len(outcomes[0][1]) < 130  # the planted repeats, as duplicates


def test_keys_are_the_same_in_worker_processes(monkeypatch):
    texts = [row["completion"] for row in varied_records(60)]
    monkeypatch.setattr(dedup, "CHUNK", 16)
    for method in ("exact", "minhash"):
        assert np.array_equal(dedup.keys_of(texts, method, 0.85, workers=2),
                              dedup.text_keys(texts, method, 0.85))


def test_scope_output_dedups_each_run_against_what_earlier_runs_kept(store):
    fs, root = store
    apply(fs, root, "run1", [[record("b", BASE), record("a", OTHER)]], scope="output")
    second = apply(fs, root, "run2", [[record("a", NEAR), record("z", OTHER.lower())],
                                      [record("n", "a new text about lighthouses and gulls"),
                                       record("m", "A new text about lighthouses, and gulls")]],
                   scope="output")
    kept, dropped = kept_and_dropped(fs, root, "run2")
    assert kept == [("m", 0)]
    assert dropped == {("a", 0): ("run1", "b", 0, "near_duplicate"),
                       ("z", 0): ("run1", "a", 0, "near_duplicate"),
                       ("n", 0): ("run2", "m", 0, "near_duplicate")}
    assert second["number"] == 1 and second["index_rule_key"] == "minhash-0.85-v1"
    third = apply(fs, root, "run3", [[record("q", BASE)]])  # scope run: the index is not read
    assert third["kept_rows"] == 1 and third["index_rule_key"] is None
    apply(fs, root, "run4", [[record("q", BASE)], [record("r", "more about lighthouses")]],
          scope="output", method="exact")  # another rule key: another index
    assert kept_and_dropped(fs, root, "run4")[0] == [("q", 0), ("r", 0)]
    segments = sorted(path.rsplit("/", 2)[-2] + "/" + path.rsplit("/", 1)[-1]
                      for path in fs.glob(f"{root}/dedup_index/*/*.parquet"))
    assert segments == ["exact-v1/run4.parquet", "minhash-0.85-v1/run1.parquet",
                        "minhash-0.85-v1/run2.parquet"]
    assert [entry["run_id"] for entry in read_log(RunLayout.locate(fs, root, "x"))] == [
        "run1", "run2", "run3", "run4"]


def test_a_run_that_loses_the_log_race_decides_again_against_the_winner(tmp_path):
    """Two runs filtering at once: the one whose entry number was taken meanwhile rereads the
    log and drops its duplicates of the winner's records before committing after it."""
    fs, root = fsspec.filesystem("file"), str(tmp_path / "out")
    apply(fs, root, "winner", [[record("a", BASE)]], scope="output")
    layout, plan = commit_run(fs, root, "loser", [[record("b", NEAR), record("c", OTHER)]])
    run = parse_run_config({**config(root, scope="output"), "run_id": "loser"})
    entry = filtering._commit(run, layout, plan, [])  # it read the log before the winner wrote
    filtering.publish_filters(layout, entry)
    assert entry["number"] == 1 and entry["kept_rows"] == 1
    assert kept_and_dropped(fs, root, "loser")[1] == {("b", 0): ("winner", "a", 0,
                                                                 "near_duplicate")}


KILL = """
import os, signal, sys
sys.path.insert(0, {root!r})
import fsspec
from schemas.run import parse_run_config
from tasks import filtering
from tasks.layout import RunLayout
from tasks.planning import Plan

point, fs = sys.argv[1], fsspec.filesystem("file")
layout = RunLayout.locate(fs, {output!r}, "run2")
plan = Plan.from_json(fs.cat_file(layout.plan_path).decode())
create, move, moves = filtering.create_exclusive, filtering.move_staged, []

def create_then_maybe_die(fs, path, data):
    if point == "before_commit":
        os.kill(os.getpid(), signal.SIGKILL)
    created = create(fs, path, data)
    if point == "after_commit":
        os.kill(os.getpid(), signal.SIGKILL)
    return created

def move_then_maybe_die(fs, staged, final):
    moves.append(move(fs, staged, final))
    if point == "mid_publish" and len(moves) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return moves[-1]

filtering.create_exclusive, filtering.move_staged = create_then_maybe_die, move_then_maybe_die
filtering.apply_filters(parse_run_config({config!r}), layout, plan)
"""


@pytest.mark.parametrize("point", ["before_commit", "after_commit", "mid_publish"])
def test_a_step_killed_anywhere_and_rerun_applies_once_and_loses_nothing(tmp_path, point):
    fs, root = fsspec.filesystem("file"), str(tmp_path / "out")
    apply(fs, root, "run1", [[record("a", BASE)]], scope="output")
    rows = varied_records(40)
    layout, plan = commit_run(fs, root, "run2", [rows[:15], rows[15:30], rows[30:]])
    run = {**config(root, scope="output"), "run_id": "run2"}
    script = KILL.format(root=str(ROOT), output=root, config=run)
    killed = subprocess.run([sys.executable, "-c", textwrap.dedent(script), point],
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert len(read_log(layout)) == (1 if point == "before_commit" else 2)

    entry = apply_filters(parse_run_config(run), layout, plan)
    again = apply_filters(parse_run_config(run), layout, plan)  # a second rerun: a no-op
    assert again == entry and [e["run_id"] for e in read_log(layout)] == ["run1", "run2"]
    assert_split_once(fs, root, layout, plan)
    index = pq.read_table(f"{root}/dedup_index/minhash-0.85-v1/run2.parquet")
    assert index.num_rows == entry["kept_rows"] * dedup.lsh_bands(0.85)[0]
    assert entry["kept_rows"] + entry["filtered_rows"] == 40 == entry["input_rows"]


def test_bad_filter_configs_are_one_line_each_and_exit_2(tmp_path):
    runner = CliRunner()
    for rule, message in (
        ({"kind": "dedupe"}, "filters.0: kind must be one of: dedup"),
        ({"kind": "dedup", "method": "exact", "threshold": 0.9},
         "filters.0: threshold applies to method minhash only"),
        ({"kind": "dedup", "threshold": 0.99}, "filters.0.threshold: Input should be less"),
        ({"kind": "dedup", "scope": "everywhere"}, "filters.0.scope: Input should be 'run'"),
    ):
        path = tmp_path / "run.json"
        path.write_text(json.dumps({**config(str(tmp_path / "out")), "filters": [rule]}))
        result = runner.invoke(app, ["plan", str(path)])
        assert result.exit_code == 2 and message in result.output, result.output
        assert len(result.output.strip().splitlines()) == 2  # the header and the one problem
    assert not os.path.exists(tmp_path / "out")


def test_rules_apply_in_order_a_dedup_sees_only_what_a_keep_rule_kept(store):
    """keep, then dedup: the record a keep rule drops cannot be a cluster's keeper, so its
    near-duplicate survives; filtered/ says which rule dropped each and why."""
    fs, root = store
    text = f"{BASE} {BASE}"
    graded = [record("a", json.dumps({"score": 1, "text": text})),
              record("b", json.dumps({"score": 5, "text": text})),
              record("c", json.dumps({"score": 4, "text": OTHER})),
              record("d", "not json")]
    layout, plan = commit_run(fs, root, "run1", [graded[:2], graded[2:]])
    keep = {"kind": "keep", "field": "score", "op": ">=", "value": 3}
    raw = {**config(root, threshold=0.5), "run_id": "run1"}
    raw["filters"] = [keep, raw["filters"][0]]
    entry = apply_filters(parse_run_config(raw), layout, plan)
    kept, dropped = kept_and_dropped(fs, root, "run1")
    assert kept == [("b", 0), ("c", 0)]
    assert dropped == {("a", 0): (None, None, None, "score is 1, not >= 3"),
                       ("d", 0): (None, None, None, "missing: the record has no field 'score'")}
    assert {json.loads(r["filter_rule"])["kind"] for r in dataset(fs, root, "filtered",
                                                                  "run1")} == {"keep"}
    assert (entry["kept_rows"], entry["filtered_rows"], entry["duplicate_rows"]) == (2, 2, 0)
    assert_split_once(fs, root, layout, plan)

    # Without the keep rule, a keeps its cluster and b is its near-duplicate.
    layout, plan = commit_run(fs, root, "run2", [graded[:2], graded[2:]])
    run = parse_run_config({**config(root, threshold=0.5), "run_id": "run2"})
    apply_filters(run, layout, plan)
    kept, dropped = kept_and_dropped(fs, root, "run2")
    assert kept == [("a", 0), ("c", 0), ("d", 0)]
    assert dropped == {("b", 0): ("run2", "a", 0, "near_duplicate")}
