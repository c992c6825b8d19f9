"""A run's closing numbers, computed from its committed metrics with the report's own views,
so the flow's summary artifact, the CLI's table and `corpusgen report` never disagree."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from reporting.metrics import summarize_metrics

COUNT_FIELDS = ("ok_rows", "error_rows", "empty_completions", "looping_completions",
                "prompt_tokens", "generated_tokens")
# From the run's filter log entry; None for a run without filters.
FILTER_FIELDS = ("kept_rows", "filtered_rows", "duplicate_rows")
# None when undefined (no tokens, nothing proposed): an honest blank, not a zero.
FIGURE_FIELDS = (
    "acceptance_rate", "mean_accepted_length", "tokens_per_second", "wall_seconds",
    "device_seconds", "cost", "engine_load_seconds", "engine_load_cost", "total_cost",
    "cost_per_1m_tokens", "total_cost_per_1m_tokens",
)


def run_summary(
    metrics: pa.Table, run_id: str, run_date: str, output: str, shards_planned: int,
    unscheduled: int, failed: list[str], filtered: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A run's closing numbers from its committed metrics rows, by the report's own views, and
    from its filter log entry (`filtered`) when its filters were applied."""
    report = summarize_metrics(metrics) if metrics.num_rows else {"total": {}, "error_reasons": []}
    totals = report["total"]
    return {
        "run_id": run_id,
        "run_date": run_date,
        "output": output,
        "shards_planned": shards_planned,
        "shards_committed": metrics.num_rows,
        "shards_failed": failed,
        "stopped_on_budget": unscheduled > 0,
        "shards_not_scheduled": unscheduled,
        **{field: totals.get(field) or 0 for field in COUNT_FIELDS},
        **{field: totals.get(field) for field in FIGURE_FIELDS},
        "error_reasons": [
            {"reason": r["reason"], "rows": r["rows"]}
            for r in report["error_reasons"] if r["level"] == "total"
        ],
        **{field: (filtered or {}).get(field) for field in FILTER_FIELDS},
        **{kind: f"{output}/{kind}/run_date={run_date}/run_id={run_id}/"
           for kind in ("data", "errors", "metrics", *(("filtered",) if filtered else ()))},
    }


def _usd(value: float | None, digits: int = 6) -> str:
    return "n/a" if value is None else f"${value:.{digits}f}"


def _number(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def summary_figures(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The handful of named figures a person reads first, formatted (n/a when undefined)."""
    rows = summary["ok_rows"] + summary["error_rows"]
    reasons = ", ".join(f"{r['reason']} {r['rows']}" for r in summary["error_reasons"]) or "none"
    return [
        ("shards committed", f"{summary['shards_committed']} of {summary['shards_planned']}"),
        ("rows ok / error", f"{summary['ok_rows']:,} / {summary['error_rows']:,} of {rows:,}"),
        ("error reasons", reasons),
        ("empty completions", f"{summary['empty_completions']:,}"),
        ("completions ending in a loop", f"{summary['looping_completions']:,}"),
        *([("kept / filtered", kept_line(summary))] if summary["kept_rows"] is not None else []),
        ("generated tokens", f"{summary['generated_tokens']:,}"),
        ("tokens per second", _number(summary["tokens_per_second"], 1)),
        ("acceptance rate", _number(summary["acceptance_rate"])),
        ("mean accepted length", _number(summary["mean_accepted_length"])),
        ("generation cost", f"{_usd(summary['cost'])} "
                            f"({_number(summary['device_seconds'], 1)} device-s)"),
        ("engine load cost", f"{_usd(summary['engine_load_cost'])} "
                             f"({_number(summary['engine_load_seconds'], 1)} s)"),
        ("total cost", _usd(summary["total_cost"])),
        ("total cost per 1M tokens", _usd(summary["total_cost_per_1m_tokens"], 4)),
    ]


def kept_line(rows: dict[str, Any]) -> str:
    """`9,000 / 1,000 of 10,000 (duplicates 10.0%)`: a run's filter outcome."""
    total = rows["kept_rows"] + rows["filtered_rows"]
    rate = rows["duplicate_rows"] / total if total else 0.0
    return (f"{rows['kept_rows']:,} / {rows['filtered_rows']:,} of {total:,} "
            f"(duplicates {rate:.1%})")


def cost_report_markdown(summary: dict[str, Any], usd_per_hour: float, device_type: str) -> str:
    budget = (
        f"**Stopped on budget**: {summary['shards_not_scheduled']} shard(s) not scheduled.\n\n"
        if summary["stopped_on_budget"] else ""
    )
    rows = "".join(f"| {name} | {value} |\n" for name, value in summary_figures(summary))
    return (
        f"# Run `{summary['run_id']}`\n\n{budget}"
        f"| | |\n|---|---|\n| device | {device_type} at ${usd_per_hour:.4f}/device-hour |\n"
        f"{rows}\nTotal cost = generation cost + engine load cost.\n\n"
        f"Outputs: `{summary['data']}`; errors: `{summary['errors']}`; "
        f"metrics: `{summary['metrics']}`.\n"
    )


