"""Ids are unique over a run's data: later copies of an id, in any shard, become error rows
`duplicate_id` naming where the id was first used, and the quality guard counts them."""

from __future__ import annotations

import json

import fsspec
import pyarrow.dataset as ds
import pytest
from pipeline_fixtures import good_rows, run_config, tiny_engine, write_jsonl, write_parquet

from flows.generate import generate_corpus
from schemas import parse_run_config
from tasks.duplicates import find_duplicates
from tasks.failures import RunFailed
from tasks.planning import plan_shards
from tasks.records import read_shard

FS = fsspec.filesystem("file")
pytestmark = pytest.mark.usefixtures("prefect_server")


def naive_later_copies(rows: list[dict]) -> set[int]:
    """Indexes of rows whose id an earlier row already used."""
    seen: set[str] = set()
    later = set()
    for index, row in enumerate(rows):
        if row["id"] in seen:
            later.add(index)
        seen.add(row["id"])
    return later


def rows_with_repeats(count: int) -> list[dict]:
    """Every 7th row reuses an earlier id, some from far back (other shards), some its
    neighbour's (the same shard)."""
    rows = good_rows(count)
    for index in range(7, count, 7):
        rows[index]["id"] = rows[index // 3 if index % 2 else index - 1]["id"]
    return rows


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_later_copies_are_found_in_plan_order_with_buckets_far_smaller_than_the_input(
    tmp_path, fmt
):
    rows = rows_with_repeats(300)
    path = tmp_path / f"in.{fmt}"
    write_jsonl(path, rows) if fmt == "jsonl" else write_parquet(path, rows, row_group_size=16)
    config = parse_run_config(run_config(str(path), str(tmp_path / "out"),
                                         {"target": {"path": "unused"}},
                                         sharding={"rows_per_shard": 20}))
    shards = plan_shards(FS, config, str(path))
    assert len(shards) > 5
    # 4 entries per bucket: the pass spills ~150 bucket files and still finds every copy.
    found = find_duplicates(FS, shards, config.input, entries_per_bucket=4)
    in_input_order, offset = {}, 0
    for shard in shards:
        for row, first_seen in found.get(shard.shard_id, {}).items():
            in_input_order[offset + row] = first_seen
        good, bad = read_shard(FS, shard, config.input, 0)
        offset += len(good) + len(bad)
    assert offset == len(rows)
    assert set(in_input_order) == naive_later_copies(rows)
    assert all(where.startswith("shard ") for where in in_input_order.values())


def test_a_run_publishes_each_id_once_and_counts_the_copies(tmp_path, tiny_llama_dir):
    rows = rows_with_repeats(48)
    write_jsonl(tmp_path / "in.jsonl", rows)
    config = run_config(str(tmp_path / "in.jsonl"), str(tmp_path / "out"),
                        tiny_engine(tiny_llama_dir), sharding={"rows_per_shard": 8},
                        max_error_fraction=0.5)
    config["generation"]["sampling"]["max_new_tokens"] = 2
    summary = generate_corpus(config)
    data = ds.dataset(tmp_path / "out" / "data", partitioning="hive").to_table()
    ids = data.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == len({row["id"] for row in rows})
    errors = ds.dataset(tmp_path / "out" / "errors", partitioning="hive").to_table().to_pylist()
    copies = [e for e in errors if e["reason"].startswith("duplicate_id")]
    assert len(copies) == len(naive_later_copies(rows))
    assert all("was first used by shard" in e["reason"] for e in copies)
    assert {"reason": "duplicate_id", "rows": len(copies)} in summary["error_reasons"]
    plan = json.loads(next((tmp_path / "out" / "plan").rglob("plan.json")).read_text())
    assert sum(len(shard["duplicates"]) for shard in plan["shards"]) == len(copies)

    strict = {**config, "output": str(tmp_path / "strict"), "max_error_fraction": 0.05}
    with pytest.raises(RunFailed, match="duplicate_id"):  # the quality guard counts them
        generate_corpus(strict)
