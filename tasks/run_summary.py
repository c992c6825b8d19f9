"""The flow's last reporting step: read the run's committed metrics, summarise them
(reporting/summary.py) and publish the summary as Prefect artifacts."""

from __future__ import annotations

from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from reporting.summary import cost_report_markdown, run_summary, summary_figures
from schemas.arrow import METRICS_SCHEMA
from tasks.commit import read_published
from tasks.layout import RunLayout
from tasks.planning import Plan


def summarize_run(
    layout: RunLayout, output: str, plan: Plan, unscheduled: int, failed: list[str],
    filtered: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`filtered`: the run's filter log entry, when its filters were applied."""
    metrics = read_published(layout, "metrics", METRICS_SCHEMA)
    return run_summary(metrics, layout.run_id, layout.run_date, output, len(plan.shards),
                       unscheduled, failed, filtered)


def publish_summary_artifacts(summary: dict[str, Any], usd_per_hour: float, device_type: str):
    create_table_artifact(
        [{"figure": name, "value": value} for name, value in summary_figures(summary)],
        key="corpusgen-run-summary", description=f"corpusgen run {summary['run_id']}",
    )
    create_markdown_artifact(
        cost_report_markdown(summary, usd_per_hour, device_type), key="corpusgen-cost-report"
    )
