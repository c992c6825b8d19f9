"""The report's tables: number formats and column lists shared by the terminal report and the
HTML dashboard, so both show the same figures under the same headings.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from html import escape
from typing import Any

from rich.console import Console
from rich.table import Table

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


def times(value: float | None) -> str:
    """A speedup: 1.52×."""
    return "–" if value is None else f"{value:.2f}×"


def change(value: float | None) -> str:
    """A relative change against a baseline: +35%."""
    return "–" if value is None else f"{value:+.0%}"


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


# --- columns ------------------------------------------------------------------------------------

Column = tuple[str, str, Callable[[Any], str]]
TEXT_FORMATS = (text, model)  # left-aligned columns
SAVINGS_COLUMNS: list[Column] = [
    ("speedup_vs_plain", "speedup vs plain", times), ("cost_saved", "saved", usd),
]  # fmt: skip

RUN_COLUMNS: list[Column] = [
    ("run_id", "run", text), ("run_date", "date", text), ("device_types", "device", text),
    ("model_pairs", "target ← draft", text), ("shards", "shards", count),
    ("generated_tokens", "tokens", count), ("cost", "cost", usd),
    ("cost_per_1m_tokens", "$ / 1M tok (no load)", usd), ("tokens_per_second", "tok/s", decimal),
    ("acceptance_rate", "acceptance", rate), ("mean_accepted_length", "mean acc. len", decimal),
    *SAVINGS_COLUMNS, ("padding_waste", "padding", rate), ("error_rows", "error rows", count),
]  # fmt: skip
MODEL_PAIR_COLUMNS: list[Column] = [
    ("target_model", "target", model), ("draft_model", "draft model", model),
    ("draft_kind", "draft kind", text), ("device_type", "device", text),
    ("shards", "shards", count), ("generated_tokens", "tokens", count),
    ("cost_per_1m_tokens", "$ / 1M tok (no load)", usd), ("tokens_per_second", "tok/s", decimal),
    ("acceptance_rate", "acceptance", rate), ("mean_accepted_length", "mean acc. len", decimal),
    *SAVINGS_COLUMNS, ("plain_cost_estimate", "plain cost (est.)", usd),
    ("padding_waste", "padding", rate), ("error_rows", "error rows", count),
]  # fmt: skip
REGRESSION_COLUMNS: list[Column] = [
    ("run_id", "run", text), ("run_date", "date", text), ("series", "series", text),
    ("regression", "worse than the previous runs' median", text),
    ("cost_per_1m_tokens", "$ / 1M tok (no load)", usd),
    ("baseline_cost_per_1m_tokens", "median", usd),
    ("tokens_per_second", "tok/s", decimal), ("baseline_tokens_per_second", "median", decimal),
    ("acceptance_rate", "acceptance", rate), ("baseline_acceptance_rate", "median", rate),
    ("baseline_runs", "previous runs", count),
]  # fmt: skip
SHARD_COLUMNS: list[Column] = [
    ("shard_id", "shard", text), ("run_id", "run", text), ("device_type", "device", text),
    ("draft_kind", "draft kind", text), ("generated_tokens", "tokens", count),
    ("wall_seconds", "wall s", decimal), ("cost", "cost", usd),
    ("cost_per_1m_tokens", "$ / 1M tok (no load)", usd), ("tokens_per_second", "tok/s", decimal),
    ("acceptance_rate", "acceptance", rate), *SAVINGS_COLUMNS,
    ("error_rows", "error rows", count),
]  # fmt: skip
FILTER_COLUMNS: list[Column] = [
    ("run_id", "run", text), ("run_date", "date", text), ("ok_rows", "generated", count),
    ("kept_rows", "kept", count), ("filtered_rows", "filtered", count),
    ("duplicate_rows", "duplicates", count), ("kept_rate", "kept %", rate),
    ("filtered_rate", "filtered %", rate), ("duplicate_rate", "duplicate %", rate),
]  # fmt: skip
ERROR_REASON_COLUMNS: list[Column] = [
    ("run_id", "run", text), ("reason", "reason", text), ("rows", "rows", count),
]
PRICE_COLUMNS: list[Column] = [
    ("device_type", "device", text),
    ("usd_per_hour", "$ / device-hour", lambda v: ", ".join(usd(x) for x in v)),
    ("source", "source", text),
]
BUCKET_COLUMNS: list[Column] = [
    ("device_type", "device", text), ("draft_kind", "draft kind", text),
    ("batch_bucket", "batch bucket", count), ("shards", "shards", count),
    ("tokens_per_second", "tok/s", decimal),
]  # fmt: skip


def _flagged(key: str, value: Any) -> bool:
    return bool(value) and key in ("error_rows", "regression")


def html_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    head = "".join(
        f'<th class="{"text" if fmt in TEXT_FORMATS else ""}">{escape(title)}</th>'
        for _, title, fmt in columns
    )
    body = []
    for row in rows:
        cells = []
        for key, _, fmt in columns:
            value = row.get(key)
            css = " ".join(
                name
                for name, wanted in (("text", fmt in TEXT_FORMATS), ("bad", _flagged(key, value)))
                if wanted
            )
            cells.append(
                f'<td class="{css}" title="{escape(text(value))}">{escape(fmt(value))}</td>'
            )
        body.append(f"<tr>{''.join(cells)}</tr>")
    return (
        f'<div class="scroll"><table><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )


# --- the terminal report ------------------------------------------------------------------------


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


def savings_line(total: dict[str, Any]) -> str:
    """What speculation saved, over the shards that could estimate plain decoding."""
    if not total["estimated_shards"]:
        return "speculation payoff: no shard has a plain-decoding estimate"
    return (
        f"speculation saved {usd(total['cost_saved'])} ({times(total['speedup_vs_plain'])} vs "
        f"plain decoding, estimated) over {total['estimated_shards']} of {total['shards']} shards"
    )


def print_report(report: dict[str, Any]) -> None:
    console = Console(width=max(Console().width, 160))
    total = report["total"]
    console.print(
        f"[bold]{total['shards']} committed shards[/], {total['generated_tokens']:,} tokens, "
        f"{total['error_rows']:,} error rows, {total['empty_completions'] or 0:,} empty "
        f"completions, {total['looping_completions'] or 0:,} ending in a loop, acceptance "
        f"{rate(total['acceptance_rate'])}\n"
        f"generation cost {usd(total['cost'])} + engine load {usd(total['engine_load_cost'])} "
        f"({decimal(total['engine_load_seconds'])} s) = total {usd(total['total_cost'])}, "
        f"{usd(total['total_cost_per_1m_tokens'])} per 1M tokens; {savings_line(total)}",
        soft_wrap=True,
    )
    console.print(_rich_table("Prices used ($ per device-hour)", report["prices"], PRICE_COLUMNS))
    console.print(_rich_table("Runs", report["runs"], RUN_COLUMNS))
    if report["regressions"]:
        console.print(_rich_table("Regressions", report["regressions"], REGRESSION_COLUMNS))
    filtered = [run for run in report["runs"] if run["kept_rows"] is not None]
    if filtered:
        console.print(_rich_table("Filters (of generated records)", filtered, FILTER_COLUMNS))
    console.print(_rich_table("Model pairs", report["model_pairs"], MODEL_PAIR_COLUMNS))
    if report["position_acceptance"]:
        console.print(_position_table(report["position_acceptance"]))
    console.print(
        _rich_table("Tokens/s by batch bucket", report["bucket_throughput"], BUCKET_COLUMNS)
    )
    console.print(_rich_table("Costliest shards", report["costliest_shards"], SHARD_COLUMNS))
    reasons = [row for row in report["error_reasons"] if row["level"] == "run"]
    if reasons:
        console.print(_rich_table("Error rows by reason", reasons, ERROR_REASON_COLUMNS))
