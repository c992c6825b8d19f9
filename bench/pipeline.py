"""Pipeline overhead and planning speed, printed as JSON.

1. A demo run (the shipped prompts + packaged SmolLM2, through `generate_corpus`): the share of
   its wall time spent outside `Engine.generate` (goal <= 5 %), with and without the one-time
   engine load + warm-up. Prefect's own start-up (ephemeral server) is timed separately. With
   `--slots N` shards share the one engine N at a time: the device-seconds billed (shards +
   engine load) over the flow's wall time must stay <= 1.
2. Planning time for 10,000 shards (a JSONL input cut into 10,000 byte ranges, plan written).

    python bench/pipeline.py [--rows 24] [--max-new-tokens 48] [--skip-demo]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time
from pathlib import Path

import fsspec
import pyarrow.dataset as ds
import yaml

from bench._common import machine

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

DEMO_DIR = Path(__file__).resolve().parent.parent / "flows" / "demo"


def timed(owner, name: str, totals: dict[str, float]) -> None:
    """Wrap owner.name so its cumulative wall time lands in totals[name]."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - started

    setattr(owner, name, wrapper)


def _start_prefect() -> None:
    """Start the API (ephemeral server unless PREFECT_API_URL is set) before timing the run:
    a one-time cost per process, reported on its own."""
    from prefect import flow

    flow(name="bench-warm-up")(lambda: None)()


def demo_overhead(rows: int, max_new_tokens: int, slots: int, workdir: Path) -> dict:
    from flows.generate import generate_corpus
    from generation import Engine

    totals: dict[str, float] = {}
    timed(Engine, "generate", totals)
    timed(Engine, "warmup", totals)
    timed(Engine, "from_config", totals)

    prompts = (DEMO_DIR / "prompts.jsonl").read_text().splitlines()[:rows]
    (workdir / "prompts.jsonl").write_text("\n".join(prompts) + "\n")
    config = yaml.safe_load((DEMO_DIR / "config.yaml").read_text())
    config["input"]["uri"] = str(workdir / "prompts.jsonl")
    config["output"] = str(workdir / "out")
    config["generation"]["sampling"]["max_new_tokens"] = max_new_tokens
    config["accelerator_slots"] = slots

    started = time.perf_counter()
    _start_prefect()
    prefect_startup = time.perf_counter() - started
    started = time.perf_counter()
    summary = generate_corpus(config)
    wall = time.perf_counter() - started
    generate = totals.get("generate", 0.0)
    metrics = ds.dataset(workdir / "out" / "metrics", partitioning="hive").to_table()
    shard_tasks = sum(metrics.column("wall_seconds").to_pylist())
    billed = sum(metrics.column("device_seconds").to_pylist()) + sum(
        metrics.column("engine_load_seconds").to_pylist()
    )
    # What billing each shard task's start-to-end span (lock waits included) would have charged.
    spans = sum(
        (end - start).total_seconds()
        for start, end in zip(metrics.column("started_at").to_pylist(),
                              metrics.column("finished_at").to_pylist(), strict=True)
    )
    load = totals.get("from_config", 0.0) + totals.get("warmup", 0.0)
    return {
        "rows": summary["ok_rows"],
        "shards": summary["shards_committed"],
        "generated_tokens": summary["generated_tokens"],
        "prefect_startup_seconds": round(prefect_startup, 2),
        "flow_wall_seconds": round(wall, 2),
        "accelerator_slots": slots,
        "shard_task_seconds": round(shard_tasks, 2),
        "billed_device_seconds_over_flow_wall": round(billed / wall, 3),
        "task_spans_over_flow_wall": round(spans / wall, 3),
        "engine_generate_seconds": round(generate, 2),
        "engine_load_and_warmup_seconds": round(load, 2),
        "share_outside_generate": round(1 - generate / wall, 4),
        "share_outside_generate_excluding_load_warmup": round(1 - generate / (wall - load), 4),
    }


def planning_time(shards: int, workdir: Path) -> dict:
    from schemas.run import parse_run_config
    from tasks.layout import RunLayout
    from tasks.planning import new_plan, plan_shards, write_plan

    rows_per_shard = 4
    path = workdir / "big.jsonl"
    line = json.dumps({"id": "x" * 8, "prompt": "Write a sentence about the sea."}) + "\n"
    path.write_text(line * shards * rows_per_shard)
    config = parse_run_config(
        {
            "input": {"uri": str(path), "prompt_field": "prompt"},
            "generation": {"engine": {"target": {"path": "unused"}}},
            "output": str(workdir / "plan-out"),
            "sharding": {"rows_per_shard": rows_per_shard},
        }
    )
    fs = fsspec.filesystem("file")
    started = time.perf_counter()
    planned = plan_shards(fs, config, str(path))
    planned_at = time.perf_counter()
    layout = RunLayout.locate(fs, str(workdir / "plan-out"), "bench")
    write_plan(layout, new_plan(layout, config, planned))
    finished = time.perf_counter()
    return {
        "shards": len(planned),
        "plan_seconds": round(planned_at - started, 4),
        "plan_and_write_seconds": round(finished - started, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--slots", type=int, default=1, help="accelerator_slots of the demo run")
    parser.add_argument("--skip-demo", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = {"planning_10k": planning_time(10_000, Path(tmp))}
        if not args.skip_demo:
            result["demo"] = demo_overhead(args.rows, args.max_new_tokens, args.slots, Path(tmp))
    print(json.dumps({"machine": machine(), **result}, indent=2))


if __name__ == "__main__":
    main()
