"""One captured graph per grid shape: CUDA graphs behind the same static buckets as HPU graphs.

A forward of a given shape is captured once (CUDA: `torch.cuda.graph`) with static input
buffers; later calls copy their inputs into those buffers and replay, so a decode step costs
one graph launch instead of ~1,700 kernel launches. The KV cache is a fixed set of tensors
the graph reads and writes in place. The capture is injected, so the shape discipline (one
capture per shape, buffers reused, results equal to eager) is testable on CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Capture = Callable[[Callable[[], torch.Tensor]], tuple[torch.Tensor, Callable[[], None]]]


def cuda_capture(forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
    """Capture `forward` as a CUDA graph: (its static output, replay). Warm-up runs on a side
    stream first, as PyTorch's docs require; they rewrite the same cache entries with the
    same values, so they change nothing."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=_shared_pool()):
        output = forward()
    return output, graph.replay


_POOL = None


def _shared_pool():
    """One memory pool for every captured shape: graphs replay one at a time, so they can
    share intermediate buffers."""
    global _POOL
    if _POOL is None:
        _POOL = torch.cuda.graph_pool_handle()
    return _POOL


def replay_in_place(forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
    """The CPU stand-in for a capture, keeping a CUDA graph's contract: static inputs in, one
    static output out. Like `cuda_capture` it runs the forward for real first (its warm-up
    runs do) but leaves the captured output undefined (NaN here) until a replay fills it: a
    capture records kernels, it does not run them."""
    output = torch.full_like(forward(), float("nan"))
    return output, lambda: output.copy_(forward())


def graph_capture(device: torch.device) -> Capture | None:
    """How this device captures graphs: CUDA only (Gaudi has its own HPU graphs)."""
    return cuda_capture if device.type == "cuda" else None


class GraphedForward:
    """`forward(cache=..., **inputs)` served from one capture per input signature.

    The signature is every tensor input's shape and dtype plus every other input's value
    (`attend_len`), so each grid shape gets one graph. The returned logits are the graph's
    static output: valid until this runner's next call, which is how the engine uses them.
    """

    def __init__(self, forward: Callable[..., torch.Tensor], capture: Capture = cuda_capture):
        self.forward, self.capture = forward, capture
        self.graphs: dict[tuple, tuple[dict[str, torch.Tensor], torch.Tensor, Callable]] = {}

    @property
    def captures(self) -> int:
        return len(self.graphs)

    def __call__(self, cache, **inputs) -> torch.Tensor:
        key = tuple(
            (name, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (name, v)
            for name, v in sorted(inputs.items())
        )
        if key not in self.graphs:
            static = {n: v.clone() for n, v in inputs.items() if isinstance(v, torch.Tensor)}
            fixed = {n: v for n, v in inputs.items() if not isinstance(v, torch.Tensor)}
            output, replay = self.capture(lambda: self.forward(cache=cache, **static, **fixed))
            self.graphs[key] = (static, output, replay)
        else:
            static, output, replay = self.graphs[key]
            for name, buffer in static.items():
                buffer.copy_(inputs[name])
        replay()  # after a capture too: capturing ran nothing into `output`
        return output
