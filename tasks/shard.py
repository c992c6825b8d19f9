"""The shard task: read a shard's range, generate, commit records + errors + metrics once.

A shard whose manifest exists is skipped (its publish is finished if a crash cut it short), so
reruns and retried tasks never regenerate or duplicate committed work.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from schemas.arrow import DATA_SCHEMA, ERRORS_SCHEMA, METRICS_SCHEMA
from schemas.engine import ResponseFormat
from schemas.pricing import device_cost
from schemas.run import RUN_OUTPUT, RunConfig
from tasks import leases
from tasks.batch_requests import read_records, shard_sampling
from tasks.commit import (
    commit_shard,
    new_attempt_id,
    publish,
    read_manifest,
)
from tasks.engine_cache import leased_engine
from tasks.failures import is_io_error
from tasks.layout import RunLayout
from tasks.planning import Shard, check_unchanged
from tasks.prompting import prompt_format, render_records
from tasks.provenance import provenance
from tasks.quality import blank_count, error_reason_counts, looping_count
from tasks.records import BadRecord, Record, truncate, with_samples
from tasks.stopping import ShardAbandoned, stop_requested
from tasks.storage import filesystem
from tasks.structured import INCOMPLETE, structured_problem

if TYPE_CHECKING:
    from generation.types import Completion

# Metrics columns copied as-is from engine.stats / engine.model_info / engine.draft_kind.
ENGINE_METRIC_FIELDS = (
    "prompt_tokens", "padding_waste", "prefill_padding_waste", "decode_padding_waste", "rounds",
    "proposed", "accepted", "acceptance_rate",
    "mean_accepted_length", "accepted_per_position", "proposed_per_position", "target_forwards",
    "draft_forwards", "distinct_shapes", "prefill_seconds", "decode_seconds", "draft_seconds",
    "verify_seconds", "target_model", "target_weights_sha256", "draft_model",
    "draft_weights_sha256", "draft_kind", "cpu_kernels", "cpu_model", "cpu_isa",
)
SUMMARY_FIELDS = ("input_rows", "ok_rows", "error_rows", "generated_tokens", "cost",
                  "wall_seconds", "engine_load_cost", "empty_completions", "looping_completions",
                  "acceptance_rate")


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class ShardOutcome:
    shard_id: str
    # committed | skipped (already committed) | lost (another attempt won) | leased (another
    # live run generates it now)
    status: str
    summary: dict[str, Any]  # SUMMARY_FIELDS of the committed attempt


def _generate(engine, records: list[Record], sampling, shard: Shard) -> list:
    """The engine's completions, or ShardAbandoned once the run is asked to stop."""
    from generation import GenerationStopped

    if not records:
        return []
    try:
        return engine.generate([r.prompt for r in records], sampling, [r.seed for r in records],
                               should_stop=stop_requested)
    except GenerationStopped:
        raise ShardAbandoned(f"shard {shard.shard_id} abandoned mid-generation: the run is "
                             "stopping; nothing of it was committed") from None


def _mean(values: list[float] | None) -> float | None:
    return sum(values) / len(values) if values else None


def _structured_records(
    response_format: ResponseFormat | None, ok: list[tuple[Record, Completion]]
) -> tuple[list[tuple[Record, Completion]], list[BadRecord]]:
    """The completions that are whole, valid records under the run's response format, and an
    error row for each one that is not (cut before its value closed, or failing validation)."""
    if response_format is None:
        return ok, []
    kept, bad = [], []
    for record, completion in ok:
        problem = structured_problem(response_format, completion)
        if problem is None:
            kept.append((record, completion))
        else:
            sample = f" (sample {record.sample_index})" if record.sample_index else ""
            bad.append(BadRecord(record.row, record.offset, record.record_id, problem + sample,
                                 truncate(completion.text)))
    return kept, bad


def _data_row(shard: Shard, record: Record, completion, parent_run_id: str | None) -> dict:
    return {
        "id": record.record_id,
        "shard_id": shard.shard_id,
        "prompt": record.prompt_text,
        "completion": completion.text,
        "finish_reason": completion.finish_reason,
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": len(completion.token_ids),
        "proposed": completion.proposed,
        "accepted": completion.accepted,
        "seed": record.seed,
        "sample_index": record.sample_index,
        "token_logprobs": completion.token_logprobs,
        "mean_logprob": _mean(completion.token_logprobs),
        "input_offset": record.offset,
        "input_prompt": record.input_prompt,
        "parent_id": record.parent_id,
        "parent_run_id": parent_run_id if record.parent_id is not None else None,
    }


def _tables(shard: Shard, records, completions, bad: list[BadRecord],
            parent_run_id: str | None = None):
    data = [
        _data_row(shard, record, completion, parent_run_id)
        for record, completion in zip(records, completions, strict=True)
    ]
    errors = [
        {"shard_id": shard.shard_id, "row": b.row, "id": b.record_id, "reason": b.reason,
         "raw": b.raw, "input_offset": b.offset}
        for b in sorted(bad, key=lambda b: b.row)
    ]
    return pa.Table.from_pylist(data, DATA_SCHEMA), pa.Table.from_pylist(errors, ERRORS_SCHEMA)


def process_shard(
    config: RunConfig, layout: RunLayout, shard: Shard, wait_for_lease: bool = False
) -> ShardOutcome:
    """Generate and commit one shard (or finish/skip it if it is already committed). A shard
    whose lease another live run holds is `leased` (skipped for now), or, with
    `wait_for_lease`, waited for until that run commits it or its lease expires."""
    manifest = read_manifest(layout, shard.shard_id)
    if manifest is not None:
        publish(layout, manifest)
        return ShardOutcome(shard.shard_id, "skipped", summary_of(manifest))
    if stop_requested():
        raise ShardAbandoned(f"shard {shard.shard_id} not started: the run is stopping")
    seconds = config.shard_lease_seconds
    lease = leases.take(layout, shard.shard_id, seconds)
    if lease is None and wait_for_lease:
        poll = min(5.0, seconds / 4)
        lease = leases.wait_for(layout, shard.shard_id, seconds, stop_requested, poll)
    if lease is None:
        if (manifest := read_manifest(layout, shard.shard_id)) is not None:
            return ShardOutcome(shard.shard_id, "skipped", summary_of(manifest))
        if stop_requested():
            raise ShardAbandoned(f"shard {shard.shard_id} not started: the run is stopping")
        return ShardOutcome(shard.shard_id, "leased", summary_of({}))
    with leases.held(lease):
        if (manifest := read_manifest(layout, shard.shard_id)) is not None:  # committed just
            return ShardOutcome(shard.shard_id, "skipped", summary_of(manifest))  # before
        return _generate_and_commit(config, layout, shard)


def _generate_and_commit(config: RunConfig, layout: RunLayout, shard: Shard) -> ShardOutcome:
    started_at = dt.datetime.now(dt.UTC)
    input_fs, _ = filesystem(config.input.uri, config.storage)
    check_unchanged(input_fs, [shard], layout.run_id)
    records, bad = read_records(input_fs, shard, config)
    input_rows = len(records) + len(bad)
    generation, sampling = config.generation, shard_sampling(shard, config)
    with leased_engine(generation.engine, generation.warmup) as lease:
        engine = lease.engine
        records, unrenderable = render_records(engine.tokenizer, records, config.input)
        records = with_samples(records, generation.samples_per_prompt, config.seed)
        engine.reset_stats()
        completions = _generate(engine, records, sampling, shard)
        engine_stats = {**engine.stats.as_dict(), **engine.model_info,
                        **engine.hardware_info, "draft_kind": engine.draft_kind}
        chat_template = prompt_format(engine.tokenizer, config.input)
        held_seconds = lease.held_seconds()
    ok = [(r, c) for r, c in zip(records, completions, strict=True) if c.finish_reason != "error"]
    bad += unrenderable + [  # a prompt the engine refused (too long, ...): one row per record
        BadRecord(r.row, r.offset, r.record_id, c.error, truncate(r.prompt_text))
        for r, c in zip(records, completions, strict=True)
        if c.finish_reason == "error" and r.sample_index == 0
    ]
    ok, unstructured = _structured_records(sampling.response_format, ok)
    bad += unstructured
    parent_run_id = config.input.run_id if config.input.format == RUN_OUTPUT else None
    data, errors = _tables(shard, [r for r, _ in ok], [c for _, c in ok], bad, parent_run_id)
    metrics = {
        **_metrics_row(
            config, layout, shard, engine_stats,
            input_rows=input_rows, ok_rows=data.num_rows, error_rows=errors.num_rows,
            generated=sum(len(c.token_ids) for _, c in ok),
            wall=held_seconds, load_seconds=lease.load_seconds, started_at=started_at,
        ),
        "empty_completions": blank_count([c.text for _, c in ok]),
        "looping_completions": looping_count([c.text for _, c in ok]),
        "cache_full_rows": sum(c.finish_reason == "cache_full" for _, c in ok),
        "partial_character_rows": sum(c.trimmed_partial_character for _, c in ok),
        "structured_rows": len(ok) if sampling.response_format else None,
        "structured_incomplete": sum(b.reason.startswith(INCOMPLETE) for b in unstructured),
        "error_reasons": error_reason_counts(bad),
        **provenance(sampling, generation.samples_per_prompt, chat_template),
    }
    records_kind = "generated" if config.filters else "data"  # filters publish data/ later
    tables = {records_kind: data, "errors": errors,
              "metrics": pa.Table.from_pylist([metrics], METRICS_SCHEMA)}
    summary = summary_of(metrics)
    check_unchanged(input_fs, [shard], layout.run_id)  # what was read is what was planned
    if commit_shard(layout, shard.shard_id, new_attempt_id(), tables, summary):
        return ShardOutcome(shard.shard_id, "committed", summary)
    winner = read_manifest(layout, shard.shard_id)
    publish(layout, winner)  # the winner may have died before publishing
    return ShardOutcome(shard.shard_id, "lost", summary_of(winner))


def summary_of(manifest_or_metrics: dict[str, Any]) -> dict[str, Any]:
    """SUMMARY_FIELDS of a metrics row or manifest (manifests written before a field: None)."""
    return {k: manifest_or_metrics.get(k) for k in SUMMARY_FIELDS}


def _metrics_row(
    config: RunConfig,
    layout: RunLayout,
    shard: Shard,
    engine_stats: dict[str, Any],
    *,
    input_rows: int,
    ok_rows: int,
    error_rows: int,
    generated: int,
    wall: float,
    load_seconds: float,
    started_at: dt.datetime,
) -> dict[str, Any]:
    """The shard's engine counters, rows, time and what it cost; `wall` is engine-held time."""
    from generation import ENGINE_VERSION  # lazily: torch stays out of `corpusgen plan`

    price, devices = config.pricing.usd_per_hour(), config.devices_per_slot
    device_seconds = wall * devices
    cost = device_cost(wall, devices, price)
    saved = engine_stats["seconds_saved_by_speculation"]
    plain_seconds = None if saved is None else wall + saved
    plain_cost = None if saved is None else device_cost(plain_seconds, devices, price)
    return {
        **{field: engine_stats[field] for field in ENGINE_METRIC_FIELDS},
        "run_id": layout.run_id,
        "shard_id": shard.shard_id,
        "worker_id": worker_id(),
        "input_rows": input_rows,
        "ok_rows": ok_rows,
        "error_rows": error_rows,
        "generated_tokens": generated,
        "batch_bucket": engine_stats["batch_bucket_max"],
        "wall_seconds": wall,
        "tokens_per_second": generated / wall if wall else None,
        "device_type": config.pricing.device_type,
        "device_count": devices,
        "device_seconds": device_seconds,
        "price_per_device_hour": price,
        "cost": cost,
        "cost_per_1m_tokens": cost / generated * 1e6 if generated else None,
        "engine_version": ENGINE_VERSION,
        "config_hash": config.config_hash(),
        "started_at": started_at,
        "finished_at": dt.datetime.now(dt.UTC),
        "engine_load_seconds": load_seconds,
        "engine_load_cost": device_cost(load_seconds, devices, price),
        "plain_seconds_estimate": plain_seconds,
        "plain_cost_estimate": plain_cost,
    }


@task(
    name="generate-shard",
    cache_policy=NO_CACHE,
    retry_condition_fn=is_io_error,
)
def generate_shard(
    config: RunConfig, run_date: str, shard: Shard, wait_for_lease: bool = False
) -> ShardOutcome:
    """One Prefect task per shard, run by a process that holds an accelerator slot."""
    fs, root = filesystem(config.output, config.storage)
    layout = RunLayout(fs, root, config.resolved_run_id(), run_date)
    outcome = process_shard(config, layout, shard, wait_for_lease)
    log_outcome(get_run_logger(), outcome)
    return outcome


def log_outcome(logger, outcome: ShardOutcome) -> None:
    if outcome.status == "leased":
        logger.info("shard %s is being generated by another run: later", outcome.shard_id)
        return
    s = outcome.summary
    acceptance = "n/a" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.3f}"
    logger.info(
        "shard %s %s: %s rows in, %s ok (%s empty, %s looping), %s errors, %s tokens, "
        "acceptance %s, %.2f s on the engine, cost $%.6f", outcome.shard_id, outcome.status,
        s["input_rows"], s["ok_rows"], s["empty_completions"], s["looping_completions"],
        s["error_rows"], s["generated_tokens"], acceptance,
        s["wall_seconds"], s["cost"],
    )
