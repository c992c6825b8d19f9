"""A real headless Chromium (Debian's package) driven over the DevTools protocol: used by the
dashboard test and bench/dashboard.py to load a page offline and record what it did."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
import urllib.request
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from websockets.sync.client import connect


class ChromiumMissing(RuntimeError):
    pass


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

    def wait_until(self, expression: str, timeout: float = 60) -> float:
        """Poll a JS expression until it is true; the seconds it took."""
        started = time.monotonic()
        while not self.evaluate(expression):
            if time.monotonic() - started > timeout:
                raise TimeoutError(expression)
            time.sleep(0.02)
        return time.monotonic() - started


@contextmanager
def headless_chromium(profile: Path, width: int = 1400, height: int = 1000) -> Iterator[DevTools]:
    """Start chromium with a fresh profile and no background networking; one page session."""
    executable = shutil.which("chromium")
    if executable is None:
        raise ChromiumMissing(
            "Debian's chromium is missing: run `bash tests/ensure_debian_packages.sh` "
            "(make test does)"
        )
    process = subprocess.Popen(
        [executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={profile}", "--remote-debugging-port=0",
         "--remote-allow-origins=*", f"--window-size={width},{height}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        port_file, deadline = profile / "DevToolsActivePort", time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"chromium did not start (exit code {process.poll()})")
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as reply:
            page = next(t for t in json.load(reply) if t["type"] == "page")
        session = DevTools(page["webSocketDebuggerUrl"])
        session.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
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
