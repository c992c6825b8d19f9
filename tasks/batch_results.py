"""A batch-file run's committed rows as the OpenAI Batch API's output files.

One output line per request in input order: the data rows of a request (one per sample) become
one `chat.completion` whose choices are its samples; its error row becomes a line with a 400
response whose body holds an OpenAI error object (code: the reason's class, message: the
reason, param: the request field it names). Ids are derived from (run, line), so exporting
twice writes the same lines.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from itertools import groupby
from typing import Any, TextIO

from fsspec import AbstractFileSystem

from schemas.arrow import DATA_SCHEMA, ERRORS_SCHEMA, METRICS_SCHEMA
from schemas.run import OPENAI_BATCH
from tasks.commit import committed_shard_ids, read_published
from tasks.layout import RunLayout
from tasks.planning import Plan, Shard

# cache_full: the row reached the largest cache bucket, the context's end: OpenAI says length
FINISH_REASONS = {"stop": "stop", "length": "length", "cache_full": "length"}
PARAM = re.compile(r"^\w+: (body\.[\w.\[\]]+|url|method|custom_id)")


class ExportError(ValueError):
    """An export that cannot be made as asked; the message says why and what to do."""


@dataclass(frozen=True)
class BatchOutput:
    run_id: str
    results: list[dict[str, Any]]  # the output file's lines
    errors: list[dict[str, Any]]  # the error file's lines


def find_run(fs: AbstractFileSystem, root: str, run_id: str | None) -> tuple[RunLayout, Plan]:
    """The finished batch-file run to export: `run_id`, or the output's only run."""
    plans = {}
    for path in fs.glob(f"{root}/plan/run_date=*/run_id=*/plan.json"):
        plan = Plan.from_json(fs.cat_file(path).decode())
        plans[plan.run_id] = plan
    if run_id is None and len(plans) != 1:
        found = ", ".join(sorted(plans)) or "none"
        raise ExportError(f"{root} holds {len(plans)} runs ({found}); pick one with --run")
    if run_id is not None and run_id not in plans:
        raise ExportError(f"no run {run_id} under {root}; runs there: "
                          f"{', '.join(sorted(plans)) or 'none'}")
    plan = plans[run_id] if run_id else next(iter(plans.values()))
    if any(shard.format != OPENAI_BATCH for shard in plan.shards):
        raise ExportError(f"run {plan.run_id} did not read an OpenAI Batch API file "
                          "(input.format: openai_batch): there is nothing to answer")
    layout = RunLayout(fs, root, plan.run_id, plan.run_date)
    left = len({s.shard_id for s in plan.shards} - committed_shard_ids(layout))
    if left:
        raise ExportError(f"run {plan.run_id} is not finished: {left} of {len(plan.shards)} "
                          "shards are not committed; rerun its config to finish it, then export")
    return layout, plan


def _key(run_id: str, shard: Shard, offset: int) -> str:
    return hashlib.sha256(f"{run_id}|{shard.path}|{offset}".encode()).hexdigest()[:24]


def _completion(run_id: str, shard: Shard, rows: list[dict], metrics: dict) -> dict[str, Any]:
    first, key = rows[0], _key(run_id, shard, rows[0]["input_offset"])
    generated = sum(row["completion_tokens"] for row in rows)
    body = {
        "id": f"chatcmpl-{key}",
        "object": "chat.completion",
        "created": int(metrics["finished_at"].timestamp()),
        "model": metrics["target_model"],
        "choices": [
            {"index": row["sample_index"], "logprobs": None,
             "finish_reason": FINISH_REASONS[row["finish_reason"]],
             "message": {"role": "assistant", "content": row["completion"], "refusal": None}}
            for row in rows
        ],
        "usage": {"prompt_tokens": first["prompt_tokens"], "completion_tokens": generated,
                  "total_tokens": first["prompt_tokens"] + generated},
    }
    return {"id": f"batch_req_{key}", "custom_id": first["id"],
            "response": {"status_code": 200, "request_id": f"req_{key}", "body": body},
            "error": None}


def _error(run_id: str, shard: Shard, row: dict) -> dict[str, Any]:
    key = _key(run_id, shard, row["input_offset"])
    param = PARAM.match(row["reason"])
    error = {"message": row["reason"], "type": "invalid_request_error",
             "param": param.group(1).removeprefix("body.") if param else None,
             "code": row["reason"].split(":", 1)[0]}
    return {"id": f"batch_req_{key}", "custom_id": row["id"],
            "response": {"status_code": 400, "request_id": f"req_{key}",
                         "body": {"error": error}},
            "error": None}


def batch_output(layout: RunLayout, plan: Plan) -> BatchOutput:
    """The run's output and error lines, each in input order (file, then byte offset)."""
    shards = {shard.shard_id: shard for shard in plan.shards}
    files = {path: index for index, path in enumerate(dict.fromkeys(s.path for s in plan.shards))}

    def place(row: dict) -> tuple[int, int]:
        return files[shards[row["shard_id"]].path], row["input_offset"]

    metrics = {row["shard_id"]: row for row in read_published(layout, "metrics", METRICS_SCHEMA)
               .select(["shard_id", "finished_at", "target_model"]).to_pylist()}
    data = sorted(read_published(layout, "data", DATA_SCHEMA).to_pylist(),
                  key=lambda row: (place(row), row["sample_index"]))
    results = [
        _completion(plan.run_id, shards[rows[0]["shard_id"]], rows, metrics[rows[0]["shard_id"]])
        for rows in (list(group) for _, group in groupby(data, key=place))
    ]
    errors = [_error(plan.run_id, shards[row["shard_id"]], row)
              for row in sorted(read_published(layout, "errors", ERRORS_SCHEMA).to_pylist(),
                                key=place)]
    return BatchOutput(plan.run_id, results, errors)


def write_lines(lines: list[dict[str, Any]], file: TextIO) -> None:
    for line in lines:
        file.write(json.dumps(line, ensure_ascii=False) + "\n")
