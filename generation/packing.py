"""bf16 linear weights reordered once into oneDNN's blocked layout, on CPU.

A bf16 `F.linear` on CPU runs oneDNN, which reorders the weight into its blocked layout on
every call: at one decode row that reorder costs about as much as the product. Reordering once
at load and calling the prepacked kernel (what inductor's freezing does) gives bit-identical
results, measured here (1 thread, Qwen2.5-Coder 1.5B bf16): a [1, 1] step 321 -> 226 ms,
[8, 1] 395 -> 310 ms; the 0.5B 117 -> 75 ms. fp32 is left alone: its prepacked kernel rounds
differently (~1e-4) from the float reference the tests hold the models to.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def packing_applies(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


# oneDNN's bf16 product below 4 rows is its slow path (1 thread, Qwen 1.5B shapes, ms at 1 / 4
# rows: 1536x17920 3.8 / 3.3, the 151,936-row LM head 26.5 / 21.1): a decode step at batch 1
# computes 4 rows and keeps 1.
PACKED_MIN_ROWS = 4


def with_rows_at_least(
    minimum: int, rows: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """product(rows), with zero rows appended up to `minimum` and dropped from the result: for
    kernels that refuse, or run slower at, few rows. Each row is computed on its own."""
    needed = minimum - rows.shape[0]
    if needed <= 0:
        return product(rows)
    return product(torch.cat([rows, rows.new_zeros(needed, rows.shape[1])]))[: rows.shape[0]]


class PackedLinear(nn.Module):
    """An nn.Linear whose weight lives in oneDNN's layout (an opaque tensor: no deepcopy, no
    state_dict; pack after every copy of the model is made)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = with_rows_at_least(PACKED_MIN_ROWS, x.reshape(-1, self.in_features), self._product)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


def pack_linears(model: nn.Module) -> nn.Module:
    """Swap every plain bf16 nn.Linear for a PackedLinear, in place (int8 linears are left
    alone; packed ones too, so runners sharing one model pack it once)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16:
                setattr(module, name, PackedLinear(child))
    return model
