"""`corpusgen report`: cost per token and acceptance over the committed metrics of an output."""

from __future__ import annotations

import csv
import datetime as dt
import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from schemas.pricing import UnknownDeviceError, parse_price_overrides
from schemas.run import StorageSpec
from tasks.dashboard import (
    MODEL_PAIR_COLUMNS,
    PRICE_COLUMNS,
    RUN_COLUMNS,
    SHARD_COLUMNS,
    TEXT_FORMATS,
    Column,
    count,
    decimal,
    rate,
    render_dashboard,
    text,
    usd,
)
from tasks.reporting import (
    NoMetricsError,
    build_report,
    open_committed_metrics,
    report_rows,
    views_sql,
)
from tasks.storage import storage_options


class ReportFormat(StrEnum):
    table = "table"
    json = "json"
    csv = "csv"


def _jsonable(value: Any) -> Any:
    if isinstance(value, dt.date | dt.datetime):
        return value.isoformat()
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def _parse_storage_options(items: list[str]) -> dict[str, Any]:
    """`k=v` items; values are JSON when they parse (true, 3), else strings."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option {item!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def _rich_table(title: str, rows: list[dict[str, Any]], columns: list[Column]) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold")
    for _, header, fmt in columns:
        table.add_column(header, justify="left" if fmt in TEXT_FORMATS else "right")
    for row in rows:
        table.add_row(*(fmt(row.get(key)) for key, _, fmt in columns))
    return table


def _position_table(rows: list[dict[str, Any]]) -> Table:
    """Runs down, draft positions across: where in a draft acceptance falls off."""
    positions = sorted({row["position"] for row in rows})
    table = Table(title="Acceptance by draft position", title_justify="left", title_style="bold")
    table.add_column("run")
    for position in positions:
        table.add_column(f"token {position + 1}", justify="right")
    by_run: dict[str, dict[int, float | None]] = {}
    for row in rows:
        by_run.setdefault(row["run_id"] or "all runs", {})[row["position"]] = row["acceptance_rate"]
    for run_id, rates in by_run.items():
        table.add_row(run_id, *(rate(rates.get(position)) for position in positions))
    return table


ERROR_REASON_COLUMNS: list[Column] = [
    ("run_id", "run", text), ("reason", "reason", text), ("rows", "rows", count),
]


def _bucket_columns() -> list[Column]:
    return [
        ("device_type", "device", text), ("draft_kind", "draft kind", text),
        ("batch_bucket", "batch bucket", count), ("shards", "shards", count),
        ("tokens_per_second", "tok/s", decimal),
    ]  # fmt: skip


def _print_tables(report: dict[str, Any]) -> None:
    console = Console(width=max(Console().width, 160))
    total = report["total"]
    console.print(
        f"[bold]{total['shards']} committed shards[/], {total['generated_tokens']:,} tokens, "
        f"{total['error_rows']:,} error rows, {total['empty_completions'] or 0:,} empty "
        f"completions, acceptance {rate(total['acceptance_rate'])}\n"
        f"generation cost {usd(total['cost'])} + engine load {usd(total['engine_load_cost'])} "
        f"({decimal(total['engine_load_seconds'])} s) = total {usd(total['total_cost'])}, "
        f"{usd(total['total_cost_per_1m_tokens'])} per 1M tokens",
        soft_wrap=True,
    )
    console.print(_rich_table("Prices used ($ per device-hour)", report["prices"], PRICE_COLUMNS))
    console.print(_rich_table("Runs", report["runs"], RUN_COLUMNS))
    console.print(_rich_table("Model pairs", report["model_pairs"], MODEL_PAIR_COLUMNS))
    if report["position_acceptance"]:
        console.print(_position_table(report["position_acceptance"]))
    console.print(_rich_table("Tokens/s by batch bucket", report["bucket_throughput"],
                              _bucket_columns()))  # fmt: skip
    console.print(_rich_table("Costliest shards", report["costliest_shards"], SHARD_COLUMNS))
    reasons = [row for row in report["error_reasons"] if row["level"] == "run"]
    if reasons:
        console.print(_rich_table("Error rows by reason", reasons, ERROR_REASON_COLUMNS))


def report(
    output_uri: Annotated[
        str, typer.Argument(help="output root of the pipeline: a local path or s3://bucket/prefix")
    ],
    run: Annotated[
        list[str] | None, typer.Option("--run", help="only this run id (repeatable)")
    ] = None,
    since: Annotated[
        dt.datetime | None,
        typer.Option(formats=["%Y-%m-%d"], help="only runs dated on or after this day"),
    ] = None,
    output_format: Annotated[ReportFormat, typer.Option("--format")] = ReportFormat.table,
    html: Annotated[
        Path | None, typer.Option("--html", help="also write a self-contained HTML dashboard")
    ] = None,
    price: Annotated[
        list[str] | None,
        typer.Option("--price", help="DEVICE=USD_PER_HOUR: recompute cost at this price"),
    ] = None,
    endpoint_url: Annotated[
        str | None,
        typer.Option(help="S3-compatible endpoint; keys from AWS_ACCESS_KEY_ID/_SECRET_ACCESS_KEY"),
    ] = None,
    storage_option: Annotated[
        list[str] | None, typer.Option("--storage-option", help="extra fsspec option KEY=VALUE")
    ] = None,
    views: Annotated[
        bool, typer.Option("--views", help="print the DuckDB views for a BI tool and exit")
    ] = False,
) -> None:
    """Cost per 1M tokens, throughput and acceptance over the committed shards of OUTPUT_URI."""
    if views:
        typer.echo(views_sql(output_uri))
        return
    try:
        options = storage_options(output_uri, StorageSpec(endpoint_url=endpoint_url))
        options |= _parse_storage_options(storage_option or [])
        con = open_committed_metrics(
            output_uri,
            storage_options=options,
            run_ids=run,
            since=since.date() if since else None,
            price_overrides=parse_price_overrides(price or []),
        )
    except (NoMetricsError, UnknownDeviceError, ValueError) as exc:
        typer.secho(f"error: {exc}", err=True, fg="red")
        raise typer.Exit(2) from None
    result = build_report(con)
    if output_format is ReportFormat.json:
        typer.echo(json.dumps({"source": output_uri, **result}, default=_jsonable, indent=2))
    elif output_format is ReportFormat.csv:
        rows = report_rows(con)
        writer = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    else:
        _print_tables(result)
    if html is not None:
        html.write_text(render_dashboard(result, output_uri))
        typer.secho(f"dashboard written to {html}", err=True)
