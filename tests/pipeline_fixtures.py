"""Input corpora with known good and planted bad rows, shared by the pipeline tests."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

TOPICS = ["rivers", "bread", "comets", "chess", "glaciers", "violins", "bees", "lighthouses"]

# (raw line, reason prefix the errors dataset must show)
BAD_LINES = [
    ('{"id": "bad-json", "prompt": ', "malformed_json"),
    ('{"id": "no-prompt", "text": "hello"}', "missing_field"),
    ('{"id": "int-prompt", "prompt": 42}', "wrong_type"),
    ('{"id": "empty", "prompt": "   "}', "empty_prompt"),
    ('["not", "an", "object"]', "wrong_type"),
]


def good_rows(count: int, start: int = 0) -> list[dict]:
    return [
        {"id": f"rec-{i:05d}", "prompt": f"Write a sentence about {TOPICS[i % len(TOPICS)]} #{i}."}
        for i in range(start, start + count)
    ]


def write_jsonl(path: Path, rows: list[dict], bad_every: int = 0) -> list[str]:
    """Write rows, planting BAD_LINES after every `bad_every` good rows; returns planted reasons."""
    lines, reasons, planted = [], [], 0
    for index, row in enumerate(rows):
        lines.append(json.dumps(row))
        if bad_every and (index + 1) % bad_every == 0 and planted < len(BAD_LINES):
            line, reason = BAD_LINES[planted]
            lines.append(line)
            reasons.append(reason)
            planted += 1
    path.parent.mkdir(parents=True, exist_ok=True)
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return reasons


def write_parquet(path: Path, rows: list[dict], row_group_size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)


LONG_PROMPT_ROW = {"id": "too-long", "prompt": "word " * 300}


@pytest.fixture(scope="session")
def prefect_server():
    """One Prefect test server for the session (a pytest plugin, see conftest.py); yields its
    API URL for subprocesses."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()


def tiny_engine(model_dir) -> dict:
    return {
        "target": {"path": str(model_dir)},
        "device": "cpu",
        "bucket_grid": {
            "batch_sizes": [1, 2, 4],
            "prompt_lengths": [32, 64],
            "cache_lengths": [96],
            "draft_lengths": [2],
        },
    }


def run_config(input_uri: str, output: str, engine: dict, **overrides) -> dict:
    config = {
        "input": {"uri": input_uri, "prompt_field": "prompt", "id_field": "id"},
        "generation": {"engine": engine, "sampling": {"max_new_tokens": 8}},
        "output": output,
        "sharding": {"rows_per_shard": 8},
        # The tiny models are random weights: most of their completions repeat a token or two
        # to the end, which the looping guard rightly fails (its own tests set it).
        "max_looping_fraction": 1.0,
    }
    for key, value in overrides.items():
        config[key] = value
    return config
