"""4-bit group-wise weights run by torch's own CPU kernel (`_weight_int4pack_mm_for_cpu`).

A group of G inputs (G in 32..256) shares a scale and a zero: w = (q - 8) * scale + zero,
q in 0..15. The weights come from a GGUF's own 4-bit blocks (gguf_int4.py: Q4_0, Q4_1 and
Q4_K are such groups of 32, so the target keeps the precision it ships in) or are rounded to
the nearest of 16 levels from float weights (min/max per group).

The kernel wants bf16 activations and bf16 scales and zeros (its fp32 variant is a scalar
loop), so the shipped fp32 scales are rounded to bf16 when packed (bench/int4.py measures
what that moves: about what rounding the weights themselves to bf16 does). Its packed layout
depends on the CPU's vector width (64 columns per block with AVX-512, 32 with AVX2), so
weights are packed at load and never stored packed: the cache holds the codes, two to a byte,
and fp32 scales and zeros.

Each output row is a sum over the inputs in one fixed order, whatever the number of rows
(they are tiled 4 at a time, each accumulated alone), so a [b, K + 1] verify reproduces the
[b, 1] steps bit for bit, as a target needs (checked by the probe in kernels.py and by
tests/test_int4.py). The price: the kernel dequantizes the weights once per 4 rows, so its
time grows with the rows. Measured on the AVX-512 Xeon (1 thread, Qwen 1.5B's 1536 x 17920
gate/up): 2.9 ms at 1 row against 6.5 ms for packed bf16, even at 4-8 rows, 44 vs 15 ms at 40
and 130 vs 17 ms at 128. So a prefill runs a bf16 copy of the weights (2 bytes a weight of
memory beside the 4-bit ones, never read while decoding), and a draft, whose rows need not be
exact, runs the copy above DRAFT_KERNEL_ROWS rows as well.

quantize: int4+int8 runs the linears a GGUF does not ship in 4-bit groups (Q5_0, Q6_K, Q8_0)
as int8 per output channel through torch's int8 weight-only kernel (`_weight_int8pack_mm`),
which also sums each row alone: where bf16 computes in fp32 (no AVX-512 BF16) they would
otherwise be held, and read, as fp32. With AVX2 code (1 thread, Qwen 1.5B's LM head) it took
51 ms at 1 row and 69 at 4, where oneDNN's packed fp32 took 77 and 109; from 8 rows on fp32
catches up (162 vs 147 ms), so batch-8 verifies cost more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from generation import kernels
from generation.model import FUSED, CausalLM
from generation.packing import Fp32ComputeLinear
from generation.phase import in_prefill
from generation.quantize import per_channel_int8

log = logging.getLogger("corpusgen.int4")

GROUP_SIZES = (32, 64, 128, 256)  # what the kernel takes
GROUP_SIZE = 32  # a GGUF 4-bit block's size, and the finest (most accurate) group
# A draft's calls wider than this run the bf16 copy. Whole Qwen 1.5B forwards on the AVX-512
# Xeon, int4 over packed bf16: 0.58x the time at [1, 1], 1.08x at [1, 5], 1.68x at [8, 1]
# (bench/results/int4-avx512-2026-12-06.json).
DRAFT_KERNEL_ROWS = 4
DEQUANTIZED_ROWS = 256  # rows dequantized at a time: ~1 MB of fp32, which stays in cache


@dataclass(frozen=True)
class Int4Weights:
    """A [out, in] weight as 4-bit codes and per-group fp32 scales and zeros."""

    codes: torch.Tensor  # uint8 [out, in / 2]: input 2j in the low nibble, 2j + 1 in the high
    scales: torch.Tensor  # float32 [out, in / group]
    zeros: torch.Tensor  # float32 [out, in / group]

    @property
    def group_size(self) -> int:
        return 2 * self.codes.shape[1] // self.scales.shape[1]

    @classmethod
    def from_codes(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> Int4Weights:
        """From one code 0..15 per weight ([out, in], any integer dtype)."""
        q = q.to(torch.uint8)
        return cls(q[:, 0::2] | (q[:, 1::2] << 4), scales.float(), zeros.float())

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Weights:
        """Each group's [min, max] cut into 15 steps, rounded to the nearest level. The scale
        and zero are chosen bf16-representable first and the codes rounded against them, so
        the kernel's bf16 scales add no error of their own."""
        out, inputs = weight.shape
        if inputs % group_size:
            raise ValueError(f"{inputs} inputs are not a whole number of groups of {group_size}")
        groups = weight.detach().float().reshape(out, inputs // group_size, group_size)
        low, high = groups.amin(-1), groups.amax(-1)
        scales = ((high - low) / 15).clamp_min(1e-8).bfloat16().float()
        zeros = (low + 8 * scales).bfloat16().float()
        q = ((groups - zeros[..., None]) / scales[..., None] + 8).round().clamp(0, 15)
        return cls.from_codes(q.reshape(out, inputs), scales, zeros)

    def unpacked(self) -> torch.Tensor:
        """The codes, one per weight: uint8 [out, in]."""
        return torch.stack([self.codes & 15, self.codes >> 4], dim=-1).flatten(1)

    def multiplied(self, dtype: torch.dtype) -> torch.Tensor:
        """[out, in] in `dtype`: the values the kernel multiplies (its scales bf16)."""
        return self.dequantized(torch.bfloat16, dtype)

    def dequantized(
        self, scale_dtype: torch.dtype = torch.float32, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """[out, in] in `dtype`: (q - 8) * scale + zero in fp32, the scales and zeros first
        rounded to `scale_dtype` (bf16: the values the kernel multiplies). Computed a few
        rows at a time, which stay in cache: 3x faster than whole tensors at load."""
        out, groups = self.scales.shape
        scales = self.scales.to(scale_dtype).float()[..., None]
        zeros = self.zeros.to(scale_dtype).float()[..., None]
        weight = torch.empty(out, groups * self.group_size, dtype=dtype)
        for first in range(0, out, DEQUANTIZED_ROWS):
            rows = slice(first, first + DEQUANTIZED_ROWS)
            codes = self.codes[rows]
            q = torch.stack([codes & 15, codes >> 4], dim=-1).view(len(codes), groups, -1)
            values = torch.addcmul(zeros[rows], q.float().sub_(8), scales[rows])
            weight[rows] = values.view(len(codes), -1)
        return weight

    @staticmethod
    def cat(parts: list[Int4Weights]) -> Int4Weights:
        """Stacked along the outputs (a fused q/k/v or gate/up projection)."""
        return Int4Weights(*(torch.cat([getattr(p, f) for p in parts])
                             for f in ("codes", "scales", "zeros")))


@dataclass(frozen=True)
class Int8Weights:
    """A [out, in] weight as int8 codes with one scale per output channel: what torch's int8
    weight-only kernel multiplies (w = q * scale, bf16 activations)."""

    codes: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # float32 [out], each bf16-representable (the kernel takes bf16)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Weights:
        """Each output channel's largest weight at 127 steps. The scale is rounded to bf16
        first and the codes against it, so the kernel's bf16 scales add no error."""
        return cls(*per_channel_int8(weight.detach().float(), torch.bfloat16))

    def multiplied(self, dtype: torch.dtype) -> torch.Tensor:
        """[out, in] in `dtype`: the values the kernel multiplies (exact in fp32)."""
        return self.codes.to(dtype) * self.scales.to(dtype)[:, None]


class WeightOnlyLinear(nn.Module):
    """A linear whose decode steps run compact weights through one of torch's weight-only
    CPU kernels, each row summed alone (what a target's exactness rests on).

    `dense` holds the same weights dequantized to bf16 (the runner packs it like any bf16
    linear): it runs prefills, and calls wider than `kernel_rows` where that is set (drafts).
    The kernel's tensors are plain attributes, so a dtype cast leaves them alone.
    """

    kernel: str
    probe: Callable[[], kernels.Probe]

    def __init__(self, linear: nn.Linear, dense: torch.Tensor, kernel_rows: int | None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel_rows = kernel_rows
        self.dense = nn.Linear(self.in_features, self.out_features, bias=linear.bias is not None,
                               device="meta")
        self.dense.weight = nn.Parameter(dense, requires_grad=False)
        if linear.bias is not None:
            self.dense.bias = nn.Parameter(linear.bias.detach().bfloat16(), requires_grad=False)
        self.bias = None if linear.bias is None else linear.bias.detach().bfloat16()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        wide = self.kernel_rows is not None and rows.shape[0] > self.kernel_rows
        if in_prefill() or wide:
            return self.dense(x)
        out = self._product(rows.bfloat16().contiguous())
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kernel}"


class Int4Linear(WeightOnlyLinear):
    """4-bit groups through `_weight_int4pack_mm_for_cpu`."""

    kernel, probe = kernels.INT4PACK_MM, staticmethod(kernels.int4pack_mm)

    def __init__(self, linear: nn.Linear, weights: Int4Weights, kernel_rows: int | None):
        if weights.group_size not in GROUP_SIZES or linear.out_features % 16:
            raise ValueError(
                f"the int4 kernel takes groups of {GROUP_SIZES} and outputs in multiples of 16, "
                f"not groups of {weights.group_size} and {linear.out_features} outputs"
            )
        super().__init__(linear, weights.multiplied(torch.bfloat16), kernel_rows)
        self.group_size = weights.group_size
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            weights.unpacked().int(), 1  # innerKTiles: read by the CUDA layout only
        )
        self.scales_and_zeros = torch.stack([weights.scales, weights.zeros], dim=-1) \
            .transpose(0, 1).contiguous().bfloat16()  # [in / group, out, 2]

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed, self.group_size, self.scales_and_zeros
        )


class Int8WeightOnlyLinear(WeightOnlyLinear):
    """int8 weights, a scale per output channel, through `_weight_int8pack_mm`."""

    kernel, probe = kernels.INT8PACK_MM, staticmethod(kernels.int8pack_mm)

    def __init__(self, linear: nn.Linear, weights: Int8Weights, kernel_rows: int | None):
        super().__init__(linear, weights.multiplied(torch.bfloat16), kernel_rows)
        self.codes, self.scales = weights.codes, weights.scales.bfloat16()

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scales)


def linear_names(model: CausalLM) -> list[str]:
    """Our decoder's float linears by module name (fused projections included; not the bf16
    copies inside weight-only linears)."""
    modules = dict(model.named_modules())
    return [name for name, module in modules.items() if type(module) is nn.Linear
            and not isinstance(modules[name.rpartition(".")[0]], WeightOnlyLinear)]


def hf_parts(name: str, tied: bool) -> list[str]:
    """The Hugging Face weights a linear of ours holds, in its output order."""
    if name == "lm_head":
        return ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    for fused, parts in FUSED.items():
        if name.endswith(fused):
            prefix = name.removesuffix(fused)
            return [f"{prefix}{part}.weight" for part in parts]
    return [f"{name}.weight"]


def int4_weights_of(
    model: CausalLM, shipped: dict[str, Int4Weights] | None
) -> dict[str, Int4Weights]:
    """Our linears' 4-bit weights by module name: from `shipped` (a GGUF's 4-bit tensors by
    Hugging Face name), for the linears whose every part was shipped in 4 bits (the rest stay
    as they are); else rounded from the model's weights, every linear."""
    tied = model.config.tie_word_embeddings
    modules = dict(model.named_modules())
    found: dict[str, Int4Weights] = {}
    for name in linear_names(model):
        if shipped is None:
            found[name] = Int4Weights.from_float(modules[name].weight)
            continue
        parts = hf_parts(name, tied)
        if all(part in shipped for part in parts):
            found[name] = Int4Weights.cat([shipped[part] for part in parts])
    if shipped is not None:
        kept = sum(modules[n].weight.numel() for n in linear_names(model) if n not in found)
        total = sum(modules[n].weight.numel() for n in linear_names(model))
        log.log(logging.INFO if found else logging.WARNING,
                "int4: %d of %d linears from the GGUF's 4-bit blocks; %.0f%% of linear "
                "weights not 4-bit there (bf16, or int8 per channel with int4+int8)", len(found),
                len(linear_names(model)), 100 * kept / total)
    return found


def int8_weights_of(model: CausalLM, int4: dict[str, Int4Weights]) -> dict[str, Int8Weights]:
    """The float linears `int4` leaves (a GGUF's Q5_0, Q6_K and Q8_0 tensors) rounded to int8
    per output channel, by module name."""
    modules = dict(model.named_modules())
    return {name: Int8Weights.from_float(modules[name].weight)
            for name in linear_names(model) if name not in int4}


def weight_only_linears(
    model: CausalLM, weights: dict[str, Int4Weights | Int8Weights], device: torch.device,
    kernel_rows: int | None = None,
) -> CausalLM:
    """Swap the named linears for weight-only ones (4-bit or int8 by their weights), in place,
    after the model's dtype cast (a tied embedding keeps its float weights: the LM head module
    is replaced, not its weight).

    Where a kernel cannot run (its probe failed, or not a CPU) a linear computes the very
    values the kernel would multiply in fp32: the quantized model's tokens at fp32 speed and
    memory, as bf16 weights fall back on a CPU without oneDNN's bf16."""
    for name, compact in weights.items():
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        linear = getattr(owner, child)
        kind = Int4Linear if isinstance(compact, Int4Weights) else Int8WeightOnlyLinear
        if device.type == "cpu" and kind.probe().available:
            swapped: nn.Module = kind(linear, compact, kernel_rows)
        else:
            swapped = Fp32ComputeLinear(linear)  # its bias, in fp32
            swapped.weight = nn.Parameter(compact.multiplied(torch.float32).to(device),
                                          requires_grad=False)
        setattr(owner, child, swapped)
    return model


def int4_draft(model: CausalLM, device: torch.device) -> CausalLM:
    """A draft, in place: its float linears rounded to 4 bits (groups of 32), bf16 elsewhere;
    calls wider than DRAFT_KERNEL_ROWS run the bf16 copies."""
    weights = int4_weights_of(model, None)
    return weight_only_linears(model.to_dtype(torch.bfloat16), weights, device, DRAFT_KERNEL_ROWS)
