"""An HTTP proxy in front of the moto S3 server that injects the faults real object storage
has: a request applied but its answer lost (the connection drops after forwarding), 503
SlowDown without forwarding, a refused key, and a SIGKILL of the client right after S3 applied a
request. Point `storage.endpoint_url` at `proxy.url`; every injected fault is logged in
`proxy.events`, so a test can check that its faults really happened."""

from __future__ import annotations

import http.client
import os
import random
import re
import signal
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

FAULTS = ("lost_ack", "slow_down", "kill", "deny")
SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
DENIED = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidAccessKeyId</Code>'
          b"<Message>The AWS Access Key Id you provided does not exist.</Message></Error>")
# Not forwarded: hop-by-hop headers, and those this proxy sets or answers itself.
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "expect",
              "server", "date"}


@dataclass
class FaultRule:
    """Inject `fault` into the next `times` requests whose method ("*": any) and path match;
    with `once_per_path`, into the first request to each matching path only (its retry passes)."""

    fault: str
    method: str = "PUT"
    path_pattern: str = r"/manifests/"
    times: int = 1
    once_per_path: bool = False
    hit_paths: set[str] = field(default_factory=set)

    def matches(self, method: str, path: str) -> bool:
        return (self.times > 0 and self.method in ("*", method)
                and re.search(self.path_pattern, path) is not None
                and not (self.once_per_path and path in self.hit_paths))


class S3FaultProxy:
    def __init__(self, upstream_url: str):
        upstream = urlsplit(upstream_url)
        self.upstream = (upstream.hostname, upstream.port)
        self.rules: list[FaultRule] = []
        self.random: random.Random | None = None
        self.random_rates: dict[str, float] = {}
        self.kill_pid: int | None = None
        self.events: list[tuple[str, str, str]] = []  # (fault, method, path)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def inject(self, *rules: FaultRule) -> None:
        with self._lock:
            self.rules = list(rules)

    def randomize(self, seed: int, rules: list[FaultRule], rate: float, any_slow_down: float):
        """Seeded random faults: each request that a remaining rule matches gets that rule's
        fault with probability `rate`; any other request gets SlowDown with `any_slow_down`."""
        with self._lock:
            self.rules, self.random = list(rules), random.Random(seed)
            self.random.shuffle(self.rules)
            self.random_rates = {"rule": rate, "any": any_slow_down}

    def clear(self) -> None:
        with self._lock:
            self.rules, self.random = [], None

    def faults(self, fault: str) -> int:
        return sum(1 for event in self.events if event[0] == fault)

    def _choose(self, method: str, path: str) -> str | None:
        with self._lock:
            rule = next((rule for rule in self.rules if rule.matches(method, path)), None)
            draw = self.random.random() if self.random else 0.0
            if rule and (self.random is None or draw < self.random_rates["rule"]):
                rule.times -= 1
                rule.hit_paths.add(path)
                return rule.fault
            if self.random and not rule and draw < self.random_rates["any"]:
                return "slow_down"
            return None

    def _handler_class(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    self.rfile.readline()
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _drop(self) -> None:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

            def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
                upstream = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in HOP_BY_HOP}
                headers["Content-Length"] = str(len(body))
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                content = response.read()
                upstream.close()
                return response.status, response.getheaders(), content

            def _handle(self) -> None:
                body = self._body()
                fault = proxy._choose(self.command, self.path)
                if fault:
                    proxy.events.append((fault, self.command, self.path))
                if fault == "slow_down":
                    return self._answer(503, SLOW_DOWN)
                if fault == "deny":
                    return self._answer(403, DENIED)
                status, headers, content = self._forward(body)
                if fault == "kill" and proxy.kill_pid:
                    os.kill(proxy.kill_pid, signal.SIGKILL)
                if fault in ("lost_ack", "kill"):
                    return self._drop()
                self.send_response(status)
                for key, value in headers:
                    if key.lower() not in HOP_BY_HOP:
                        self.send_header(key, value)
                length = next((v for k, v in headers if k.lower() == "content-length"), None)
                self.send_header("Content-Length",
                                 length if self.command == "HEAD" and length else str(len(content)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(content)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        return Handler
