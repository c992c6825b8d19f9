"""A run's stop request, for an orderly Ctrl-C: set by the CLI's signal handler or by a flow run
that Prefect cancels; read by the dispatcher (no new shard starts) and, between decode steps,
by the engine of every in-flight shard (its attempt is abandoned before commit). Committed
shards are never touched, so a rerun of the same config resumes where this one stopped."""

from __future__ import annotations

import signal
import threading

_requested = threading.Event()
_signal: list[int] = []


class ShardAbandoned(RuntimeError):
    """A shard stopped generating on request; nothing of its attempt was committed."""


def request_stop(signum: int = signal.SIGTERM) -> None:
    if not _requested.is_set():
        _signal.append(signum)
        _requested.set()


def stop_requested() -> bool:
    return _requested.is_set()


def stop_signal() -> int | None:
    """The signal that asked for the stop (SIGINT for Ctrl-C), None while none did."""
    return _signal[0] if _signal else None


def reset() -> None:
    """Forget a handled stop (a new run in the same process starts clean)."""
    _requested.clear()
    _signal.clear()
