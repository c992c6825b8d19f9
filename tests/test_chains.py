"""Chain runs: a step reads another run's committed data (generate -> judge -> keep), with
lineage, filtered/ for what a rule dropped, exactly-once per step, and a plan that names the
upstream run; bad chain input is one line, exit 2. Real tiny model, real Prefect server."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pyarrow.dataset as ds
import pytest
import yaml
from pipeline_fixtures import good_rows, run_config, tiny_engine, write_jsonl
from typer.testing import CliRunner

from flows.cli import DEMO_DIR, app
from flows.generate import generate_corpus
from schemas.run import KeepFilter, parse_run_config
from tasks.chains import upstream_runs

runner = CliRunner()
GRADE = {"type": "object", "properties": {"score": {"type": "integer", "minimum": 1,
                                                    "maximum": 5},
                                          "reason": {"type": "string", "maxLength": 12}},
         "required": ["score", "reason"], "additionalProperties": False}
KEEP = {"kind": "keep", "field": "score", "op": ">=", "value": 3}


def rows(path: Path, kind: str = "data") -> list[dict]:
    if not path.joinpath(kind).exists():
        return []
    return ds.dataset(path / kind, partitioning="hive").to_table().to_pylist()


def judge_config(upstream: Path, output: Path, engine: dict, **overrides) -> dict:
    engine = {**engine, "bucket_grid": {**engine["bucket_grid"], "prompt_lengths": [64, 128],
                                        "cache_lengths": [192]}}
    config = {
        "input": {"uri": str(upstream / "data"),
                  "template": "Rate 1-5.\nQ: {prompt}\nA: {completion}"},
        "generation": {"engine": engine, "sampling": {"max_new_tokens": 40, "temperature": 1.0},
                       "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "grade", "schema": GRADE}}},
        "output": str(output),
        "sharding": {"rows_per_shard": 8},
        "filters": [KEEP],
        "max_looping_fraction": 1.0,  # random tiny judges repeat themselves (run_config's note)
    }
    config.update(overrides)
    return config


@pytest.fixture(scope="module")
def upstream(tmp_path_factory, tiny_llama_dir, prefect_server):
    """A finished upstream run: 6 records x 2 samples."""
    root = tmp_path_factory.mktemp("chain")
    write_jsonl(root / "in.jsonl", good_rows(6))
    config = run_config(str(root / "in.jsonl"), str(root / "gen"), tiny_engine(tiny_llama_dir),
                        generation={"engine": tiny_engine(tiny_llama_dir), "samples_per_prompt": 2,
                                    "sampling": {"max_new_tokens": 8}})
    summary = generate_corpus(config)
    return root, config, summary


def test_generate_judge_keep_end_to_end_exactly_once(upstream, tiny_llama_dir):
    root, gen_config, gen_summary = upstream
    gen = rows(root / "gen")
    assert len(gen) == 12
    config = judge_config(root / "gen", root / "judge", tiny_engine(tiny_llama_dir))
    summary = generate_corpus(config)
    kept, dropped, errors = rows(root / "judge"), rows(root / "judge", "filtered"), rows(
        root / "judge", "errors")
    # Every upstream record is judged exactly once: kept, filtered or an error row.
    ids = [r["id"] for r in kept + dropped] + [e["id"] for e in errors]
    assert sorted(ids) == sorted(f"{r['id']}#{r['sample_index']}" for r in gen)
    assert kept and dropped and summary["ok_rows"] == len(kept) + len(dropped)  # generated
    by_id = {(r["id"], r["sample_index"]): r for r in gen}
    for record in kept + dropped:
        parent = by_id[(record["parent_id"], int(record["id"].rsplit("#", 1)[1]))]
        assert record["parent_run_id"] == gen_summary["run_id"]
        assert parent["completion"] in record["prompt"]  # the template saw the upstream row
        assert parent["input_prompt"] in record["input_prompt"]
        assert "<|im_start|>" not in record["input_prompt"]  # {prompt}: before its template
    for record in kept:
        assert json.loads(record["completion"])["score"] >= 3
    for record in dropped:
        score = json.loads(record["completion"])["score"]
        assert score < 3 and record["filter_reason"] == f"score is {score}, not >= 3"
        assert json.loads(record["filter_rule"]) == KEEP
        assert record["duplicate_of_id"] is None
    # The filter step dropped them, after every shard committed all it generated.
    assert len(rows(root / "judge", "generated")) == len(kept) + len(dropped)
    assert (summary["kept_rows"], summary["filtered_rows"]) == (len(kept), len(dropped))
    assert summary["generated_tokens"] == sum(r["completion_tokens"] for r in kept + dropped)

    # A rerun commits nothing new; the same run id.
    again = generate_corpus(config)
    assert again["run_id"] == summary["run_id"]
    assert len(rows(root / "judge")) == len(kept)
    assert len(rows(root / "judge", "filtered")) == len(dropped)

    # A new upstream run in the same output: the step's rerun is a new run that reads only it.
    write_jsonl(root / "more.jsonl", good_rows(3, start=100))
    newer = generate_corpus({**gen_config, "input": {**gen_config["input"],
                                                     "uri": str(root / "more.jsonl")}})
    third = generate_corpus(config)
    assert third["run_id"] != summary["run_id"]
    new_rows = [r for r in rows(root / "judge") + rows(root / "judge", "filtered")
                if r["run_id"] == third["run_id"]]
    new_errors = [e for e in rows(root / "judge", "errors") if e["run_id"] == third["run_id"]]
    assert len(new_rows) + len(new_errors) == 6
    assert {r["parent_run_id"] for r in new_rows} == {newer["run_id"]}
    assert {r["parent_id"] for r in new_rows} <= {f"rec-{i:05d}" for i in range(100, 103)}

    # Pinned to the first upstream run again, from the CLI: the first step run, complete.
    pinned = {**config, "input": {**config["input"], "run_id": gen_summary["run_id"]}}
    (root / "judge.yaml").write_text(yaml.safe_dump(pinned))
    result = runner.invoke(app, ["run", str(root / "judge.yaml")])
    assert result.exit_code == 0, result.output
    assert f"run {summary['run_id']}" in result.output
    assert f"Filtered records:  {root / 'judge'}/filtered/" in result.output
    assert len(rows(root / "judge", "filtered")) == len(dropped) + len(
        [r for r in rows(root / "judge", "filtered") if r["run_id"] == third["run_id"]])


def test_plan_names_the_upstream_run_and_bad_chain_input_is_one_line(
    upstream, tiny_llama_dir, tmp_path
):
    root, _, gen_summary = upstream
    config = judge_config(root / "gen", tmp_path / "judge", {"target": {"path": "unused"},
                                                              "bucket_grid": {}})

    def plan(**changes) -> tuple[int, str]:
        data = json.loads(json.dumps(config))
        for key, value in changes.items():
            section, _, field = key.partition("__")
            if field:
                data[section][field] = value
            else:
                data[section] = value
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(data))
        result = runner.invoke(app, ["plan", str(path)])
        assert "Traceback" not in result.output
        return result.exit_code, result.output

    newest = upstream_runs(fsspec.filesystem("file"), str(root / "gen"))[-1]
    status, output = plan()
    assert status == 0, output
    assert f"upstream: run {newest.run_id}" in output, output
    assert "the newest complete run" in output and f"{newest.rows} data rows" in output
    status, output = plan(input__run_id=gen_summary["run_id"])
    assert status == 0 and f"upstream: run {gen_summary['run_id']}" in output, output
    assert "12 data rows" in output and "(input.run_id of" in output
    assert 'filters[0] keep score >= 3' in output
    assert not (tmp_path / "judge").exists()

    (tmp_path / "empty" / "plan").mkdir(parents=True)
    (tmp_path / "empty" / "data").mkdir()
    for changes, named in [
        ({"input__uri": str(tmp_path / "empty" / "data")}, "no complete run"),
        ({"input__run_id": "nope"}, "'nope' is no run of"),
        ({"input__template": "Q: {question}"}, "'question' is no column"),
        ({"filters": [{**KEEP, "field": "grade"}]}, "'grade' exists nowhere"),
        ({"filters": [{**KEEP, "kind": "drop"}]}, "filters.0"),
    ]:
        status, output = plan(**changes)
        assert status == 2, output
        lines = [line for line in output.splitlines() if line.strip()]
        assert any(named in line for line in lines), output


def test_the_judge_demo_config_parses():
    raw = yaml.safe_load((DEMO_DIR / "judge.yaml").read_text())
    config = parse_run_config(raw)
    assert config.filters == [KeepFilter(kind="keep", field="score", op=">=", value=3)]
    schema = config.generation.response_format.json_schema.schema_
    assert schema["properties"]["score"] == {"type": "integer", "minimum": 1, "maximum": 5}
    assert schema["properties"]["reason"]["maxLength"] == 100


def test_a_plain_runs_filter_must_name_a_property_of_its_schema(tmp_path):
    """Filters work without a chain too, on this run's structured record: a field outside
    the schema is one line, exit 2, before anything is written."""
    write_jsonl(tmp_path / "in.jsonl", good_rows(3))
    config = run_config(str(tmp_path / "in.jsonl"), str(tmp_path / "out"),
                        {"target": {"path": "unused"}})
    config["generation"]["response_format"] = {"type": "json_schema",
                                               "json_schema": {"schema": GRADE}}
    for field, status in (("score", 0), ("grade", 2)):
        config["filters"] = [{**KEEP, "field": field}]
        (tmp_path / "run.json").write_text(json.dumps(config))
        result = runner.invoke(app, ["plan", str(tmp_path / "run.json")])
        assert result.exit_code == status, result.output
        assert "Traceback" not in result.output
    assert "'grade' exists nowhere" in result.output
    assert not (tmp_path / "out").exists()


def test_a_keep_rule_reads_the_upstream_record_when_this_run_has_no_such_field(
    upstream, tiny_llama_dir, tmp_path
):
    """The filter step finds each generated record's upstream row by parent_id and the
    upstream sample_index its id carries."""
    import pyarrow as pa

    from tasks.chains import pin_upstream
    from tasks.filters import drop_reason, upstream_of

    root, _, gen_summary = upstream
    config = pin_upstream(parse_run_config(judge_config(
        root / "gen", tmp_path / "judge", tiny_engine(tiny_llama_dir),
        input={"uri": str(root / "gen" / "data"), "run_id": gen_summary["run_id"],
               "template": "{completion}"})))
    gen = [r for r in rows(root / "gen") if r["run_id"] == gen_summary["run_id"]]
    records = pa.table({"id": [f"{r['id']}#{r['sample_index']}" for r in gen],
                        "parent_id": [r["id"] for r in gen]})
    found = upstream_of(config, records)
    assert [f["completion"] for f in found] == [r["completion"] for r in gen]
    rule = KeepFilter(kind="keep", field="sample_index", op="==", value=0)
    reasons = [drop_reason(rule, {"score": 4}, fields) for fields in found]
    assert reasons == [None if r["sample_index"] == 0 else "sample_index is 1, not == 0"
                       for r in gen]
    second = next(f for f, r in zip(found, gen, strict=True) if r["sample_index"] == 1)
    assert drop_reason(rule, {"sample_index": 0}, second) is None  # this run's field first
