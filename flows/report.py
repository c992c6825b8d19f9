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

from reporting.dashboard import render_dashboard
from reporting.metrics import (
    NoMetricsError,
    build_report,
    has_filter_log,
    normalize_uri,
    open_committed_metrics,
    read_plans,
    report_rows,
    views_sql,
)
from reporting.tables import print_report
from schemas.pricing import UnknownDeviceError, parse_price_overrides
from schemas.run import StorageSpec
from tasks.storage import filesystem


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
    try:
        options = _parse_storage_options(storage_option or [])
        fs, _ = filesystem(output_uri, StorageSpec(endpoint_url=endpoint_url), **options)
        if views:
            typer.echo(views_sql(output_uri, has_filter_log(fs, normalize_uri(output_uri))))
            return
        con = open_committed_metrics(
            output_uri,
            fs,
            run_ids=run,
            since=since.date() if since else None,
            price_overrides=parse_price_overrides(price or []),
        )
    except (NoMetricsError, UnknownDeviceError, ValueError) as exc:
        typer.secho(f"error: {exc}", err=True, fg="red")
        raise typer.Exit(2) from None
    result = build_report(con, read_plans(fs, normalize_uri(output_uri)))
    if output_format is ReportFormat.json:
        typer.echo(json.dumps({"source": output_uri, **result}, default=_jsonable, indent=2))
    elif output_format is ReportFormat.csv:
        rows = report_rows(con)
        writer = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    else:
        print_report(result)
    if html is not None:
        html.write_text(render_dashboard(result, output_uri))
        typer.secho(f"dashboard written to {html}", err=True)
