"""Hand-made metrics datasets in the pipeline's committed layout, for the report tests and
bench/dashboard.py.

Layout (as tasks/layout.py writes it): <root>/metrics/run_date=D/run_id=R/<shard_id>.parquet holds
rows in METRICS_SCHEMA, committed by <root>/manifests/<run_id>.<shard_id>.json listing the files
relative to <root>.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import random
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.arrow import METRICS_SCHEMA

UTC = dt.UTC


def metrics_row(run_id: str, shard_id: str, **values: Any) -> dict[str, Any]:
    """One shard's metrics with plausible defaults; derived columns follow the schema docs."""
    row: dict[str, Any] = {
        "run_id": run_id,
        "shard_id": shard_id,
        "worker_id": "host:1",
        "input_rows": 10,
        "ok_rows": 10,
        "error_rows": 0,
        "prompt_tokens": 200,
        "generated_tokens": 1000,
        "padding_waste": 0.25,
        "batch_bucket": 4,
        "draft_kind": "model",
        "rounds": 300,
        "proposed": 1200,
        "accepted": 600,
        "accepted_per_position": [250, 200, 150],
        "proposed_per_position": [400, 400, 400],
        "target_forwards": 310,
        "draft_forwards": 900,
        "distinct_shapes": 3,
        "prefill_seconds": 1.0,
        "decode_seconds": 9.0,
        "draft_seconds": 3.0,
        "verify_seconds": 6.0,
        "wall_seconds": 10.0,
        "device_type": "cpu",
        "device_count": 1,
        "price_per_device_hour": 0.4,
        "engine_version": "test",
        "target_model": "tiny-llama",
        "target_weights_sha256": "a" * 64,
        "draft_model": "tiny-draft",
        "draft_weights_sha256": "b" * 64,
        "config_hash": "c" * 16,
        "started_at": dt.datetime(2026, 12, 1, 10, 0, tzinfo=UTC),
    }
    row.update(values)
    row.setdefault("finished_at", row["started_at"] + dt.timedelta(seconds=row["wall_seconds"]))
    row.setdefault("tokens_per_second", row["generated_tokens"] / row["wall_seconds"])
    row.setdefault("device_seconds", row["wall_seconds"] * row["device_count"])
    row.setdefault("cost", row["device_seconds"] / 3600 * row["price_per_device_hour"])
    row.setdefault("cost_per_1m_tokens", row["cost"] / row["generated_tokens"] * 1e6)
    proposed, accepted, rounds = row["proposed"], row["accepted"], row["rounds"]
    row.setdefault("acceptance_rate", accepted / proposed if proposed else None)
    row.setdefault("mean_accepted_length", 1 + accepted / rounds if rounds else None)
    if row["draft_kind"] == "none":  # plain decoding: the "plain estimate" is what it measured
        row.setdefault("plain_seconds_estimate", row["wall_seconds"])
    plain = row.get("plain_seconds_estimate")
    if plain is not None:
        plain_cost = plain * row["device_count"] / 3600 * row["price_per_device_hour"]
        row.setdefault("plain_cost_estimate", plain_cost)
    return row


def write_shard(
    root: str,
    row: dict[str, Any],
    storage_options: dict[str, Any] | None = None,
    committed: bool = True,
) -> str:
    """Write one shard's metrics file (and its manifest when committed); returns the file path."""
    fs, _ = fsspec.core.url_to_fs(root, **(storage_options or {}))
    run_date = row["started_at"].date().isoformat()
    relative = f"metrics/run_date={run_date}/run_id={row['run_id']}/{row['shard_id']}.parquet"
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([row], schema=METRICS_SCHEMA), buffer)
    fs.makedirs(f"{root}/{relative.rsplit('/', 1)[0]}", exist_ok=True)
    fs.makedirs(f"{root}/manifests", exist_ok=True)
    fs.pipe(f"{root}/{relative}", buffer.getvalue())
    if committed:
        manifest = {
            "shard_id": row["shard_id"],
            "run_id": row["run_id"],
            "attempt_id": "attempt-1",
            "files": {"data": [], "errors": [], "metrics": [relative]},
        }
        fs.pipe(
            f"{root}/manifests/{row['run_id']}.{row['shard_id']}.json",
            json.dumps(manifest).encode(),
        )
    return f"{root}/{relative}"


def three_runs() -> list[dict[str, Any]]:
    """Committed rows of three runs on three devices; run-b has error rows and plain-time
    estimates (1.5x its wall time), run-c a draft but no estimate, run-a no draft."""
    day = dt.datetime(2026, 11, 30, 8, 0, tzinfo=UTC)
    return [
        metrics_row(
            "run-a",
            "run-a-s0",
            started_at=day,
            draft_kind="none",
            draft_model=None,
            draft_weights_sha256=None,
            rounds=0,
            proposed=0,
            accepted=0,
            accepted_per_position=[],
            proposed_per_position=[],
            batch_bucket=2,
            generated_tokens=800,
            wall_seconds=20.0,
        ),
        metrics_row(
            "run-a",
            "run-a-s1",
            started_at=day,
            draft_kind="none",
            draft_model=None,
            draft_weights_sha256=None,
            rounds=0,
            proposed=0,
            accepted=0,
            accepted_per_position=[],
            proposed_per_position=[],
            batch_bucket=4,
            generated_tokens=1200,
            wall_seconds=25.0,
            padding_waste=0.1,
        ),
        metrics_row(
            "run-b",
            "run-b-s0",
            started_at=day + dt.timedelta(days=1),
            device_type="gaudi2",
            price_per_device_hour=1.3,
            device_count=2,
            input_rows=12,
            ok_rows=9,
            error_rows=3,
            generated_tokens=900,
            wall_seconds=6.0,
            plain_seconds_estimate=9.0,
        ),
        metrics_row(
            "run-b",
            "run-b-s1",
            started_at=day + dt.timedelta(days=1),
            device_type="gaudi2",
            price_per_device_hour=1.3,
            device_count=2,
            rounds=200,
            proposed=800,
            accepted=500,
            accepted_per_position=[300, 200],
            proposed_per_position=[400, 400],
            wall_seconds=8.0,
            plain_seconds_estimate=12.0,
            batch_bucket=8,
        ),
        metrics_row(
            "run-c",
            "run-c-s0",
            started_at=day + dt.timedelta(days=2),
            device_type="cuda-h100",
            price_per_device_hour=2.99,
            draft_kind="prompt_lookup",
            draft_model=None,
            draft_weights_sha256=None,
            generated_tokens=5000,
            wall_seconds=4.0,
            batch_bucket=8,
        ),
    ]


# Two series a scheduled deployment would run every day: (run id prefix, metrics values).
HISTORY_SERIES = (
    ("smol-lookup", {"target_model": "packaged:smollm2-135m-instruct", "draft_model": "",
                     "draft_kind": "prompt_lookup", "device_type": "cuda-h100",
                     "price_per_device_hour": 2.99}),
    ("qwen-pair", {"target_model": "/models/qwen2.5-coder-1.5b", "draft_kind": "model",
                   "draft_model": "/models/qwen2.5-coder-0.5b", "device_type": "gaudi2",
                   "price_per_device_hour": 1.3, "device_count": 2}),
)  # fmt: skip


def daily_history(
    days: int, shards_per_run: int, slow_day: int | None = None, seed: int = 0
) -> list[dict[str, Any]]:
    """Metrics rows of one run per series per day, with +-5 % day-to-day noise; on `slow_day`
    (0-based) the smol-lookup run takes 1.5x as long (a regression the report should flag)."""
    rng = random.Random(seed)
    first = dt.datetime(2026, 1, 1, 2, 0, tzinfo=UTC)
    rows = []
    for day in range(days):
        for prefix, values in HISTORY_SERIES:
            run_id = f"{prefix}-{day:03d}"
            slowdown = 1.5 if day == slow_day and prefix == "smol-lookup" else 1.0
            for index in range(shards_per_run):
                wall = 20.0 * slowdown * rng.uniform(0.95, 1.05)
                rows.append(metrics_row(
                    run_id, f"{run_id}-s{index:03d}", **values, wall_seconds=wall,
                    started_at=first + dt.timedelta(days=day, seconds=30 * index),
                    generated_tokens=4000, accepted=rng.randint(560, 640),
                    plain_seconds_estimate=wall * rng.uniform(1.6, 1.8),
                ))  # fmt: skip
    return rows
