"""The report as one self-contained HTML page: plotly charts (hover, zoom, legends) with plotly.js
embedded once, inline CSS, nothing fetched, so the file can be mailed, archived or opened offline.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from html import escape
from pathlib import Path
from string import Template
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs

from reporting.tables import (
    FILTER_COLUMNS,
    MODEL_PAIR_COLUMNS,
    PRICE_COLUMNS,
    REGRESSION_COLUMNS,
    RUN_COLUMNS,
    SHARD_COLUMNS,
    count,
    decimal,
    html_table,
    rate,
    savings_line,
    text,
    times,
    usd,
)

TEMPLATE_PATH = Path(__file__).with_name("dashboard.html")
PALETTE = (
    "#2563eb", "#f59e0b", "#10b981", "#ef4444", "#8b5cf6",
    "#06b6d4", "#ec4899", "#84cc16", "#f97316", "#64748b",
)  # fmt: skip
REGRESSION_COLOR = "#b42318"
POSITION_RUNS = 8  # acceptance-by-position lines: the latest runs, plus all runs together
RUNS_TABLE_ROWS = 60  # the runs table shows the latest runs; the charts show every run
PLOTLY_CONFIG = {"displaylogo": False, "responsive": True}
AXIS = {"gridcolor": "#e4e7eb", "linecolor": "#9aa5b1", "zeroline": False, "automargin": True}
LAYOUT = {
    # an explicit small template: plotly's default one adds ~10 kB of JSON to every chart
    "template": go.layout.Template(layout={"colorway": PALETTE}),
    "height": 340,
    "margin": {"l": 56, "r": 16, "t": 8, "b": 8},
    "font": {"family": "system-ui, 'DejaVu Sans', sans-serif", "size": 12, "color": "#3e4c59"},
    "plot_bgcolor": "white",
    "paper_bgcolor": "white",
    "hovermode": "closest",
    "legend": {"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0},
    "xaxis": AXIS,
    "yaxis": AXIS,
}
MONEY_AXIS = {"tickprefix": "$", "rangemode": "tozero"}
RATE_AXIS = {"tickformat": ".0%", "range": [0, 1.05]}


@dataclass(frozen=True)
class Chart:
    """One dashboard panel: a plotly figure, or the reason there is none."""

    key: str  # the element id of the chart
    title: str
    subtitle: str
    figure: go.Figure | None
    empty: str = "no data"


def _colors(names: list[str]) -> dict[str, str]:
    """A stable colour per name, in order of first appearance."""
    unique = list(dict.fromkeys(names))
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(unique)}


def _grouped(
    rows: list[dict[str, Any]], name: Callable[[dict[str, Any]], str]
) -> dict[str, list[dict[str, Any]]]:
    """Rows by trace name, traces in order of first appearance."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(name(row), []).append(row)
    return groups


def _when(row: dict[str, Any]) -> str:
    """A run's x position on the date axes: its start, in UTC."""
    started = row["started_at"]
    return started.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


# --- trends across runs -------------------------------------------------------------------------


def _trend_figure(
    trends: list[dict[str, Any]], key: str, hover: Callable[[Any], str], axis: dict
) -> go.Figure | None:
    """One line per series (model pair x device type) over run start times; regressions
    flagged on top with a red cross that names what got worse."""
    rows = [row for row in trends if row[key] is not None]
    if not rows:
        return None
    colors = _colors([row["series"] for row in trends])
    figure = go.Figure()
    for series, color in colors.items():
        points = [row for row in rows if row["series"] == series]
        if points:
            figure.add_trace(go.Scatter(
                name=series, x=[_when(p) for p in points], y=[p[key] for p in points],
                mode="lines+markers", line={"color": color, "width": 2}, marker={"size": 5},
                text=[f"{p['run_id']}: {hover(p[key])}" for p in points],
                hovertemplate="%{text}<extra>%{fullData.name}</extra>",
            ))  # fmt: skip
    flagged = [row for row in rows if row["regression"]]
    if flagged:
        figure.add_trace(go.Scatter(
            name="regression", x=[_when(p) for p in flagged], y=[p[key] for p in flagged],
            mode="markers", marker={"symbol": "x", "size": 12, "color": REGRESSION_COLOR},
            text=[f"{p['run_id']} ({p['series']}): {p['regression']}" for p in flagged],
            hovertemplate="%{text}<extra>regression</extra>",
        ))  # fmt: skip
    figure.update_layout(yaxis=axis, xaxis={"type": "date"})
    return figure


def trend_charts(report: dict[str, Any]) -> list[Chart]:
    trends = report["trends"]
    series = "one line per model pair × device type"
    return [
        Chart("cost-trend", "Cost per 1M generated tokens, by run date",
              f"{series}; × = a regression (> 20 % worse than the median of its previous runs)",
              _trend_figure(trends, "cost_per_1m_tokens", usd, MONEY_AXIS)),
        Chart("throughput-trend", "Tokens/s, by run date",
              f"{series}; generated tokens ÷ shard wall seconds (per worker)",
              _trend_figure(trends, "tokens_per_second", decimal, {"rangemode": "tozero"})),
        Chart("acceptance-trend", "Acceptance rate, by run date",
              f"{series}; accepted ÷ proposed draft tokens",
              _trend_figure(trends, "acceptance_rate", rate, RATE_AXIS),
              "no speculative decoding in these runs"),
        Chart("speedup-trend", "Speedup vs plain decoding, by run date",
              f"{series}; estimated plain device-seconds ÷ measured (1× = no gain)",
              _trend_figure(trends, "speedup_vs_plain", times, {"rangemode": "tozero"}),
              "no run has a plain-decoding estimate"),
    ]  # fmt: skip


def savings_chart(report: dict[str, Any]) -> Chart:
    """Dollars saved per run against the estimated cost of decoding it plain."""
    rows = [row for row in report["trends"] if row["cost_saved"] is not None]
    figure = None
    if rows:
        figure = go.Figure()
        colors = _colors([row["series"] for row in report["trends"]])  # as on the trend charts
        for series, points in _grouped(rows, lambda row: row["series"]).items():
            figure.add_trace(go.Bar(
                name=series, x=[_when(p) for p in points], y=[p["cost_saved"] for p in points],
                marker={"color": colors[series]},
                text=[f"{p['run_id']}: saved {usd(p['cost_saved'])} of {usd(p['cost'])} spent "
                      f"({times(p['speedup_vs_plain'])} vs plain)" for p in points],
                textposition="none", hovertemplate="%{text}<extra>%{fullData.name}</extra>",
            ))  # fmt: skip
        figure.update_layout(yaxis={"tickprefix": "$"}, xaxis={"type": "date"}, barmode="group")
    return Chart(
        "savings", "What speculation saved, per run",
        "estimated plain-decoding cost − measured cost; below zero, speculation cost money",
        figure, "no run has a plain-decoding estimate",
    )  # fmt: skip


# --- acceptance and throughput ------------------------------------------------------------------


def acceptance_per_shard_chart(report: dict[str, Any]) -> Chart:
    shards = [shard for shard in report["shards"] if shard["proposed"]]
    figure = None
    if shards:
        figure = go.Figure()
        ordered = sorted(shards, key=lambda s: (s["run_id"], s["shard_id"]))
        by_series = _grouped(ordered, lambda s: f"{s['model_pair']} · {s['device_type']}")
        for series, rows in by_series.items():
            figure.add_trace(go.Box(
                name=series, x=[r["run_id"] for r in rows], y=[r["acceptance_rate"] for r in rows],
                text=[r["shard_id"] for r in rows], boxpoints="outliers",
            ))  # fmt: skip
        figure.update_layout(yaxis=RATE_AXIS, boxmode="group", xaxis={"type": "category"})
    return Chart(
        "shard-acceptance", "Acceptance rate per shard, by run",
        "accepted ÷ proposed per shard: the spread within each run, per model pair × device",
        figure, "no speculative decoding in these runs",
    )  # fmt: skip


def position_curve_chart(report: dict[str, Any]) -> Chart:
    rows = report["position_acceptance"]
    run_order = [run["run_id"] for run in report["runs"]]
    drafted = {row["run_id"] for row in rows if row["level"] == "run"}
    latest = [run_id for run_id in run_order if run_id in drafted][-POSITION_RUNS:]
    figure = None
    if rows:
        figure = go.Figure()
        for run_id in [*latest, None]:
            points = [r for r in rows if r["run_id"] == run_id]
            figure.add_trace(go.Scatter(
                name=run_id or "all runs", x=[f"token {p['position'] + 1}" for p in points],
                y=[p["acceptance_rate"] for p in points], mode="lines+markers",
                line={"width": 3, "dash": "dash", "color": "#0f172a"} if run_id is None else {},
                hovertemplate="%{x}: %{y:.1%}<extra>%{fullData.name}</extra>",
            ))  # fmt: skip
        figure.update_layout(yaxis=RATE_AXIS)
    return Chart(
        "position-acceptance", "Acceptance by draft position",
        f"accepted ÷ proposed at the i-th drafted token of a round; the latest {POSITION_RUNS} "
        "drafted runs and all runs together",
        figure, "no speculative decoding in these runs",
    )  # fmt: skip


def throughput_by_bucket_chart(report: dict[str, Any]) -> Chart:
    rows = report["bucket_throughput"]
    figure = go.Figure()
    for name, points in _grouped(rows, lambda r: f"{r['device_type']} · {r['draft_kind']}").items():
        figure.add_trace(go.Bar(
            name=name, x=[f"batch {p['batch_bucket']}" for p in points],
            y=[p["tokens_per_second"] for p in points],
            text=[f"{decimal(p['tokens_per_second'])} tok/s over {count(p['shards'])} shards"
                  for p in points],
            textposition="none", hovertemplate="%{x}: %{text}<extra>%{fullData.name}</extra>",
        ))  # fmt: skip
    figure.update_layout(barmode="group", xaxis={"type": "category"})
    return Chart(
        "bucket-throughput", "Tokens/s by batch bucket",
        "generated tokens ÷ shard wall seconds (per worker), by the largest batch bucket used",
        figure,
    )


def charts(report: dict[str, Any]) -> list[Chart]:
    """Every chart of the dashboard, in page order."""
    return [
        *trend_charts(report),
        savings_chart(report),
        acceptance_per_shard_chart(report),
        position_curve_chart(report),
        throughput_by_bucket_chart(report),
    ]


# --- the page -----------------------------------------------------------------------------------


def _panel(title: str, subtitle: str, content: str) -> str:
    return (
        f'<section class="panel"><h2>{escape(title)}</h2>'
        f'<p class="sub">{escape(subtitle)}</p>{content}</section>'
    )


def _chart_html(chart: Chart) -> str:
    if chart.figure is None:
        body = f'<p class="empty" id="{chart.key}">{escape(chart.empty)}</p>'
    else:
        chart.figure.update_layout(LAYOUT)
        body = pio.to_html(chart.figure, full_html=False, include_plotlyjs=False,
                           div_id=chart.key, config=PLOTLY_CONFIG)  # fmt: skip
    return _panel(chart.title, chart.subtitle, f'<div class="chart">{body}</div>')


def _kpis(report: dict[str, Any]) -> str:
    total = report["total"]
    estimated = f"{total['estimated_shards']} of {total['shards']} shards estimated"
    cards = [
        ("Generated tokens", count(total["generated_tokens"]), f"{total['shards']} shards"),
        ("Cost", usd(total["cost"]), f"{decimal(total['device_seconds'])} device-seconds"),
        ("Engine load", usd(total["engine_load_cost"]),
         f"{decimal(total['engine_load_seconds'])} s load + warm-up, apart from cost"),
        ("Total cost", usd(total["total_cost"]), "cost + engine load"),
        ("Cost / 1M tokens", usd(total["total_cost_per_1m_tokens"]),
         f"engine load included, as in the run summary; "
         f"{usd(total['cost_per_1m_tokens'])} without it"),
        ("Saved by speculation", usd(total["cost_saved"]), estimated),
        ("Speedup vs plain", times(total["speedup_vs_plain"]), "estimated device-seconds"),
        ("Tokens / s", decimal(total["tokens_per_second"]), "per worker"),
        ("Acceptance", rate(total["acceptance_rate"]), "accepted ÷ proposed"),
        ("Regressions", count(len(report["regressions"])), "runs > 20 % worse than before"),
        ("Error rows", count(total["error_rows"]), f"of {count(total['input_rows'])} input rows"),
    ]
    return "".join(
        f'<div class="kpi"><div class="label">{escape(label)}</div>'
        f'<div class="value">{escape(value)}</div><div class="note">{escape(note)}</div></div>'
        for label, value, note in cards
    )


def _tables(report: dict[str, Any]) -> list[str]:
    runs = report["runs"][-RUNS_TABLE_ROWS:][::-1]
    regressions = report["regressions"][::-1]
    filtered = [run for run in runs if run["kept_rows"] is not None]
    return [
        _panel("Regressions", "runs more than 20 % worse than the median of the previous (up to) "
               "7 runs of the same model pair × device type, newest first",
               html_table(regressions, REGRESSION_COLUMNS) if regressions
               else '<p class="empty">none</p>'),
        _panel("Runs", f"the latest {len(runs)} of {len(report['runs'])} runs, newest first, "
               "at the report's prices", html_table(runs, RUN_COLUMNS)),
        *([_panel("Filters", "what each filtered run's rules kept and dropped, of the records "
                  "it generated, newest first", html_table(filtered, FILTER_COLUMNS))]
          if filtered else []),
        _panel("Model pairs", "target × draft × device, all runs, cheapest per token first",
               html_table(report["model_pairs"], MODEL_PAIR_COLUMNS)),
        _panel("Costliest shards", f"top {len(report['costliest_shards'])} by cost",
               html_table(report["costliest_shards"], SHARD_COLUMNS)),
        _panel("Prices used", "$ per device-hour behind every cost above",
               html_table(report["prices"], PRICE_COLUMNS)),
    ]  # fmt: skip


@cache
def _plotly_js() -> str:
    """plotly.js (minified, ~4.8 MB), embedded once so nothing is fetched."""
    return get_plotlyjs()


def render_dashboard(report: dict[str, Any], source: str) -> str:
    """The whole page for a `build_report` result read from `source`."""
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    runs = report["runs"]
    subtitle = (
        f"{source} · {len(runs)} run(s) from {text(runs[0]['run_date'])} to "
        f"{text(runs[-1]['run_date'])} · committed shards only · generated {now}"
    )
    return Template(TEMPLATE_PATH.read_text()).substitute(
        title="corpusgen · cost per token, trends & what speculation saved",
        subtitle=escape(subtitle),
        plotly_js=_plotly_js(),
        kpis=_kpis(report),
        savings=escape(savings_line(report["total"])),
        charts="".join(_chart_html(chart) for chart in charts(report)),
        tables="".join(_tables(report)),
        footer=escape(
            "Figures come from the DuckDB views in schemas/metrics_views.sql over the committed "
            "metrics; ratios are ratios of sums. Plain-decoding figures are estimates: measured "
            "[b, 1] step times × the plain steps each speculative round replaced. "
            "Charts: plotly.js, embedded."
        ),
    )
