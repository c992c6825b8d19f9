"""Int8 weights for drafts: a lower-precision copy of the target, or a draft model's own."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from generation.model import CausalLM


def _fbgemm_available() -> bool:
    return any(engine in ("fbgemm", "x86") for engine in torch.backends.quantized.supported_engines)


DENSE_ROWS = 256  # more rows than this per call: a dense GEMM beats fbgemm's int8 kernel


class Int8Linear(nn.Module):
    """Per-output-channel symmetric int8 weights (a quarter of the fp32 bytes).

    On x86 CPUs the product runs in fbgemm's int8 kernel with activations quantized per call
    (dynamic W8A8): measured here 4x faster than fp32 at 8 rows and 5-10x on the LM head, where
    the weight-only int8 x bf16 kernel is a GEMV that loses at batch > 1. Past DENSE_ROWS rows
    (a prefill) fbgemm falls far behind a bf16/fp32 GEMM (29 ms vs 9 ms for 1024 x 896 x 4864
    here, dequantizing included), so the weights are dequantized per call there, as they are
    off x86. Drafts only: its activations' scale spans the batch, so a row's result depends on
    its neighbours; the verifier keeps the target's tokens exact whatever the draft proposes.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp_min(1e-8) / 127.0
        quantized = (weight / scales[:, None]).round().clamp(-128, 127).to(torch.int8)
        self.register_buffer("weight", quantized)
        self.register_buffer("scales", scales)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        self.packed = None
        if weight.device.type == "cpu" and _fbgemm_available():
            with warnings.catch_warnings():  # quantized tensors are deprecated, their kernels not
                warnings.simplefilter("ignore")
                zero = torch.zeros(len(scales), dtype=torch.long)
                per_channel = torch._make_per_channel_quantized_tensor(
                    quantized, scales.double(), zero, 0
                )
                bias = None if self.bias is None else self.bias.detach().float()  # fbgemm: fp32
                self.packed = torch.ops.quantized.linear_prepack(per_channel, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.device.type == "cpu" and x[..., 0].numel() <= DENSE_ROWS:
            flat = x.reshape(-1, x.shape[-1]).float()
            out = torch.ops.quantized.linear_dynamic(flat, self.packed, True)
            return out.to(x.dtype).reshape(*x.shape[:-1], -1)
        return F.linear(x, self.weight.to(x.dtype) * self.scales[:, None].to(x.dtype), self.bias)


def quantized_copy(model: CausalLM, dtype: str) -> CausalLM:
    """The target at int8 or bf16, as a separate module with its own cache."""
    draft = copy.deepcopy(model)
    if dtype == "bfloat16":
        return draft.to_dtype(torch.bfloat16)
    return int8_weights(draft)


def int8_weights(model: CausalLM) -> CausalLM:
    """Our causal LM with int8 linears, in place; a tied head gets its own int8 copy."""
    if model.config.tie_word_embeddings:  # untie: the head is quantized, the embedding is not
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    return int8_linears(model)


def int8_linears(model: nn.Module) -> nn.Module:
    """Swap every nn.Linear for Int8Linear, in place (any causal LM, ours or HF's)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child))
    return model
