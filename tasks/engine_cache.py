"""One Engine per worker process and EngineConfig: loading and warm-up happen once, then every
shard the process runs reuses it. The engine is not thread-safe, so shards take turns."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from schemas.engine import EngineConfig
from tasks.failures import EngineLoadError, describe

if TYPE_CHECKING:
    from generation import Engine

_ENGINES: dict[str, tuple[Engine, threading.Lock]] = {}
_LOADING = threading.Lock()


@contextmanager
def leased_engine(config: EngineConfig, warmup: bool) -> Iterator[Engine]:
    """The process's engine for `config`, held exclusively for the `with` block."""
    key = config.model_dump_json()
    with _LOADING:
        if key not in _ENGINES:
            from generation import Engine

            try:
                engine = Engine.from_config(config)
                if warmup:
                    engine.warmup()
            except Exception as error:
                raise EngineLoadError(
                    f"cannot load the engine (target {config.target.path!r}): {describe(error)}"
                ) from error
            _ENGINES[key] = (engine, threading.Lock())
        engine, lock = _ENGINES[key]
    with lock:
        yield engine


def loaded_engine_count() -> int:
    return len(_ENGINES)
