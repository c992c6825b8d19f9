"""Device selection and the few device-specific calls; Gaudi's runtime is imported lazily.

Gaudi (habana_frameworks, from Intel's Gaudi software stack, not PyPI) runs in lazy mode: ops
accumulate until `mark_step()`, which the runner calls once per forward. HPU graphs capture a
whole static-shape forward and replay it, which is why every forward here is padded to the grid.
"""

from __future__ import annotations

import importlib.util

import torch


def hpu_available() -> bool:
    if importlib.util.find_spec("habana_frameworks") is None:
        return False
    import habana_frameworks.torch.hpu as hthpu

    return hthpu.is_available()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if hpu_available():
            return torch.device("hpu")
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "hpu" and not hpu_available():
        raise RuntimeError(
            "device='hpu' but habana_frameworks is not installed or sees no Gaudi card"
        )
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' but torch sees no CUDA device")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work so host timers measure the device."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "hpu":
        import habana_frameworks.torch.hpu as hthpu

        hthpu.synchronize()


def mark_step(device: torch.device) -> None:
    """End a lazy-mode step on Gaudi (a no-op elsewhere)."""
    if device.type == "hpu":
        import habana_frameworks.torch.core as htcore

        htcore.mark_step()


def wrap_in_hpu_graph(module: torch.nn.Module) -> torch.nn.Module:
    """Capture the module's forward as HPU graphs, one per input shape, replayed thereafter."""
    import habana_frameworks.torch.hpu as hthpu

    return hthpu.wrap_in_hpu_graph(module)
