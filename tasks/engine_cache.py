"""One Engine per worker process and EngineConfig: loading and warm-up happen once, then every
shard the process runs reuses it. The engine is not thread-safe, so shards take turns.

A lease says how long its shard spent loading the engine and when it got hold of it, so cost is
counted only while a shard holds the engine: shards waiting for the lock bill nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from schemas.engine import EngineConfig
from tasks.failures import EngineLoadError, describe

if TYPE_CHECKING:
    from generation import Engine

_ENGINES: dict[str, tuple[Engine, threading.Lock]] = {}
_LOADING = threading.Lock()


@dataclass(frozen=True)
class EngineLease:
    engine: Engine
    load_seconds: float  # loading + warm-up this lease did; 0.0 when the engine was loaded
    acquired_at: float  # time.perf_counter() when the engine's lock was taken

    def held_seconds(self) -> float:
        return time.perf_counter() - self.acquired_at


@contextmanager
def leased_engine(config: EngineConfig, warmup: bool) -> Iterator[EngineLease]:
    """The process's engine for `config`, held exclusively for the `with` block."""
    key = config.model_dump_json()
    load_seconds = 0.0
    with _LOADING:
        if key not in _ENGINES:
            from generation import Engine

            started = time.perf_counter()
            try:
                engine = Engine.from_config(config)
                if warmup:
                    engine.warmup()
            except Exception as error:
                raise EngineLoadError(
                    f"cannot load the engine (target {config.target.path!r}): {describe(error)}"
                ) from error
            load_seconds = time.perf_counter() - started
            _ENGINES[key] = (engine, threading.Lock())
        engine, lock = _ENGINES[key]
    with lock:
        yield EngineLease(engine, load_seconds, time.perf_counter())


def loaded_engine_count() -> int:
    return len(_ENGINES)
