"""The Prefect API a CLI run talks to: PREFECT_API_URL when set, else a local server that the
CLI starts, watches and stops itself.

Prefect's own temporary server is a child in the CLI's process group, so a terminal's Ctrl-C
killed it at once and the run then failed every API call for minutes. This one runs in its own
session: Ctrl-C reaches only the CLI, which stops the run in order and then the server. It
starts with the current directory kept off its import path (`python -P`: a local `inspect.py`
shadowed the standard library and crashed it), and is watched while it starts, so a server
that exits is reported at once with the last line it printed, not after a 120 s timeout.

Its port is chosen below the kernel's range for outgoing connections (32768-60999 on Linux,
49152 and up on macOS): a port the OS handed out as free could be taken by another process's
outgoing connection in the seconds the server spends on its migrations before it binds, and
the server then died with "address already in use" mid-test. A server that still loses its
port is restarted on another one, as Prefect's own temporary server does.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterator
from pathlib import Path

import httpx

STARTUP_TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


class ServerFailed(RuntimeError):
    """The local Prefect server exited or never answered; the message says why."""


LISTEN_PORTS = range(20000, 32768)
BIND_ATTEMPTS = 5


def free_listen_port(avoid: Collection[int] = ()) -> int:
    """A port free now, outside the ranges the OS hands to outgoing connections."""
    while True:
        port = random.choice(LISTEN_PORTS)
        if port in avoid:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
    return next((line for line in reversed(lines) if line), "(it printed nothing)")


class LocalServer:
    """`uvicorn prefect.server.api.server:create_app` as Prefect's temporary server runs it."""

    def __init__(self) -> None:
        import prefect
        from prefect.settings import get_current_settings

        self.log = Path(tempfile.mkstemp(prefix="corpusgen-prefect-server-", suffix=".log")[1])
        self._env = {
            **os.environ,
            **get_current_settings().to_environment_variables(exclude_unset=True),
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
        }
        self._app_dir = str(Path(prefect.__file__).parent.parent)
        self._lost_ports: set[int] = set()
        self._spawn()

    def _spawn(self) -> None:
        self.port = free_listen_port(self._lost_ports)
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        command = [
            sys.executable, "-P", "-m", "uvicorn",
            "--app-dir", self._app_dir,
            "--factory", "prefect.server.api.server:create_app",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--log-level", "error", "--lifespan", "on",
        ]  # fmt: skip
        with self.log.open("w") as log:  # the child keeps its own handle
            self.process = subprocess.Popen(
                command, env=self._env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _lost_its_port(self) -> bool:
        return "address already in use" in self.log.read_text(errors="replace")

    def exit_reason(self) -> str | None:
        """None while the server runs; else how it ended and the last line it printed."""
        code = self.process.poll()
        if code is None:
            return None
        return f"exited with code {code}: {_last_line(self.log)}"

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2) as client:
            while time.monotonic() < deadline:
                if (reason := self.exit_reason()) is not None:
                    if self._lost_its_port() and len(self._lost_ports) < BIND_ATTEMPTS:
                        self._lost_ports.add(self.port)
                        self._spawn()
                        continue
                    raise ServerFailed(f"Prefect's local server {reason} (log: {self.log})")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.api_url}/health").status_code == 200:
                        return
                time.sleep(0.1)
        self.stop()
        raise ServerFailed(
            f"Prefect's local server did not answer within {timeout:.0f} s (log: {self.log}); "
            f"raise {STARTUP_TIMEOUT_ENV} or set PREFECT_API_URL to a running server "
            "(`prefect server start`)"
        )

    def stop(self) -> None:
        """SIGTERM its whole session, SIGKILL what is left after a few seconds."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@contextlib.contextmanager
def prefect_api() -> Iterator[LocalServer | None]:
    """Run the body against PREFECT_API_URL, or against a local server started for it (the
    settings context is copied into threads started with contextvars.copy_context())."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        yield None
        return
    server = LocalServer()
    try:
        server.wait_healthy(float(os.environ.get(STARTUP_TIMEOUT_ENV, "120")))
    except BaseException:
        server.stop()  # its log stays, for the operator
        raise
    try:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            try:
                yield server
            finally:
                _flush_prefect_clients()
    finally:
        server.stop()
        server.log.unlink(missing_ok=True)


def _flush_prefect_clients() -> None:
    """Send the logs and events Prefect still queues while the server is up: its exit hooks
    would otherwise wait for a server that is gone (a stopped run hung at exit)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (APILogWorker, EventsWorker):
        service.drain_all(timeout=5)
