"""Planning and reading: shards cover every record exactly once, ids are deterministic, bad
records become error rows with a reason."""

from __future__ import annotations

import itertools
import json
import os

import fsspec
import pytest
from pipeline_fixtures import BAD_LINES, good_rows, write_jsonl, write_parquet

from schemas import parse_run_config
from tasks.layout import RunLayout
from tasks.planning import InputError, new_plan, plan_shards, write_plan
from tasks.records import read_shard, record_seed

LOCAL = fsspec.filesystem("file")


def config_for(uri: str, rows_per_shard: int = 10, **input_fields):
    return parse_run_config(
        {
            "input": {"uri": uri, "prompt_field": "prompt", "id_field": "id", **input_fields},
            "generation": {"engine": {"target": {"path": "unused"}}},
            "output": "unused",
            "sharding": {"rows_per_shard": rows_per_shard},
        }
    )


def read_all(shards, config):
    good, bad = [], []
    for shard in shards:
        shard_good, shard_bad = read_shard(LOCAL, shard, config.input, config.seed)
        good += shard_good
        bad += shard_bad
    return good, bad


def test_jsonl_byte_ranges_cover_every_line_exactly_once(tmp_path):
    rows = good_rows(157)
    for row in rows[::7]:
        row["prompt"] += " padding" * (len(row["id"]) * 9)  # uneven line lengths
    write_jsonl(tmp_path / "a.jsonl", rows)
    config = config_for(str(tmp_path / "a.jsonl"), rows_per_shard=10)
    shards = plan_shards(LOCAL, config, str(tmp_path / "a.jsonl"))
    assert len(shards) > 10
    assert shards[0].start == 0 and shards[-1].end == os.path.getsize(tmp_path / "a.jsonl")
    assert all(a.end == b.start for a, b in itertools.pairwise(shards))
    good, bad = read_all(shards, config)
    assert [r.record_id for r in good] == [row["id"] for row in rows]
    assert not bad
    assert abs(sum(s.estimated_rows for s in shards) - len(rows)) <= len(rows) * 0.5


def test_shard_ids_are_deterministic_and_follow_the_file(tmp_path):
    path = tmp_path / "a.jsonl"
    write_jsonl(path, good_rows(40))
    config = config_for(str(path))
    first = [s.shard_id for s in plan_shards(LOCAL, config, str(path))]
    assert first == [s.shard_id for s in plan_shards(LOCAL, config, str(path))]
    assert len(set(first)) == len(first)
    write_jsonl(path, good_rows(41))
    assert not set(first) & {s.shard_id for s in plan_shards(LOCAL, config, str(path))}


def test_parquet_shards_are_whole_row_groups(tmp_path):
    rows = good_rows(95)
    write_parquet(tmp_path / "p" / "part-0.parquet", rows, row_group_size=20)
    config = config_for(str(tmp_path / "p"), rows_per_shard=30)
    shards = plan_shards(LOCAL, config, str(tmp_path / "p"))
    assert [(s.start, s.end, s.estimated_rows, s.first_row) for s in shards] == [
        (0, 2, 40, 0), (2, 4, 40, 40), (4, 5, 15, 80)
    ]
    good, bad = read_all(shards, config)
    assert [r.record_id for r in good] == [row["id"] for row in rows] and not bad


def test_gzip_is_one_shard_and_glob_spans_files(tmp_path):
    write_jsonl(tmp_path / "in" / "b.jsonl.gz", good_rows(30, start=100))
    write_jsonl(tmp_path / "in" / "a.jsonl", good_rows(30))
    config = config_for(str(tmp_path / "in" / "*.json*"))
    shards = plan_shards(LOCAL, config, str(tmp_path / "in" / "*.json*"))
    gz = [s for s in shards if s.format == "jsonl.gz"]
    assert len(gz) == 1 and gz[0].source == "b.jsonl.gz" and gz[0].estimated_rows > 0
    good, _ = read_all(shards, config)
    expected = [r["id"] for r in good_rows(30) + good_rows(30, start=100)]
    assert sorted(r.record_id for r in good) == expected


def test_one_huge_line_makes_no_empty_shards(tmp_path):
    """Boundaries move to line starts: a 1 MB line among short ones is one shard, not a run of
    empty shards that each cost an engine turn."""
    rows = good_rows(40)
    rows[20]["prompt"] = "x" * 1_000_000
    write_jsonl(tmp_path / "a.jsonl", rows)
    config = config_for(str(tmp_path / "a.jsonl"), rows_per_shard=8)
    shards = plan_shards(LOCAL, config, str(tmp_path / "a.jsonl"))
    assert shards[0].start == 0 and shards[-1].end == os.path.getsize(tmp_path / "a.jsonl")
    assert all(a.end == b.start for a, b in itertools.pairwise(shards))
    per_shard = [read_shard(LOCAL, shard, config.input, config.seed) for shard in shards]
    assert all(good or bad for good, bad in per_shard), "an empty shard"
    assert [r.record_id for good, _ in per_shard for r in good] == [row["id"] for row in rows]


def test_bad_records_become_error_rows_with_reasons(tmp_path):
    planted = write_jsonl(tmp_path / "a.jsonl", good_rows(25), bad_every=5)
    assert len(planted) == len(BAD_LINES)
    config = config_for(str(tmp_path / "a.jsonl"), rows_per_shard=1000)
    good, bad = read_all(plan_shards(LOCAL, config, str(tmp_path / "a.jsonl")), config)
    assert len(good) == 25
    assert [b.reason.split(":")[0] for b in bad] == planted
    assert bad[0].raw == BAD_LINES[0][0] and bad[1].record_id == "no-prompt"
    assert bad[0].reason == "malformed_json: Expecting value: column 30"
    assert [b.row for b in bad] == [5, 11, 17, 23, 29]  # row index within the shard


def test_template_and_chat_prompts(tmp_path):
    rows = [
        {"title": "Tides", "n": 3, "chat": [{"role": "user", "content": "Hi"}]},
        {"title": "Moss", "chat": [{"role": "robot", "content": "Hi"}]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    templated = config_for(str(path), template="About {title} in {n} words", prompt_field=None,
                           id_field=None)
    good, bad = read_all(plan_shards(LOCAL, templated, str(path)), templated)
    assert [r.prompt for r in good] == ["About Tides in 3 words"]
    assert good[0].record_id == "t.jsonl:0"
    assert bad[0].reason == "missing_field: 'n' is missing"
    chat = config_for(str(path), messages_field="chat", prompt_field=None, id_field=None)
    good, bad = read_all(plan_shards(LOCAL, chat, str(path)), chat)
    assert good[0].prompt == [{"role": "user", "content": "Hi"}]
    assert "chat[0] must be" in bad[0].reason


def test_record_seed_depends_on_run_seed_and_id():
    assert record_seed(0, "a") == record_seed(0, "a")
    assert len({record_seed(0, "a"), record_seed(1, "a"), record_seed(0, "b")}) == 3
    assert 0 <= record_seed(5, "x") < 2**63


def test_missing_input_and_unknown_format_are_clear(tmp_path):
    config = config_for(str(tmp_path / "nope*.jsonl"))
    with pytest.raises(InputError, match="matches no input files"):
        plan_shards(LOCAL, config, str(tmp_path / "nope*.jsonl"))
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(InputError, match="unknown extension"):
        plan_shards(LOCAL, config, str(tmp_path / "data.csv"))


def test_plan_is_written_once_and_a_changed_input_is_refused(tmp_path):
    path = tmp_path / "a.jsonl"
    write_jsonl(path, good_rows(30))
    config = config_for(str(path))
    layout = RunLayout.locate(LOCAL, str(tmp_path / "out"), "run1")
    plan = write_plan(layout, new_plan(layout, config, plan_shards(LOCAL, config, str(path))))
    again = write_plan(layout, new_plan(layout, config, plan_shards(LOCAL, config, str(path))))
    assert again == plan
    assert RunLayout.locate(LOCAL, str(tmp_path / "out"), "run1").run_date == layout.run_date
    write_jsonl(path, good_rows(31))
    with pytest.raises(InputError, match="input changed since"):
        write_plan(layout, new_plan(layout, config, plan_shards(LOCAL, config, str(path))))
