"""The run's closing numbers, computed from committed metrics with the reporting code, so the
flow's summary artifact and `corpusgen report` never disagree."""

from __future__ import annotations

from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from schemas.arrow import METRICS_SCHEMA
from tasks.commit import read_published
from tasks.layout import RunLayout
from tasks.planning import Plan
from tasks.reporting import summarize_metrics

TOTAL_FIELDS = (
    "ok_rows", "error_rows", "prompt_tokens", "generated_tokens", "acceptance_rate",
    "mean_accepted_length", "tokens_per_second", "device_seconds", "cost", "cost_per_1m_tokens",
)


def summarize_run(
    layout: RunLayout, output: str, plan: Plan, unscheduled: int, failed: list[str]
) -> dict[str, Any]:
    metrics = read_published(layout, "metrics", METRICS_SCHEMA)
    totals = summarize_metrics(metrics)["total"] if metrics.num_rows else {}
    return {
        "run_id": layout.run_id,
        "run_date": layout.run_date,
        "output": output,
        "shards_planned": len(plan.shards),
        "shards_committed": metrics.num_rows,
        "shards_failed": failed,
        "stopped_on_budget": unscheduled > 0,
        "shards_not_scheduled": unscheduled,
        **{field: totals.get(field) or 0 for field in TOTAL_FIELDS},
        "data": f"{output}/data/run_date={layout.run_date}/run_id={layout.run_id}/",
        "errors": f"{output}/errors/run_date={layout.run_date}/run_id={layout.run_id}/",
        "metrics": f"{output}/metrics/run_date={layout.run_date}/run_id={layout.run_id}/",
    }


def cost_report_markdown(summary: dict[str, Any], usd_per_hour: float, device_type: str) -> str:
    budget = (
        f"**Stopped on budget**: {summary['shards_not_scheduled']} shard(s) not scheduled.\n\n"
        if summary["stopped_on_budget"] else ""
    )
    return (
        f"# Cost report: run `{summary['run_id']}`\n\n{budget}"
        f"| | |\n|---|---|\n"
        f"| device | {device_type} at ${usd_per_hour:.4f}/device-hour |\n"
        f"| device-seconds | {summary['device_seconds']:.1f} |\n"
        f"| cost | ${summary['cost']:.6f} |\n"
        f"| generated tokens | {summary['generated_tokens']} |\n"
        f"| cost per 1M tokens | ${summary['cost_per_1m_tokens']:.4f} |\n"
        f"| acceptance rate | {summary['acceptance_rate']:.3f} |\n"
        f"| mean accepted length | {summary['mean_accepted_length']:.3f} |\n\n"
        f"Outputs: `{summary['data']}`; metrics: `{summary['metrics']}`.\n"
    )


def publish_summary_artifacts(summary: dict[str, Any], usd_per_hour: float, device_type: str):
    row = {k: v for k, v in summary.items() if not isinstance(v, list)}
    create_table_artifact([row], key="corpusgen-run-summary", description="corpusgen run summary")
    create_markdown_artifact(
        cost_report_markdown(summary, usd_per_hour, device_type), key="corpusgen-cost-report"
    )
