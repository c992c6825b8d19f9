"""Lower-precision copies of the target, used as drafts with no extra files."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from generation.model import CausalLM


class Int8WeightOnlyLinear(nn.Module):
    """Per-output-channel symmetric int8 weights; activations stay in bf16.

    Decoding is memory-bound, so reading a quarter of the fp32 bytes is what makes the draft
    fast; on CPU `_weight_int8pack_mm` does the int8 x bf16 product without materialising weights.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp_min(1e-8) / 127.0
        self.register_buffer(
            "weight", (weight / scales[:, None]).round().clamp(-128, 127).to(torch.int8)
        )
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        if flat.device.type == "cpu":
            out = torch._weight_int8pack_mm(flat, self.weight, self.scales)
        else:
            out = F.linear(flat, self.weight.to(flat.dtype) * self.scales[:, None])
        out = out.to(x.dtype).reshape(*x.shape[:-1], -1)
        return out if self.bias is None else out + self.bias


def quantized_copy(model: CausalLM, dtype: str) -> CausalLM:
    """The target at int8 (weight-only) or bf16, as a separate module with its own cache."""
    draft = copy.deepcopy(model)
    if dtype == "bfloat16":
        return draft.to_dtype(torch.bfloat16)
    if draft.config.tie_word_embeddings:  # untie: the head is quantized, the embedding is not
        draft.lm_head.weight = nn.Parameter(draft.lm_head.weight.detach().clone())
    return int8_weight_only(draft)


def int8_weight_only(model: nn.Module) -> nn.Module:
    """Swap every nn.Linear for Int8WeightOnlyLinear, in place (any causal LM, ours or HF's)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8WeightOnlyLinear(child))
    return model
