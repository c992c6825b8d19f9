"""`corpusgen plan` estimates, before any device time is spent.

Rows and prompt tokens come from reading the input and rendering every prompt exactly as a
shard will (chat template included) with the target's tokenizer alone, no weights loaded.
Generated tokens, time and cost come from the committed metrics of earlier runs under the same
output with the same model pair and device type, when there are any; otherwise only the upper
bound (every sample runs to max_new_tokens) is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from schemas.pricing import device_cost
from schemas.run import RunConfig

HISTORY_SQL = """
SELECT count(DISTINCT run_id) AS runs, count(*) AS shards,
       sum(generated_tokens) / nullif(sum(ok_rows), 0) AS tokens_per_row,
       sum(generated_tokens) / nullif(sum(wall_seconds), 0) AS tokens_per_second,
       avg(engine_load_seconds) FILTER (WHERE engine_load_seconds > 0) AS load_seconds
FROM metrics
WHERE target_model = $target AND draft_model IS NOT DISTINCT FROM $draft
  AND draft_kind = $kind AND device_type = $device
"""


@dataclass(frozen=True)
class Estimate:
    rows: int  # records read
    bad_rows: int  # unreadable, or without a usable prompt
    too_long: int  # prompts longer than the largest prompt bucket
    cache_full: int  # prompts that fit but leave less room than max_new_tokens in the cache
    prompt_tokens: int  # of the prompts that fit, after templating
    chat_template: str  # chat | raw
    samples: int  # completions to generate (prompts that fit x their samples)
    max_generated_tokens: int  # every sample runs to its max_new_tokens
    history: dict[str, Any] | None  # earlier runs with the same model pair and device
    expected_generated_tokens: int | None
    expected_device_seconds: float | None  # generation + one engine load per engine
    expected_cost: float | None  # at this config's price


def history(con, config: RunConfig) -> dict[str, Any] | None:
    """Earlier runs under the output with the same model pair and device type, from their
    committed metrics (`con`: reporting.metrics.open_committed_metrics); None without any."""
    engine = config.generation.engine
    cursor = con.execute(HISTORY_SQL, {
        "target": engine.target.name, "draft": engine.draft_model_name(),
        "kind": engine.draft.kind if engine.draft else "none",
        "device": config.pricing.device_type,
    })
    row = dict(zip([c[0] for c in cursor.description], cursor.fetchone(), strict=True))
    return row if row["shards"] and row["tokens_per_second"] else None


@dataclass(frozen=True)
class PromptShape:
    """A usable prompt: its token count after templating, and what it asks to generate (a
    batch file's requests each set their own)."""

    tokens: int
    samples: int
    max_new_tokens: int


@dataclass(frozen=True)
class PromptCounts:
    """What reading and templating the shards' prompts found (tasks.prompting.count_prompts)."""

    rows: int  # records read
    bad_rows: int  # unreadable, or without a usable prompt
    prompts: list[PromptShape]
    chat_template: str  # chat | raw


def estimate_run(
    config: RunConfig, shard_count: int, prompts: PromptCounts, past: dict[str, Any] | None
) -> Estimate:
    """Rows, tokens and (from `past` runs) expected time and cost of generating `prompts`."""
    grid = config.generation.engine.bucket_grid
    fitting = [p for p in prompts.prompts if p.tokens <= grid.max_prompt]
    cache_full = sum(1 for p in fitting if p.tokens + p.max_new_tokens > grid.max_context)
    samples = sum(p.samples for p in fitting)
    max_tokens = sum(p.samples * p.max_new_tokens for p in fitting)
    expected_tokens = seconds = cost = None
    if past:
        expected_tokens = round(sum(min(past["tokens_per_row"], p.max_new_tokens) * p.samples
                                    for p in fitting))
        engines = 1 if config.dispatch.mode == "local" else min(
            config.accelerator_slots, -(-shard_count // config.dispatch.shards_per_run))
        load = (past["load_seconds"] or 0.0) * engines
        seconds = (expected_tokens / past["tokens_per_second"] + load) * config.devices_per_slot
        cost = device_cost(seconds, 1, config.pricing.usd_per_hour())
    return Estimate(prompts.rows, prompts.bad_rows, len(prompts.prompts) - len(fitting),
                    cache_full, sum(p.tokens for p in fitting), prompts.chat_template, samples,
                    max_tokens, past, expected_tokens, seconds, cost)


def cache_warning(estimate: Estimate, config: RunConfig) -> str | None:
    """Rows whose prompt + max_new_tokens pass the largest cache bucket, and what to raise."""
    if not estimate.cache_full:
        return None
    grid = config.generation.engine.bucket_grid
    new_tokens = config.generation.sampling.max_new_tokens
    needed = grid.max_prompt + new_tokens + grid.draft_lengths[-1] + 1
    return (
        f"warning: {estimate.cache_full} row(s) have prompt + max_new_tokens ({new_tokens}) "
        f"beyond the largest cache bucket ({grid.max_cache} tokens, {grid.max_context} after "
        "room for one verify round): they will stop early with finish_reason cache_full. "
        f"Raise generation.engine.bucket_grid.cache_lengths to include {needed}, or lower "
        "generation.sampling.max_new_tokens"
    )


def estimate_lines(estimate: Estimate, config: RunConfig) -> list[str]:
    """The estimate in words, for the CLI."""
    e = estimate
    lines = [
        f"rows: {e.rows} read, {e.bad_rows} unusable, {e.too_long} prompts too long for the "
        f"grid; {e.samples} completions to generate",
        f"prompt tokens ({e.chat_template} prompts): {e.prompt_tokens:,}",
        f"generated tokens: at most {e.max_generated_tokens:,}",
    ]
    if (warning := cache_warning(e, config)) is not None:
        lines.append(warning)
    if e.history is None:
        lines.append("expected time and cost: no committed runs with this model pair and device "
                     "under this output yet")
        return lines
    h = e.history
    lines += [
        f"expected generated tokens: {e.expected_generated_tokens:,} "
        f"({h['tokens_per_row']:.1f} per completion in {h['runs']} earlier run(s), "
        f"{h['shards']} shards)",
        f"expected device time: {e.expected_device_seconds:,.0f} s at "
        f"{h['tokens_per_second']:.1f} tokens/s, engine load included; "
        f"expected cost: ${e.expected_cost:.4f}",
    ]
    return lines
