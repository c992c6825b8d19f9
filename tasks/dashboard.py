"""The report as a self-contained HTML dashboard: inline CSS and SVG charts drawn here, no
scripts and nothing fetched, so the file can be mailed, archived or opened offline.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path
from string import Template
from typing import Any

TEMPLATE_PATH = Path(__file__).with_name("dashboard.html")
PALETTE = (
    "#2563eb", "#f59e0b", "#10b981", "#ef4444", "#8b5cf6",
    "#06b6d4", "#ec4899", "#84cc16", "#f97316", "#64748b",
)  # fmt: skip
WIDTH, HEIGHT = 640, 300
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 60, 16, 22, 36
PLOT_W = WIDTH - MARGIN_LEFT - MARGIN_RIGHT
PLOT_H = HEIGHT - MARGIN_TOP - MARGIN_BOTTOM


# --- number formatting --------------------------------------------------------------------------


def usd(value: float | None) -> str:
    if value is None:
        return "–"
    if abs(value) >= 100:
        return f"${value:,.0f}"
    if abs(value) >= 0.1:
        return f"${value:,.2f}"
    return f"${value:.3g}"


def count(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def rate(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def decimal(value: float | None) -> str:
    return "–" if value is None else f"{value:,.2f}" if abs(value) < 1000 else f"{value:,.0f}"


def model(value: str | None) -> str:
    """A model by its file name: paths are long and the same folder repeats."""
    return "–" if not value else value.rstrip("/").rsplit("/", 1)[-1]


def text(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, list):
        return ", ".join(text(v) for v in value)
    if isinstance(value, dt.datetime):
        return value.strftime("%Y-%m-%d %H:%M UTC")
    return str(value)


# --- SVG charts ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bar:
    value: float | None
    color: str
    tooltip: str


def _nice_ticks(top: float, wanted: int = 5) -> list[float]:
    """Round tick values from 0 to at least `top`."""
    if top <= 0 or not math.isfinite(top):
        top = 1.0
    raw = top / wanted
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    return [i * step for i in range(math.ceil(top / step - 1e-9) + 1)]


def _y(value: float, top: float) -> float:
    return MARGIN_TOP + PLOT_H * (1 - value / top)


def _svg(label: str, body: list[str]) -> str:
    return (
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(label)}" xmlns="http://www.w3.org/2000/svg">{"".join(body)}</svg>'
    )


def _tick(value: float, fmt: Callable[[float], str]) -> str:
    """Axis labels: percentages without decimals, plain numbers without trailing zeros."""
    if fmt is rate:
        return f"{value:.0%}"
    if fmt is decimal:
        return f"{value:,.0f}" if value == int(value) else f"{value:g}"
    return fmt(value)


def _axes(top: float, ticks: list[float], fmt: Callable[[float], str]) -> list[str]:
    parts = []
    for tick in ticks:
        y = _y(tick, top)
        parts.append(
            f'<line class="grid" x1="{MARGIN_LEFT}" x2="{WIDTH - MARGIN_RIGHT}" '
            f'y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text x="{MARGIN_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{escape(_tick(tick, fmt))}</text>"
        )
    base = _y(0, top)
    parts.append(
        f'<line class="axis" x1="{MARGIN_LEFT}" x2="{WIDTH - MARGIN_RIGHT}" '
        f'y1="{base:.1f}" y2="{base:.1f}"/>'
    )
    return parts


def _empty(label: str, message: str) -> str:
    return _svg(
        label,
        [
            f'<text class="empty" x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">'
            f"{escape(message)}</text>"
        ],
    )


def _short(label: str, limit: int = 16) -> str:
    return label if len(label) <= limit else label[: limit - 1] + "…"


def bar_chart(
    label: str,
    groups: Sequence[tuple[str, Sequence[Bar]]],
    fmt: Callable[[float], str],
    top: float | None = None,
    empty: str = "no data",
) -> str:
    """Bars side by side within each labelled group; a bar with value None is left out."""
    values = [bar.value for _, bars in groups for bar in bars if bar.value is not None]
    if not values:
        return _empty(label, empty)
    ticks = _nice_ticks(top if top is not None else max(values))
    top = ticks[-1]
    body = _axes(top, ticks, fmt)
    group_w = PLOT_W / len(groups)
    for index, (group_label, bars) in enumerate(groups):
        x0 = MARGIN_LEFT + index * group_w
        inner = group_w * 0.8
        bar_w = inner / max(len(bars), 1)
        for j, bar in enumerate(bars):
            if bar.value is None:
                continue
            x = x0 + group_w * 0.1 + j * bar_w
            y = _y(bar.value, top)
            h = _y(0, top) - y
            body.append(
                f'<rect x="{x + bar_w * 0.06:.1f}" y="{y:.1f}" width="{max(bar_w * 0.88, 1):.1f}" '
                f'height="{max(h, 0.5):.1f}" rx="2" fill="{bar.color}">'
                f"<title>{escape(bar.tooltip)}</title></rect>"
            )
            if bar_w >= 34:
                body.append(
                    f'<text class="value-label" x="{x + bar_w / 2:.1f}" y="{y - 4:.1f}" '
                    f'text-anchor="middle">{escape(fmt(bar.value))}</text>'
                )
        body.append(
            f'<text x="{x0 + group_w / 2:.1f}" y="{HEIGHT - MARGIN_BOTTOM + 16}" '
            f'text-anchor="middle"><title>{escape(group_label)}</title>'
            f"{escape(_short(group_label, max(int(group_w / 6.5), 4)))}</text>"
        )
    return _svg(label, body)


@dataclass(frozen=True)
class Line:
    name: str
    color: str
    points: Sequence[tuple[float, float | None]]
    width: float = 2.0
    dashed: bool = False


def line_chart(
    label: str,
    lines: Sequence[Line],
    x_label: Callable[[float], str],
    fmt: Callable[[float], str],
    top: float,
    empty: str = "no data",
) -> str:
    """Lines over a shared numeric x axis, with dots on the points."""
    xs = sorted({x for line in lines for x, y in line.points if y is not None})
    if not xs:
        return _empty(label, empty)
    ticks = _nice_ticks(top)
    top = ticks[-1]
    body = _axes(top, ticks, fmt)
    span = (xs[-1] - xs[0]) or 1

    def px(x: float) -> float:
        inset = 24
        return MARGIN_LEFT + inset + (PLOT_W - 2 * inset) * (x - xs[0]) / span

    for x in xs:
        body.append(
            f'<text x="{px(x):.1f}" y="{HEIGHT - MARGIN_BOTTOM + 16}" '
            f'text-anchor="middle">{escape(x_label(x))}</text>'
        )
    for line in lines:
        points = [(px(x), _y(y, top), x, y) for x, y in line.points if y is not None]
        if not points:
            continue
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _, _ in points)
        dash = ' stroke-dasharray="6 4"' if line.dashed else ""
        body.append(
            f'<polyline points="{path}" fill="none" stroke="{line.color}" '
            f'stroke-width="{line.width}" stroke-linejoin="round"{dash}/>'
        )
        for x, y, raw_x, raw_y in points:
            body.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{line.width + 1.5}" fill="{line.color}">'
                f"<title>{escape(f'{line.name}, {x_label(raw_x)}: {fmt(raw_y)}')}</title></circle>"
            )
    return _svg(label, body)


def legend(entries: dict[str, str]) -> str:
    return (
        '<div class="legend">'
        + "".join(
            f'<span style="--swatch:{color}">{escape(name)}</span>'
            for name, color in entries.items()
        )
        + "</div>"
    )


def _colors(names: Sequence[str]) -> dict[str, str]:
    """A stable colour per name, in order of first appearance."""
    unique = list(dict.fromkeys(names))
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(unique)}


# --- the dashboard's panels ---------------------------------------------------------------------


def _panel(title: str, subtitle: str, content: str) -> str:
    return (
        f'<section class="panel"><h2>{escape(title)}</h2>'
        f'<p class="sub">{escape(subtitle)}</p>{content}</section>'
    )


def cost_per_run_chart(report: dict[str, Any]) -> str:
    runs = report["runs"]
    colors = _colors([run["device_types"] for run in runs])
    groups = [
        (
            run["run_id"],
            [
                Bar(
                    run["cost_per_1m_tokens"],
                    colors[run["device_types"]],
                    f"{run['run_id']} ({run['device_types']}, {run['draft_kinds']}): "
                    f"{usd(run['cost_per_1m_tokens'])} per 1M tokens, {usd(run['cost'])} total",
                )
            ],
        )
        for run in runs
    ]
    chart = bar_chart("cost per 1M generated tokens by run", groups, usd)
    return _panel(
        "Cost per 1M generated tokens, by run",
        "device-seconds × $/device-hour ÷ generated tokens; colour = device type",
        legend(colors) + chart,
    )


def acceptance_per_shard_chart(report: dict[str, Any]) -> str:
    shards = [shard for shard in report["shards"] if shard["proposed"]]
    colors = _colors([shard["draft_kind"] for shard in shards])
    by_run: dict[str, list[Bar]] = {}
    for shard in shards:
        by_run.setdefault(shard["run_id"], []).append(
            Bar(
                shard["acceptance_rate"],
                colors[shard["draft_kind"]],
                f"{shard['shard_id']} ({shard['draft_kind']}): {rate(shard['acceptance_rate'])}",
            )
        )
    chart = bar_chart(
        "acceptance rate per shard",
        list(by_run.items()),
        rate,
        top=1.0,
        empty="no speculative decoding in these runs",
    )
    return _panel(
        "Acceptance rate per shard",
        "accepted ÷ proposed draft tokens, one bar per shard, grouped by run; colour = draft kind",
        legend(colors) + chart,
    )


def position_curve_chart(report: dict[str, Any]) -> str:
    rows = report["position_acceptance"]
    run_ids = [row["run_id"] for row in rows if row["level"] == "run"]
    colors = _colors(run_ids)
    lines = [
        Line(
            run_id,
            color,
            [(r["position"], r["acceptance_rate"]) for r in rows if r["run_id"] == run_id],
        )
        for run_id, color in colors.items()
    ]
    total = [(r["position"], r["acceptance_rate"]) for r in rows if r["level"] == "total"]
    lines.append(Line("all runs", "#0f172a", total, width=3.0, dashed=True))
    chart = line_chart(
        "acceptance by draft position",
        lines,
        lambda x: f"token {int(x) + 1}",
        rate,
        top=1.0,
        empty="no speculative decoding in these runs",
    )
    return _panel(
        "Acceptance by draft position",
        "accepted ÷ proposed at the i-th drafted token of a round",
        legend({**colors, "all runs": "#0f172a"} if total else {}) + chart,
    )


def throughput_by_bucket_chart(report: dict[str, Any]) -> str:
    rows = report["bucket_throughput"]
    speed = {(f"{r['device_type']} · {r['draft_kind']}", r["batch_bucket"]): r for r in rows}
    colors = _colors([name for name, _ in speed])
    groups = [
        (
            f"batch {bucket}",
            [
                Bar(
                    speed.get((name, bucket), {}).get("tokens_per_second"),
                    color,
                    f"{name}, batch {bucket}: "
                    f"{decimal(speed.get((name, bucket), {}).get('tokens_per_second'))} tokens/s",
                )
                for name, color in colors.items()
            ],
        )
        for bucket in sorted({bucket for _, bucket in speed})
    ]
    chart = bar_chart("tokens per second by batch bucket", groups, decimal)
    return _panel(
        "Tokens/s by batch bucket",
        "generated tokens ÷ shard wall seconds (per worker), by the largest batch bucket used",
        legend(colors) + chart,
    )


Column = tuple[str, str, Callable[[Any], str]]
TEXT_FORMATS = (text, model)  # left-aligned columns

RUN_COLUMNS: list[Column] = [
    ("run_id", "run", text), ("run_date", "date", text), ("device_types", "device", text),
    ("model_pairs", "target ← draft", text), ("shards", "shards", count),
    ("generated_tokens", "tokens", count), ("cost", "cost", usd),
    ("cost_per_1m_tokens", "$ / 1M tok", usd), ("tokens_per_second", "tok/s", decimal),
    ("acceptance_rate", "acceptance", rate), ("mean_accepted_length", "mean acc. len", decimal),
    ("padding_waste", "padding", rate), ("error_rows", "error rows", count),
]  # fmt: skip
MODEL_PAIR_COLUMNS: list[Column] = [
    ("target_model", "target", model), ("draft_model", "draft model", model),
    ("draft_kind", "draft kind", text), ("device_type", "device", text),
    ("shards", "shards", count), ("generated_tokens", "tokens", count),
    ("cost_per_1m_tokens", "$ / 1M tok", usd), ("tokens_per_second", "tok/s", decimal),
    ("acceptance_rate", "acceptance", rate), ("mean_accepted_length", "mean acc. len", decimal),
    ("padding_waste", "padding", rate), ("error_rows", "error rows", count),
]  # fmt: skip
SHARD_COLUMNS: list[Column] = [
    ("shard_id", "shard", text), ("run_id", "run", text), ("device_type", "device", text),
    ("draft_kind", "draft kind", text), ("generated_tokens", "tokens", count),
    ("wall_seconds", "wall s", decimal), ("cost", "cost", usd),
    ("cost_per_1m_tokens", "$ / 1M tok", usd), ("tokens_per_second", "tok/s", decimal),
    ("acceptance_rate", "acceptance", rate), ("error_rows", "error rows", count),
]  # fmt: skip
PRICE_COLUMNS: list[Column] = [
    ("device_type", "device", text),
    ("usd_per_hour", "$ / device-hour", lambda v: ", ".join(usd(x) for x in v)),
    ("source", "source", text),
]


def table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    head = "".join(
        f'<th class="{"text" if fmt in TEXT_FORMATS else ""}">{escape(title)}</th>'
        for _, title, fmt in columns
    )
    body = []
    for row in rows:
        cells = []
        for key, _, fmt in columns:
            value = row.get(key)
            css = "text" if fmt in TEXT_FORMATS else "bad" if key == "error_rows" and value else ""
            cells.append(
                f'<td class="{css}" title="{escape(text(value))}">{escape(fmt(value))}</td>'
            )
        body.append(f"<tr>{''.join(cells)}</tr>")
    return (
        f'<div class="scroll"><table><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )


def _kpis(total: dict[str, Any]) -> str:
    cards = [
        ("Generated tokens", count(total["generated_tokens"]), f"{total['shards']} shards"),
        ("Cost", usd(total["cost"]), f"{decimal(total['device_seconds'])} device-seconds"),
        ("Cost / 1M tokens", usd(total["cost_per_1m_tokens"]), "all runs"),
        ("Tokens / s", decimal(total["tokens_per_second"]), "per worker"),
        ("Acceptance", rate(total["acceptance_rate"]), "accepted ÷ proposed"),
        ("Mean accepted length", decimal(total["mean_accepted_length"]), "tokens per round"),
        ("Padding waste", rate(total["padding_waste"]), "token-weighted"),
        ("Error rows", count(total["error_rows"]), f"of {count(total['input_rows'])} input rows"),
    ]
    return "".join(
        f'<div class="kpi"><div class="label">{escape(label)}</div>'
        f'<div class="value">{escape(value)}</div><div class="note">{escape(note)}</div></div>'
        for label, value, note in cards
    )


def render_dashboard(report: dict[str, Any], source: str) -> str:
    """The whole page for a `build_report` result read from `source`."""
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    runs = report["runs"]
    subtitle = (
        f"{source} · {len(runs)} run(s) from {text(runs[0]['run_date'])} to "
        f"{text(runs[-1]['run_date'])} · committed shards only · generated {now}"
    )
    charts = [
        cost_per_run_chart(report),
        acceptance_per_shard_chart(report),
        position_curve_chart(report),
        throughput_by_bucket_chart(report),
    ]
    tables = [
        _panel("Runs", "totals per run at the report's prices", table(runs, RUN_COLUMNS)),
        _panel(
            "Model pairs",
            "target × draft × device, all runs, cheapest per token first",
            table(report["model_pairs"], MODEL_PAIR_COLUMNS),
        ),
        _panel(
            "Costliest shards",
            f"top {len(report['costliest_shards'])} by cost",
            table(report["costliest_shards"], SHARD_COLUMNS),
        ),
        _panel("Prices used", "$ per device-hour behind every cost above",
               table(report["prices"], PRICE_COLUMNS)),
    ]  # fmt: skip
    return Template(TEMPLATE_PATH.read_text()).substitute(
        title="corpusgen · cost per token & acceptance",
        subtitle=escape(subtitle),
        kpis=_kpis(report["total"]),
        charts="".join(charts),
        tables="".join(tables),
        footer=escape(
            "Figures come from the DuckDB views in schemas/metrics_views.sql over the committed "
            "metrics; ratios are ratios of sums."
        ),
    )
