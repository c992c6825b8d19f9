"""The HTML dashboard: self-contained markup with the four charts, and a real headless Chromium
that loads it offline without console errors and paints charts (screenshot kept as an artifact).
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import time
import urllib.request
import zlib
from pathlib import Path

import pytest
from reporting_fixtures import metrics_row, three_runs, write_shard
from websockets.sync.client import connect

from tasks.dashboard import render_dashboard
from tasks.reporting import build_report, open_committed_metrics

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("out"))
    for row in three_runs():
        write_shard(root, row)
    return build_report(open_committed_metrics(root))


@pytest.fixture(scope="module")
def dashboard_file(report, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("html") / "dashboard.html"
    path.write_text(render_dashboard(report, "/data/out"))
    return path


def _charts(html: str) -> list[str]:
    return re.findall(r'<svg class="chart".*?</svg>', html, re.S)


def test_dashboard_is_self_contained(dashboard_file):
    html = dashboard_file.read_text()
    assert "<script" not in html and "<link" not in html and "src=" not in html
    urls = set(re.findall(r"https?://[^\s\"')]+", html))
    assert urls == {"http://www.w3.org/2000/svg"}  # an XML namespace name, never fetched


def test_dashboard_charts_show_the_report(report, dashboard_file):
    html = dashboard_file.read_text()
    cost, acceptance, positions, buckets = _charts(html)
    assert [label in cost for label in (">$2.50<", ">$5.32<", ">$0.66<")] == [True] * 3
    assert acceptance.count("<rect") == 3  # run-b's two shards and run-c's one; run-a drafts none
    assert "run-b-s1 (model): 62.5%" in acceptance
    assert positions.count("<polyline") == 3  # run-b, run-c, all runs
    assert "all runs, token 1: 66.7%" in positions
    assert [f"batch {b}" in buckets for b in (2, 4, 8)] == [True] * 3
    assert "cuda-h100 · prompt_lookup, batch 8: 1,250 tokens/s" in buckets
    assert "report override" not in html and "recorded in the metrics at run time" in html


def test_dashboard_without_speculation_says_so_and_escapes_names(tmp_path):
    root = str(tmp_path)
    no_draft = {"draft_kind": "none", "rounds": 0, "proposed": 0, "accepted": 0}
    lists = {"accepted_per_position": [], "proposed_per_position": []}
    # as the pipeline writes a run without draft: rate 0.0, draft_model "" (not nulls)
    row = metrics_row("run-a", "s0", target_model="/models/<i>m", draft_model="",
                      acceptance_rate=0.0, **no_draft, **lists)  # fmt: skip
    write_shard(root, row)
    report = build_report(open_committed_metrics(root))
    assert report["shards"][0]["acceptance_rate"] is None
    html = render_dashboard(report, root)
    assert html.count("no speculative decoding in these runs") == 2
    assert "<i>" not in html and "&lt;i&gt;m &lt;- none" in html


# --- the browser test ----------------------------------------------------------------------------


class DevTools:
    """A minimal Chrome DevTools Protocol session on one page, recording every event."""

    def __init__(self, websocket_url: str):
        self.socket = connect(websocket_url, max_size=None, open_timeout=30)
        self.events: list[dict] = []
        self._next_id = 0

    def call(self, method: str, **params) -> dict:
        self._next_id += 1
        self.socket.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=60))
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            self.events.append(message)

    def wait_for(self, method: str, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.events:
                if event.get("method") == method:
                    return event
            self.events.append(json.loads(self.socket.recv(timeout=deadline - time.monotonic())))
        raise TimeoutError(method)

    def problems(self) -> list[str]:
        """Console errors, uncaught exceptions and any request that would leave the file."""
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(f"uncaught: {params['exceptionDetails'].get('text')}")
            elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
                found.append(f"console.{params['type']}: {params['args']}")
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                found.append(f"log: {params['entry']['text']}")
            elif method == "Network.requestWillBeSent":
                url = params["request"]["url"]
                if not url.startswith(("file:", "data:", "about:")):
                    found.append(f"network request: {url}")
        return found

    def open(self, url: str) -> None:
        self.events.clear()
        for domain in ("Runtime", "Log", "Network", "Page"):
            self.call(f"{domain}.enable")
        self.call("Page.navigate", url=url)
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"][
            "value"
        ]

    def screenshot(self, clip: dict | None = None) -> bytes:
        params = {"format": "png", "captureBeyondViewport": True}
        if clip:
            params["clip"] = {**clip, "scale": 1}
        return base64.b64decode(self.call("Page.captureScreenshot", **params)["data"])


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail(
            "Debian's chromium is missing: run `bash tests/ensure_chromium.sh` (make test does)"
        )
    profile = tmp_path_factory.mktemp("chromium-profile")
    process = subprocess.Popen(
        [executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={profile}", "--remote-debugging-port=0",
         "--remote-allow-origins=*", "--window-size=1400,1000", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        port_file, deadline = profile / "DevToolsActivePort", time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or process.poll() is not None:
                pytest.fail(f"chromium did not start (exit code {process.poll()})")
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as reply:
            page = next(t for t in json.load(reply) if t["type"] == "page")
        session = DevTools(page["webSocketDebuggerUrl"])
        session.call("Emulation.setDeviceMetricsOverride", width=1400, height=1000,
                     deviceScaleFactor=1, mobile=False)  # fmt: skip
        yield session
        session.socket.close()
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def decode_png(data: bytes) -> tuple[int, int, list[bytes], int]:
    """(width, height, rows, bytes per pixel) of an 8-bit RGB/RGBA PNG, as Chromium writes it."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    position, compressed = 8, b""
    while position < len(data):
        length = int.from_bytes(data[position : position + 4], "big")
        kind, body = data[position + 4 : position + 8], data[position + 8 : position + 8 + length]
        position += 12 + length
        if kind == b"IHDR":
            width, height = int.from_bytes(body[:4], "big"), int.from_bytes(body[4:8], "big")
            assert body[8] == 8 and body[12] == 0, "expected 8-bit, non-interlaced"
            bpp = {2: 3, 6: 4}[body[9]]
        elif kind == b"IDAT":
            compressed += body
    raw, stride, rows = zlib.decompress(compressed), width * bpp, []
    previous = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for x in range(stride):
            left = line[x - bpp] if x >= bpp else 0
            up, up_left = previous[x], (previous[x - bpp] if x >= bpp else 0)
            if kind == 1:
                line[x] = (line[x] + left) & 255
            elif kind == 2:
                line[x] = (line[x] + up) & 255
            elif kind == 3:
                line[x] = (line[x] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - up_left
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
                line[x] = (
                    line[x] + (left if pa <= pb and pa <= pc else up if pb <= pc else up_left)
                ) & 255
        rows.append(bytes(line))
        previous = line
    return width, height, rows, bpp


def colour_stats(png: bytes) -> tuple[int, float]:
    """(distinct colours, share of pixels that are not near-white)."""
    width, height, rows, bpp = decode_png(png)
    colours, inked = set(), 0
    for row in rows:
        for x in range(0, width * bpp, bpp):
            pixel = row[x : x + 3]
            colours.add(pixel)
            inked += min(pixel) < 235
    return len(colours), inked / (width * height)


def test_dashboard_in_headless_chromium(browser, dashboard_file):
    browser.open(dashboard_file.as_uri())
    assert browser.problems() == []
    charts = browser.evaluate(
        """JSON.stringify([...document.querySelectorAll('svg.chart')].map(svg => {
             const box = svg.getBoundingClientRect();
             return {x: box.x + scrollX, y: box.y + scrollY, width: box.width, height: box.height,
                     marks: svg.querySelectorAll('rect, circle, polyline').length};
           }))"""
    )
    charts = json.loads(charts)
    assert len(charts) == 4
    ARTIFACTS.mkdir(exist_ok=True)
    full_page = browser.screenshot()
    (ARTIFACTS / "dashboard.png").write_bytes(full_page)
    for index, chart in enumerate(charts):
        assert chart["width"] > 300 and chart["height"] > 150 and chart["marks"] > 0, chart
        clip = {key: chart[key] for key in ("x", "y", "width", "height")}
        distinct, inked = colour_stats(browser.screenshot(clip))
        assert distinct >= 8 and inked > 0.03, (index, distinct, inked)
    assert colour_stats(full_page)[0] > 50


def test_browser_check_catches_a_broken_page(browser, tmp_path):
    """The console check itself can fail: a page with a script error and a remote image."""
    page = tmp_path / "broken.html"
    page.write_text(
        '<html><body><img src="http://127.0.0.1:9/x.png"><script>undefinedCall()</script></body></html>'
    )
    browser.open(page.as_uri())
    problems = browser.problems()
    assert any("uncaught" in p for p in problems) and any("network request" in p for p in problems)
