"""Quality guards: a run whose rows mostly failed or came back blank must not look successful.

Per shard: how many completions are blank and which reasons the error rows have. Per run: the
error and blank fractions against `max_error_fraction` / `max_empty_fraction`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from reporting.metrics import guard_fractions
from schemas.run import RunConfig
from tasks.failures import RunFailed
from tasks.records import BadRecord


class QualityError(RunFailed):
    """The run committed its shards, but too many rows failed or came back empty."""


def reason_class(reason: str) -> str:
    """`prompt_too_long: 300 tokens > ...` -> `prompt_too_long`."""
    return reason.split(":", 1)[0].strip()


def error_reason_counts(bad: list[BadRecord]) -> list[dict[str, Any]]:
    """[{"reason", "rows"}], most frequent first (the metrics' `error_reasons` column)."""
    counts = Counter(reason_class(b.reason) for b in bad)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return [{"reason": reason, "rows": rows} for reason, rows in ranked]


def blank_count(texts: list[str]) -> int:
    return sum(1 for text in texts if not text.strip())


def quality_problems(
    summary: dict[str, Any], max_error_fraction: float, max_empty_fraction: float
) -> list[str]:
    """What is wrong with the run's committed rows, in words; empty when it passes."""
    ok, errors, empty = (summary[k] or 0 for k in ("ok_rows", "error_rows", "empty_completions"))
    problems = []
    error_fraction, empty_fraction = guard_fractions(ok, errors, empty)
    if error_fraction is not None and error_fraction > max_error_fraction:
        reasons = ", ".join(f"{r['reason']} {r['rows']}" for r in summary["error_reasons"])
        problems.append(
            f"{errors} of {ok + errors} rows failed ({error_fraction:.0%} > max_error_fraction "
            f"{max_error_fraction:.0%}; reasons: {reasons}); see {summary['errors']}"
        )
    if empty_fraction is not None and empty_fraction > max_empty_fraction:
        problems.append(
            f"{empty} of {ok} completions are empty ({empty_fraction:.0%} > max_empty_fraction "
            f"{max_empty_fraction:.0%}); an instruct model given raw text often answers "
            "nothing: check input.chat_template and the prompts"
        )
    return problems


def enforce_quality(summary: dict[str, Any], config: RunConfig) -> None:
    """Raise QualityError naming every guard the run failed (its shards stay committed)."""
    problems = quality_problems(summary, config.max_error_fraction, config.max_empty_fraction)
    if problems:
        raise QualityError(
            f"run {summary['run_id']} failed its quality guards: " + "; ".join(problems)
            + ". Committed shards are kept; fix the cause and rerun with a new config"
        )
