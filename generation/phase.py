"""Whether a forward is a prefill: exact linears (int8, int4, fp32 one row at a time) run
their dense product there, since a prefill computes one prompt per call and so depends on
nothing but that prompt."""

from __future__ import annotations

import contextlib
import contextvars

_PREFILLING = contextvars.ContextVar("prefilling", default=False)


@contextlib.contextmanager
def prefilling():
    """Marks a prefill forward: exact int8 and int4 linears run the dense product there
    (quantize.py, int4.py, packing.py)."""
    token = _PREFILLING.set(True)
    try:
        yield
    finally:
        _PREFILLING.reset(token)


def in_prefill() -> bool:
    return _PREFILLING.get()
