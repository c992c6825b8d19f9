"""Int8 weights. For drafts (a copy of the target, or a draft model's own): fbgemm's fast
dynamic W8A8, batch-dependent. For any model, the target included: an exact integer GEMM with
per-row activation scales, batch-invariant."""

from __future__ import annotations

import copy
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from generation import kernels
from generation.model import CausalLM
from generation.packing import with_rows_at_least
from generation.phase import in_prefill


def per_channel_int8(
    weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (int8 weights, fp32 scales). Each scale is first
    made representable in `scale_dtype` and the weights rounded against it, for a kernel that
    multiplies scales of that dtype."""
    scales = (weight.abs().amax(dim=1).clamp_min(1e-8) / 127.0).to(scale_dtype).float()
    return (weight / scales[:, None]).round().clamp(-128, 127).to(torch.int8), scales


# fbgemm's packed weights are a TorchScript object, which torch.compile cannot put in a graph:
# every Int8Linear split it (the 0.5B draft compiled into 25 graphs, no faster than eager).
# Compiled code calls the kernel through this op instead, naming the weights by a handle.
_PACKED_WEIGHTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


@torch.library.custom_op("corpusgen::fbgemm_int8_linear", mutates_args=())
def _fbgemm_int8_linear(rows: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic(rows, _PACKED_WEIGHTS[handle], True)


@_fbgemm_int8_linear.register_fake
def _(rows: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], out_features)


DENSE_ROWS = 256  # more rows than this per call: a dense GEMM beats fbgemm's int8 kernel


class Int8Linear(nn.Module):
    """Per-output-channel symmetric int8 weights (a quarter of the fp32 bytes).

    On x86 CPUs the product runs in fbgemm's int8 kernel with activations quantized per call
    (dynamic W8A8): measured on an AVX-512 Xeon 4x faster than fp32 at 8 rows and 5-10x on the
    LM head, where the weight-only int8 x bf16 kernel is a GEMV that loses at batch > 1. Past
    DENSE_ROWS rows (a prefill) fbgemm falls far behind a bf16/fp32 GEMM (29 ms vs 9 ms for
    1024 x 896 x 4864 there, dequantizing included), so the weights are dequantized per call
    there, as they are on GPUs and Gaudi. Drafts only: its activations' scale spans the batch,
    so a row's result depends on its neighbours; the verifier keeps the target's tokens exact
    whatever the draft proposes. On a CPU without fbgemm (it needs AVX2) it is refused:
    dequantizing every call would make the draft slower than the float model it came from.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        quantized, scales = per_channel_int8(weight)
        self.register_buffer("weight", quantized)
        self.register_buffer("scales", scales)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        self.packed = None
        if weight.device.type == "cpu":
            kernels.require(
                kernels.fbgemm_int8(), "an int8 draft",
                "use a bfloat16 or float32 draft (draft.dtype / draft.model.dtype), or "
                "draft.kind: prompt_lookup",
            )
            bias = None if self.bias is None else self.bias.detach().float()  # fbgemm: fp32
            self.packed = kernels.fbgemm_prepack(quantized, scales, bias)
            self._register_packed()

    def __setstate__(self, state: dict) -> None:
        """A deep copy packs its own weights: register those, not the original's handle."""
        super().__setstate__(state)
        if self.packed is not None:
            self._register_packed()

    def _register_packed(self) -> None:
        self.handle = id(self.packed)
        _PACKED_WEIGHTS[self.handle] = self.packed

    @property
    def kernel(self) -> str:
        return kernels.FBGEMM_INT8 if self.packed is not None else "int8-dequantized"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.device.type == "cpu" and x[..., 0].numel() <= DENSE_ROWS:
            flat = x.reshape(-1, x.shape[-1]).float()
            if torch.compiler.is_compiling():
                out = _fbgemm_int8_linear(flat, self.handle, len(self.scales))
            else:
                out = torch.ops.quantized.linear_dynamic(flat, self.packed, True)
            return out.to(x.dtype).reshape(*x.shape[:-1], -1)
        return F.linear(x, self.weight.to(x.dtype) * self.scales[:, None].to(x.dtype), self.bias)


class ExactInt8Linear(nn.Module):
    """Int8 weights x int8 activations scaled per row, summed exactly in int32.

    A row's result depends on that row alone, never on its neighbours or the call's row count,
    so a [b, K+1] verify reproduces the [b, 1] step: what speculation and seeded sampling need
    of a target. Measured here (1 thread, 1536 x 8960): 1.23 ms vs 1.60 ms bf16 at 1 row,
    1.33 vs 1.65 at 8, 1.85 vs 1.96 at 24; fbgemm's per-call activation scale is faster but
    spans the batch. The integer GEMM is 3x slower than bf16 at prefill sizes (212 vs 70 ms at
    2048 rows), so prefills (`prefilling()`) run dequantized weights in the compute dtype: as
    batch-invariant as that dtype's GEMM, and every decode step stays exact.
    """

    kernel = kernels.INT_MM

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.weight.device.type == "cpu":
            kernels.require(
                kernels.int_mm(), "an int8 target (quantize: int8)",
                "load the target in bfloat16 or float32 (remove quantize)",
            )
        quantized, scales = per_channel_int8(linear.weight.detach().float())
        self.register_buffer("weight_t", quantized.t())  # [in, out] view, as _int_mm wants
        self.register_buffer("scales", scales)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if in_prefill():
            weight = self.weight_t.t().to(x.dtype) * self.scales[:, None].to(x.dtype)
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, weight, bias)
        flat = x.reshape(-1, x.shape[-1]).float()
        scale = flat.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127.0
        rows = (flat / scale).round().clamp(-127, 127).to(torch.int8)
        out = _int_mm(rows, self.weight_t) * (scale * self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


INT_MM_MIN_ROWS = {"cuda": 17}  # CUDA's torch._int_mm refuses 16 rows or fewer


def _int_mm(rows: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """torch._int_mm, with zero rows appended where the device's kernel needs more rows (a
    decode step has 1-8 on CUDA)."""
    minimum = INT_MM_MIN_ROWS.get(rows.device.type, 0)
    return with_rows_at_least(minimum, rows, lambda padded: torch._int_mm(padded, weight_t))


def quantized_copy(model: CausalLM, dtype: str) -> CausalLM:
    """The target at int8 or bf16, as a separate module with its own cache."""
    draft = copy.deepcopy(model)
    if dtype == "bfloat16":
        return draft.to_dtype(torch.bfloat16)
    return int8_weights(draft)


def int8_weights(model: CausalLM, linear: type[nn.Module] = Int8Linear) -> CausalLM:
    """Our causal LM with int8 linears, in place; a tied head gets its own int8 copy."""
    if model.config.tie_word_embeddings:  # untie: the head is quantized, the embedding is not
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    return int8_linears(model, linear)


def int8_linears(model: nn.Module, linear: type[nn.Module] = Int8Linear) -> nn.Module:
    """Swap every nn.Linear for `linear`, in place (any causal LM, ours or HF's)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, linear(child))
    return model
