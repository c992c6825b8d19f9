"""The HTML dashboard: plotly charts that carry the report's figures, in one self-contained
page, and a real headless Chromium that loads it offline without console errors or network
requests, paints every chart and answers a hover (screenshot kept as an artifact).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench.browser import ChromiumMissing, colour_stats, headless_chromium
from bench.metrics_history import daily_history, metrics_row, three_runs, write_shard
from reporting.dashboard import _kpis, charts, render_dashboard
from reporting.metrics import build_report, open_committed_metrics

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def _report(tmp_path_factory, rows) -> dict:
    root = str(tmp_path_factory.mktemp("out"))
    for row in rows:
        write_shard(root, row)
    return build_report(open_committed_metrics(root))


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return _report(tmp_path_factory, three_runs())


@pytest.fixture(scope="module")
def history_report(tmp_path_factory) -> dict:
    """Two series over 12 days, the smol-lookup run of day 10 slowed down 1.5x."""
    return _report(tmp_path_factory, daily_history(days=12, shards_per_run=2, slow_day=10))


@pytest.fixture(scope="module")
def dashboard_file(history_report, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("html") / "dashboard.html"
    path.write_text(render_dashboard(history_report, "/data/out"))
    return path


def _by_key(report: dict) -> dict:
    return {chart.key: chart for chart in charts(report)}


def _traces(chart) -> dict[str, object]:
    return {trace.name: trace for trace in chart.figure.data}


def test_dashboard_is_self_contained(dashboard_file):
    html = dashboard_file.read_text()
    assert "<link" not in html and "<img" not in html and "<iframe" not in html
    assert re.search(r"<script[^>]*\ssrc=", html) is None  # plotly.js is inline, not fetched
    assert html.count("plotly.js v") == 1  # embedded once for all charts
    markup = re.sub(r"<script>.*?</script>", "", html, flags=re.S)  # plotly.js names URLs
    assert re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", markup) is None
    assert re.search(r"url\(|@import", markup) is None  # the CSS fetches nothing either


def test_engine_load_is_a_tile_apart_from_generation_cost(report):
    total = {**report["total"], "cost": 1.5, "engine_load_cost": 0.25,
             "engine_load_seconds": 42.0, "total_cost": 1.75}
    tiles = _kpis({**report, "total": total})
    assert re.search(r"Engine load</div><div class=\"value\">\$0.25</div>.*42", tiles)
    assert re.search(r"Total cost</div><div class=\"value\">\$1.75<", tiles)


def test_charts_carry_the_report_figures(report):
    chart = _by_key(report)
    runs = {run["run_id"]: run for run in report["trends"]}
    cost = _traces(chart["cost-trend"])
    assert set(cost) == {"tiny-llama <- none · cpu", "tiny-llama <- tiny-draft · gaudi2",
                         "tiny-llama <- prompt_lookup · cuda-h100"}  # fmt: skip
    assert cost["tiny-llama <- tiny-draft · gaudi2"].y == (runs["run-b"]["cost_per_1m_tokens"],)
    assert "run-b: $5.32" in cost["tiny-llama <- tiny-draft · gaudi2"].text[0]
    savings = _traces(chart["savings"])  # run-c drafted without an estimate: no bar
    assert set(savings) == {"tiny-llama <- none · cpu", "tiny-llama <- tiny-draft · gaudi2"}
    assert savings["tiny-llama <- tiny-draft · gaudi2"].y == (runs["run-b"]["cost_saved"],)
    assert "(1.50× vs plain)" in savings["tiny-llama <- tiny-draft · gaudi2"].text[0]
    boxes = _traces(chart["shard-acceptance"])  # run-a drafts nothing
    assert sorted(len(box.y) for box in boxes.values()) == [1, 2]
    positions = _traces(chart["position-acceptance"])
    assert list(positions) == ["run-b", "run-c", "all runs"]
    assert positions["all runs"].y[0] == pytest.approx(800 / 1200)
    buckets = _traces(chart["bucket-throughput"])
    assert buckets["cuda-h100 · prompt_lookup"].y == (1250.0,)
    assert {x for trace in buckets.values() for x in trace.x} == {"batch 2", "batch 4", "batch 8"}


def test_trend_charts_mark_the_regression(history_report):
    chart = _by_key(history_report)
    for key in ("cost-trend", "throughput-trend"):
        flagged = _traces(chart[key])["regression"]
        assert len(flagged.x) == 1 and flagged.x[0].startswith("2026-01-11")
        assert "smol-lookup-010" in flagged.text[0] and "cost/1M tokens +" in flagged.text[0]
    lines = _traces(chart["cost-trend"])
    assert [len(trace.x) for name, trace in lines.items() if name != "regression"] == [12, 12]


def test_dashboard_without_speculation_says_so_and_escapes_names(tmp_path_factory):
    no_draft = {"draft_kind": "none", "rounds": 0, "proposed": 0, "accepted": 0}
    lists = {"accepted_per_position": [], "proposed_per_position": []}
    # as the pipeline writes a run without draft: rate 0.0, draft_model "" (not nulls)
    row = metrics_row("run-a", "s0", target_model="/models/<i>m", draft_model="",
                      acceptance_rate=0.0, **no_draft, **lists)  # fmt: skip
    report = _report(tmp_path_factory, [row])
    assert report["shards"][0]["acceptance_rate"] is None
    html = render_dashboard(report, "/data/<out>")
    assert html.count("no speculative decoding in these runs") == 3
    assert "<i>" not in html and "&lt;i&gt;m &lt;- none" in html  # tables
    assert "\\u003ci\\u003em \\u003c- none" in html  # chart data (JSON)


# --- the browser test ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    try:
        with headless_chromium(tmp_path_factory.mktemp("chromium-profile")) as session:
            yield session
    except ChromiumMissing as exc:
        pytest.fail(str(exc))


CHART_BOXES = """JSON.stringify([...document.querySelectorAll('.js-plotly-plot')].map(div => {
  const box = div.getBoundingClientRect();
  return {id: div.id, x: box.x + scrollX, y: box.y + scrollY, width: box.width,
          height: box.height, marks: div.querySelectorAll('.main-svg path, .main-svg rect').length};
}))"""


def test_dashboard_in_headless_chromium(browser, dashboard_file, history_report):
    browser.open(dashboard_file.as_uri())
    browser.wait_until("[...document.querySelectorAll('.plotly-graph-div')]"
                       ".every(d => d._fullLayout && d.querySelector('.main-svg'))")  # fmt: skip
    assert browser.problems() == []
    boxes = json.loads(browser.evaluate(CHART_BOXES))
    assert [box["id"] for box in boxes] == [chart.key for chart in charts(history_report)]
    ARTIFACTS.mkdir(exist_ok=True)
    full_page = browser.screenshot()
    (ARTIFACTS / "dashboard.png").write_bytes(full_page)
    for box in boxes:
        assert box["width"] > 300 and box["height"] > 250 and box["marks"] > 0, box
        clip = {key: box[key] for key in ("x", "y", "width", "height")}
        distinct, inked = colour_stats(browser.screenshot(clip))
        assert distinct >= 8 and inked > 0.03, (box["id"], distinct, inked)
    assert colour_stats(full_page)[0] > 50


def test_chart_hover_names_the_run(browser, dashboard_file):
    """Interactive, not a picture: hovering the flagged point shows its regression."""
    browser.open(dashboard_file.as_uri())
    browser.wait_until("document.getElementById('cost-trend')._fullLayout !== undefined")
    browser.evaluate("""(() => { const div = document.getElementById('cost-trend');
        const flagged = div.data.findIndex(trace => trace.name === 'regression');
        Plotly.Fx.hover(div, [{curveNumber: flagged, pointNumber: 0}]); return flagged; })()""")
    browser.wait_until("document.querySelector('#cost-trend .hoverlayer .hovertext') !== null")
    hover = browser.evaluate("document.querySelector('#cost-trend .hoverlayer').textContent")
    assert "smol-lookup-010" in hover and "cost/1M tokens +" in hover
    assert browser.problems() == []


def test_browser_check_catches_a_broken_page(browser, tmp_path):
    """The console check itself can fail: a page with a script error and a remote image."""
    page = tmp_path / "broken.html"
    page.write_text(
        '<html><body><img src="http://127.0.0.1:9/x.png"><script>undefinedCall()</script></body></html>'
    )
    browser.open(page.as_uri())
    problems = browser.problems()
    assert any("uncaught" in p for p in problems) and any("network request" in p for p in problems)
