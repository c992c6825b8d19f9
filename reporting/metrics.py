"""Cost-per-token and acceptance figures from the committed metrics dataset.

Every figure comes from the DuckDB views in `schemas/metrics_views.sql`, the same SQL a BI tool
points at, so the CLI report, the HTML dashboard, the flow's summary artifact and a Grafana panel
cannot disagree. Ratios are always ratios of sums over shards.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path
from typing import Any

import duckdb
import fsspec
import pyarrow as pa
from fsspec import AbstractFileSystem

import schemas
from schemas.arrow import METRICS_SCHEMA
from schemas.pricing import OVERRIDE_SOURCE, load_prices

VIEWS_PATH = Path(schemas.__file__).with_name("metrics_views.sql")
COSTLIEST_SHARDS = 10
QUALITY_GUARDS = ("error", "empty", "looping")  # max_<guard>_fraction, in guard_fractions' order
GUARD_DEFAULT = 0.5  # a plan written before a guard existed: that guard's default
RECORDED_SOURCE = "recorded in the metrics at run time"


class NoMetricsError(ValueError):
    """Nothing committed (or nothing left after filtering) to report on."""


def normalize_uri(output_uri: str) -> str:
    """One spelling per location, so manifest paths and listed files compare equal."""
    if "://" in output_uri:
        return output_uri.rstrip("/")
    return str(Path(output_uri).expanduser().resolve())


def views_sql(output_uri: str, with_filters: bool = False) -> str:
    """The view definitions with the output location filled in (ready for a BI tool); the
    filters section only `with_filters` (DuckDB fails reading a filter log that is not there)."""
    quoted = normalize_uri(output_uri).replace("'", "''")
    sql = VIEWS_PATH.read_text().replace("{output_uri}", quoted)
    return sql if with_filters else sql.replace(_section(sql, "filters"), "")


def has_filter_log(fs: AbstractFileSystem, root: str) -> bool:
    """Whether a run's filters were applied in this output (filtering.py's log)."""
    return bool(fs.glob(f"{root}/filter_log/*.json"))


def _section(sql: str, name: str) -> str:
    """One `-- @section NAME` block of the views file."""
    match = re.search(rf"^-- @section {name}\n(.*?)(?=^-- @section |\Z)", sql, re.M | re.S)
    if match is None:
        raise RuntimeError(f"{VIEWS_PATH} lacks the '-- @section {name}' block")
    return match.group(1)


def _connect() -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    return con


def _define_derived_views(con: duckdb.DuckDBPyConnection, price_overrides: dict[str, float]):
    con.execute(_section(VIEWS_PATH.read_text(), "derived"))
    for device_type, usd in price_overrides.items():
        con.execute("INSERT INTO price_overrides VALUES (?, ?)", [device_type, usd])


def _validated_overrides(price_overrides: dict[str, float] | None) -> dict[str, float]:
    """Fail on device types the price table does not know (likely typos)."""
    if price_overrides:
        load_prices(overrides=price_overrides)
    return dict(price_overrides or {})


def open_committed_metrics(
    output_uri: str,
    fs: AbstractFileSystem | None = None,
    run_ids: list[str] | None = None,
    since: dt.date | None = None,
    price_overrides: dict[str, float] | None = None,
) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the report views over the committed shards of `output_uri`,
    read through `fs` (tasks.storage.filesystem opens one for s3://; local by default)."""
    overrides = _validated_overrides(price_overrides)
    root = normalize_uri(output_uri)
    fs = fs or fsspec.filesystem("file")
    if not fs.glob(f"{root}/manifests/*.json"):
        raise NoMetricsError(
            f"no committed shards under {root}/manifests/ (a shard is committed when "
            "manifests/<run_id>.<shard_id>.json exists); check OUTPUT_URI and that a run "
            "finished a shard"
        )
    con = _connect()
    if "://" in root:
        con.register_filesystem(fs)
    con.execute(_section(views_sql(root), "source"))
    if has_filter_log(fs, root):
        con.execute(_section(views_sql(root, with_filters=True), "filters"))
    _narrow_metrics(con, run_ids, since)
    _define_derived_views(con, overrides)
    return con


def _narrow_metrics(
    con: duckdb.DuckDBPyConnection, run_ids: list[str] | None, since: dt.date | None
) -> None:
    """Snapshot the runs/dates asked for into `metrics`; fail if that leaves nothing.

    A table, not a view: every section then sees the same shards even while a run commits more,
    and remote files are read once. Outputs written before a column was added get it as null.
    """
    con.execute(
        "CREATE TABLE report_filter AS SELECT ?::VARCHAR[] AS run_ids, ?::DATE AS since",
        [list(run_ids) if run_ids else None, since],
    )
    con.register("metrics_schema", METRICS_SCHEMA.empty_table())
    con.execute(  # BY NAME with the empty schema: columns added since a file was written are null
        """DROP VIEW metrics;
        CREATE TABLE metrics AS
        SELECT m.* FROM committed_metrics AS m, report_filter AS f
        WHERE (f.run_ids IS NULL OR list_contains(f.run_ids, m.run_id))
          AND (f.since IS NULL OR m.run_date >= f.since)
        UNION ALL BY NAME SELECT * FROM metrics_schema"""
    )
    _add_missing_columns(con)
    if not con.execute("SELECT count(*) FROM metrics").fetchone()[0]:
        runs = con.execute("SELECT DISTINCT run_id FROM committed_metrics ORDER BY 1").fetchall()
        raise NoMetricsError(
            f"no committed metrics match --run {run_ids or 'any'} --since {since or 'any'}; "
            f"runs available: {', '.join(r for (r,) in runs) or 'none'}"
        )


def _add_missing_columns(con: duckdb.DuckDBPyConnection) -> None:
    """Columns the schema gained after older shards were written read as nulls there."""
    con.register("metrics_template", METRICS_SCHEMA.empty_table())
    wanted = con.execute("SELECT column_name, column_type FROM (DESCRIBE metrics_template)")
    wanted = wanted.fetchall()
    present = {name for (name, *_) in con.execute("DESCRIBE metrics").fetchall()}
    for name, column_type in wanted:
        if name not in present:
            con.execute(f'ALTER TABLE metrics ADD COLUMN "{name}" {column_type}')
    con.unregister("metrics_template")


def _records(con: duckdb.DuckDBPyConnection, query: str) -> list[dict[str, Any]]:
    cursor = con.execute(query)
    names = [column[0] for column in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def _prices_used(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """Per device type: the $/device-hour the report's costs use, and where it came from."""
    rows = _records(
        con,
        """SELECT device_type, bool_or(repriced) AS repriced,
                  list(DISTINCT report_price_per_device_hour ORDER BY report_price_per_device_hour)
                      AS usd_per_hour
           FROM shard_costs GROUP BY device_type ORDER BY device_type""",
    )
    return [
        {
            "device_type": row["device_type"],
            "usd_per_hour": row["usd_per_hour"],
            "source": OVERRIDE_SOURCE if row["repriced"] else RECORDED_SOURCE,
        }
        for row in rows
    ]


def guard_fractions(
    ok: int, errors: int, empty: int, looping: int
) -> tuple[float | None, float | None, float | None]:
    """The fractions a run's quality guards hold against max_error_fraction (error rows of
    all rows), max_empty_fraction (blank completions of ok rows) and max_looping_fraction
    (completions of ok rows that end in a loop); None when undefined."""
    return (errors / (ok + errors) if ok + errors else None, empty / ok if ok else None,
            looping / ok if ok else None)


def run_status(run: dict[str, Any], plan: dict[str, Any] | None) -> str:
    """ok | failed_quality_guard | incomplete (fewer shards committed than planned)."""
    if plan is None or run["shards"] < plan["shards_planned"]:
        return "incomplete"
    fractions = guard_fractions(run["ok_rows"] or 0, run["error_rows"] or 0,
                                run["empty_completions"] or 0, run["looping_completions"] or 0)
    limits = (plan[f"max_{guard}_fraction"] for guard in QUALITY_GUARDS)
    if any((fraction or 0) > limit for fraction, limit in zip(fractions, limits, strict=True)):
        return "failed_quality_guard"
    return "ok"


def read_plans(fs, root: str) -> dict[str, dict[str, Any]]:
    """run id -> shards planned and quality guards, from each run's plan.json."""
    paths = fs.glob(f"{root}/plan/run_date=*/run_id=*/plan.json")
    plans = {}
    for content in (fs.cat(paths) if paths else {}).values():
        plan = json.loads(content)
        plans[plan["run_id"]] = {
            "shards_planned": len(plan["shards"]),
            **{f"max_{guard}_fraction": plan.get(f"max_{guard}_fraction", GUARD_DEFAULT)
               for guard in QUALITY_GUARDS},
        }
    return plans


def build_report(
    con: duckdb.DuckDBPyConnection, plans: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Every section of the report, as plain rows (what `--format json` prints); with the
    runs' plans, each run gets its status and shards planned."""
    total = _records(con, "SELECT * FROM cost_rollup WHERE level = 'total'")[0]
    shards = _records(con, "SELECT * FROM costliest_shards")
    trends = _records(con, "SELECT * FROM run_trends")
    runs = _records(con, "SELECT * FROM run_summary")
    if plans is not None:
        for run in runs:
            plan = plans.get(run["run_id"])
            run["shards_planned"] = plan["shards_planned"] if plan else None
            run["status"] = run_status(run, plan)
    return {
        "prices": _prices_used(con),
        "total": {k: v for k, v in total.items() if k not in _GROUP_COLUMNS},
        "runs": runs,
        "model_pairs": _records(con, "SELECT * FROM model_pair_summary"),
        "position_acceptance": _records(con, "SELECT * FROM position_acceptance"),
        "bucket_throughput": _records(con, "SELECT * FROM bucket_throughput"),
        "error_reasons": _records(con, "SELECT * FROM error_reasons"),
        "trends": trends,
        "regressions": [row for row in trends if row["regression"]],
        "costliest_shards": shards[:COSTLIEST_SHARDS],
        "shards": sorted(shards, key=lambda s: (s["run_id"], s["shard_id"])),
    }


_GROUP_COLUMNS = {"level", "run_id", "target_model", "draft_model", "draft_kind", "device_type"}


def report_rows(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """The flat run / model-pair / total rollup (what `--format csv` prints)."""
    return _records(
        con,
        (
            "SELECT * FROM rollup_with_filters ORDER BY "
            "list_position(['run', 'model_pair', 'total'], level), started_at, cost_per_1m_tokens"
        ),
    )


def summarize_metrics(
    table: pa.Table, price_overrides: dict[str, float] | None = None
) -> dict[str, Any]:
    """The report over in-memory metrics rows (e.g. one run's shards, for its summary artifact).

    Uses the same views as `corpusgen report`, so the artifact shows the report's numbers.
    The run date is the UTC date the shard started (the report reads it from the partition).
    """
    overrides = _validated_overrides(price_overrides)
    metrics_input = table.select(METRICS_SCHEMA.names).cast(METRICS_SCHEMA)
    if not metrics_input.num_rows:
        raise NoMetricsError("summarize_metrics: the metrics table has no rows")
    con = _connect()
    con.register("metrics_input", metrics_input)
    con.execute(
        "CREATE VIEW metrics AS SELECT *, "
        "CAST(started_at AT TIME ZONE 'UTC' AS DATE) AS run_date FROM metrics_input"
    )
    _define_derived_views(con, overrides)
    return build_report(con)
