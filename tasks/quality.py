"""Quality guards: a run whose rows mostly failed, came back blank or ran into a loop must not
look successful.

Per shard: how many completions are blank, how many end in a loop, and which reasons the error
rows have. Per run: those fractions against `max_error_fraction` / `max_empty_fraction` /
`max_looping_fraction`.
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


LOOP_MIN_REPEATS = 4  # a unit said 4 times in a row at the end
LOOP_MAX_UNIT = 200  # characters: a sentence or a short paragraph


def ends_in_loop(text: str) -> bool:
    """Whether the completion's end is one unit of text (up to LOOP_MAX_UNIT characters) said
    LOOP_MIN_REPEATS times or more in a row, and that stretch is at least half of it: what a
    model stuck in a loop writes until max_new_tokens ("Paris. Paris. Paris. ..."), which a
    list or a table with repeated cells is not (their rows differ)."""
    text = text.rstrip()
    length = len(text)
    for unit in range(1, min(LOOP_MAX_UNIT, length // LOOP_MIN_REPEATS) + 1):
        start = length - 1  # the periodic stretch is text[start + 1 - unit:]
        while start >= unit and text[start] == text[start - unit]:
            start -= 1
        stretch = length - 1 - start + unit
        if stretch >= LOOP_MIN_REPEATS * unit and 2 * stretch >= length:
            return True
    return False


def looping_count(texts: list[str]) -> int:
    return sum(1 for text in texts if ends_in_loop(text))


def quality_problems(
    summary: dict[str, Any], max_error_fraction: float, max_empty_fraction: float,
    max_looping_fraction: float,
) -> list[str]:
    """What is wrong with the run's committed rows, in words; empty when it passes."""
    ok, errors, empty, looping = (summary[k] or 0 for k in (
        "ok_rows", "error_rows", "empty_completions", "looping_completions"))
    problems = []
    error_fraction, empty_fraction, looping_fraction = guard_fractions(ok, errors, empty, looping)
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
    if looping_fraction is not None and looping_fraction > max_looping_fraction:
        problems.append(
            f"{looping} of {ok} completions end in a loop, one phrase repeated to the end "
            f"({looping_fraction:.0%} > max_looping_fraction {max_looping_fraction:.0%}); "
            "sample with a temperature (greedy decoding loops most), or use a larger model"
        )
    return problems


def enforce_quality(summary: dict[str, Any], config: RunConfig) -> None:
    """Raise QualityError naming every guard the run failed (its shards stay committed)."""
    problems = quality_problems(summary, config.max_error_fraction, config.max_empty_fraction,
                                config.max_looping_fraction)
    if problems:
        raise QualityError(
            f"run {summary['run_id']} failed its quality guards: " + "; ".join(problems)
            + ". Committed shards are kept; fix the cause and rerun with a new config"
        )
