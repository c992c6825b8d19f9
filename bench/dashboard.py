"""The HTML dashboard over a year of daily runs, printed as JSON.

Writes a committed metrics history of ~10k shards (365 days x 2 model pairs x 14 shards, the
layout the pipeline writes: one metrics file and one manifest per shard), then measures the
report's query time, the page's size and its open time in a real headless Chromium (offline):
time to the load event (every chart drawn: plotly draws while the page parses) and to first
paint, side by side with a 3-run page, interleaved, medians.

    python bench/dashboard.py [--days 365] [--shards-per-run 14] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench._common import machine
from bench.browser import headless_chromium
from bench.metrics_history import daily_history, three_runs, write_shard
from reporting.dashboard import render_dashboard
from reporting.metrics import build_report, open_committed_metrics

ALL_CHARTS_DRAWN = (
    "[...document.querySelectorAll('.plotly-graph-div')]"
    ".every(d => d._fullLayout && d.querySelector('.main-svg'))"
)
PAGE_TIMES = """JSON.stringify({
  load: performance.getEntriesByType('navigation')[0].loadEventEnd,
  paint: (performance.getEntriesByType('paint').find(p => p.name === 'first-contentful-paint')
          || {startTime: null}).startTime,
  charts: document.querySelectorAll('.js-plotly-plot').length})"""


def write_dashboard(rows: list[dict], workdir: Path, name: str) -> dict:
    root = workdir / name
    started = time.perf_counter()
    for row in rows:
        write_shard(str(root), row)
    written = time.perf_counter() - started
    started = time.perf_counter()
    report = build_report(open_committed_metrics(str(root)))
    queried = time.perf_counter() - started
    started = time.perf_counter()
    html = render_dashboard(report, str(root))
    rendered = time.perf_counter() - started
    page = workdir / f"{name}.html"
    page.write_text(html)
    return {
        "shards": len(rows),
        "runs": len(report["runs"]),
        "regressions_flagged": len(report["regressions"]),
        "history_write_seconds": round(written, 2),
        "report_query_seconds": round(queried, 2),
        "render_seconds": round(rendered, 2),
        "html_bytes": len(html.encode()),
        "page": page,
    }


def open_times(session, page: Path) -> dict:
    """Navigate, wait until every chart is drawn; the page's own timings (ms)."""
    started = time.perf_counter()
    session.open(page.as_uri())
    session.wait_until(ALL_CHARTS_DRAWN)
    wall_ms = (time.perf_counter() - started) * 1000
    problems = session.problems()
    if problems:
        raise RuntimeError(f"{page.name}: {problems}")
    return {**json.loads(session.evaluate(PAGE_TIMES)), "charts_drawn_wall": wall_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--days", type=int, default=365)
    parser.add_argument("--shards-per-run", type=int, default=14)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        pages = {
            "year": write_dashboard(
                daily_history(args.days, args.shards_per_run, slow_day=args.days - 10),
                workdir, "year",
            ),
            "three_runs": write_dashboard(three_runs(), workdir, "three_runs"),
        }  # fmt: skip
        samples: dict[str, list[dict]] = {name: [] for name in pages}
        with headless_chromium(workdir / "profile") as session:
            open_times(session, pages["three_runs"]["page"])  # the browser's own first start
            for _ in range(args.repeats):
                for name, page in pages.items():
                    samples[name].append(open_times(session, page["page"]))
    result = {"repeats": args.repeats, "browser": "Debian chromium, headless, offline"}
    for name, page in pages.items():
        page.pop("page")
        medians = {
            f"{key}_ms": round(statistics.median(s[key] for s in samples[name]), 1)
            for key in ("load", "paint", "charts_drawn_wall")
        }
        result[name] = {**page, **medians, "charts": samples[name][0]["charts"]}
    year, small = result["year"], result["three_runs"]
    result["year_vs_three_runs"] = {
        "html_bytes": round(year["html_bytes"] / small["html_bytes"], 3),
        "load": round(year["load_ms"] / small["load_ms"], 3),
    }
    print(json.dumps({"machine": machine(), **result}, indent=2))


if __name__ == "__main__":
    main()
