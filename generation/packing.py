"""bf16 linear weights reordered once into oneDNN's blocked layout, on CPU.

A bf16 `F.linear` on CPU runs oneDNN, which reorders the weight into its blocked layout on
every call: at one decode row that reorder costs about as much as the product. Reordering once
at load and calling the prepacked kernel (what inductor's freezing does) gives bit-identical
results, measured on an Intel Xeon with AVX-512 BF16 and AMX (1 thread, Qwen2.5-Coder 1.5B
bf16): a [1, 1] step 321 -> 226 ms, [8, 1] 395 -> 310 ms; the 0.5B 117 -> 75 ms. The kernel
is a private op that refuses CPUs without AVX512-BW/VL/DQ or AVX-NE-CONVERT, so it is used only
where `kernels.packed_bf16()` ran it; elsewhere bf16 linears stay `nn.Linear`. fp32 is left
alone: its prepacked kernel rounds differently (~1e-4) from the float reference the tests hold
the models to.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from generation import kernels
from generation.phase import in_prefill

log = logging.getLogger("corpusgen.packing")

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

    kernel = kernels.ONEDNN_PACKED_BF16

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.plan: RowPlan | None = None  # a target's: decode calls padded to exact row counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.plan is not None and not in_prefill():
            out = self.plan(rows, self._product)
        else:
            out = with_rows_at_least(PACKED_MIN_ROWS, rows, self._product)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


class Fp32ComputeLinear(nn.Linear):
    """A bf16 draft's linear where oneDNN's bf16 kernels are missing (an AVX2-only CPU): the
    bf16 weights upcast to fp32 once, at load, and every product run by MKL's fp32 GEMM.

    The tokens are those of the bf16 weights; the speed and memory those of fp32 (double the
    bf16 bytes). Measured on an AVX-512 Xeon with packing disabled (bench/README.md): torch's
    native bf16 GEMM, the only bf16 kernel such a CPU has, is a loop of GEMVs, as fast as
    fp32 at one row but 6x slower for a [8, 5] verify and 2x for a prefill; an upcast per
    call costs more than the product. A target's linears are `RowExactLinear` instead.
    """

    kernel = "fp32-compute"

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().float(), requires_grad=False)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(),
                                                           requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight, self.bias).to(x.dtype)


PER_ROW = "fp32-per-row"  # RowExactLinear's fallback: each decode row its own product


def row_exact_kernel() -> str:
    """What a target's fp32-computed linears run on this CPU (barring a shape's own check)."""
    return kernels.ONEDNN_PACKED_FP32 if kernels.packed_fp32().available else PER_ROW


class RowPlan:
    """The row count to call a product with, per decode row count, so that each of the rows
    rounds as it does in a 1-row step: GEMM libraries pick kernels by shape, and some round a
    row by its place in the call (oneDNN's packed bf16 [40 x 8960] x [8960 x 1536] product on
    one thread: 5-15 of 40 rows). Found once per layer shape and thread count (`plan_rows`)."""

    def __init__(self, padded: dict[int, int]):
        self.padded = padded

    def __call__(self, rows: torch.Tensor, product) -> torch.Tensor:
        return with_rows_at_least(self.padded.get(rows.shape[0], 0), rows, product)


_PLANS: dict[tuple, RowPlan | None] = {}


def plan_rows(kind: str, product, in_features: int, out_features: int,
              row_counts: tuple[int, ...], least: int,
              dtype: torch.dtype = torch.float32) -> RowPlan | None:
    """A RowPlan for `product` over the grid's decode row counts, where a 1-row step computes
    `least` rows: each count padded to the fewest rows (up to twice as many) whose every real
    row equals that row alone; None where some count has none. Once per kind, layer shape and
    thread count (oneDNN splits a product by threads)."""
    key = (kind, in_features, out_features, row_counts, least, torch.get_num_threads())
    if key not in _PLANS:
        generator = torch.Generator().manual_seed(0)
        most = max(max(row_counts), least)
        x = torch.randn(2 * most, in_features, generator=generator).to(dtype)
        alone = kernels.rows_alone(product, x, least, most)
        padded: dict[int, int] = {}
        for rows in sorted(row_counts):  # the fewest first: a plan that fails, fails cheaply
            fewest = max(rows, least)
            found = next((n for n in range(fewest, 2 * fewest + 1)
                          if kernels.rows_as_alone(product, x, alone, rows, n)), None)
            if found is None:
                break
            padded[rows] = found
        _PLANS[key] = RowPlan(padded) if len(padded) == len(row_counts) else None
    return _PLANS[key]


def _no_plan(kind: str, linear: nn.Module, instead: str) -> None:
    log.warning("%s rounds rows of a [%d -> %d] linear by their call on this CPU whatever the "
                "padding; this target computes it %s", kind, linear.in_features,
                linear.out_features, instead)


class RowExactLinear(nn.Module):
    """A target's linear computed in fp32 so that a row gets the same bits whatever rows share
    its call: alone or in any batch, in a 1-token decode or a K+1-token verify. That is what
    keeps seeded records independent of batch, draft and K for fp32 targets and for bf16 ones
    on CPUs without oneDNN's bf16 kernels.

    MKL's sgemm (F.linear) picks its kernel by row count (`kernels.rows_round_alike`), so the
    weight goes to oneDNN's prepacked fp32 kernel, with a RowPlan for this layer's shape (a
    1-row step computes 1 row where that rounds as in any other call, with AVX2 code here, else
    2). Where no plan exists, each decode row is its own 1-row product (exact, slower at batch);
    prefills, one prompt per call, keep MKL.
    """

    def __init__(self, linear: nn.Linear, row_counts: tuple[int, ...]):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.packed = self.weight = self.plan = None
        if kernels.packed_fp32().available:
            self.packed = kernels.onednn_packed_fp32(weight)
            self.plan = next((plan for least in (1, 2) if (plan := plan_rows(
                kernels.ONEDNN_PACKED_FP32, self._packed_product, self.in_features,
                self.out_features, row_counts, least)) is not None), None)
        if self.plan is None:
            if self.packed is not None:
                _no_plan(kernels.ONEDNN_PACKED_FP32, self, "one row per product")
            self.packed, self.weight, self.kernel = None, weight, PER_ROW
        else:
            self.kernel = kernels.ONEDNN_PACKED_FP32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        if self.plan is not None:
            out = self.plan(rows, self._packed_product)
        elif in_prefill():
            out = F.linear(rows, self.weight, self.bias)
        else:
            out = torch.cat([F.linear(row[None], self.weight, self.bias) for row in rows])
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _packed_product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kernel}"


def decode_row_counts(batch_sizes: list[int], draft_lengths: list[int]) -> tuple[int, ...]:
    """Every row count a target's decode and verify calls have on this grid."""
    widths = [1] + [k + 1 for k in draft_lengths]
    return tuple(sorted({b * w for b in batch_sizes for w in widths}))


def _swap_bf16_linears(model: nn.Module, make) -> nn.Module:
    """Swap every plain bf16 nn.Linear for make(linear), in place (int8 linears and ones
    already swapped are left alone, so runners sharing one model swap it once)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16:
                setattr(module, name, make(child))
    return model


def pack_linears(model: nn.Module) -> nn.Module:
    return _swap_bf16_linears(model, PackedLinear)


def bf16_linears_for(model: nn.Module, device: torch.device) -> nn.Module:
    """A bf16 draft's linears on this CPU: oneDNN-packed where its probe passed, else
    computed in fp32 (never a crash, and no kernel this CPU lacks)."""
    if device.type != "cpu":
        return model
    if kernels.packed_bf16().available:
        return pack_linears(model)
    return _swap_bf16_linears(model, Fp32ComputeLinear)


def target_linears_for(model: nn.Module, device: torch.device,
                       row_counts: tuple[int, ...]) -> nn.Module:
    """A target's float linears on this CPU, in place, each rounding a row alike in any call:
    bf16 ones oneDNN-packed where that kernel runs (it does), the rest `RowExactLinear`
    (fp32 weights, and bf16 ones on CPUs without it). Int8 and int4 linears are exact already."""
    if device.type != "cpu":
        return model
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) not in (nn.Linear, Fp32ComputeLinear):
                continue
            swapped: nn.Module | None = None
            if child.weight.dtype == torch.bfloat16 and kernels.packed_bf16().available:
                swapped = PackedLinear(child)
                swapped.plan = plan_rows(kernels.ONEDNN_PACKED_BF16, swapped._product,
                                         child.in_features, child.out_features, row_counts,
                                         PACKED_MIN_ROWS, torch.bfloat16)
                if swapped.plan is None:
                    _no_plan(kernels.ONEDNN_PACKED_BF16, child, "in fp32")
                    swapped = None
            if swapped is None and child.weight.is_floating_point():
                swapped = RowExactLinear(child, row_counts)
            if swapped is not None:
                setattr(module, name, swapped)
    return model
