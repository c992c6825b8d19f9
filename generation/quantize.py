"""Int8 weights. For drafts (a copy of the target, or a draft model's own): fbgemm's fast
dynamic W8A8, batch-dependent. For any model, the target included: an exact integer GEMM with
per-row activation scales, batch-invariant."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from generation import kernels
from generation.model import CausalLM, KVCache
from generation.packing import with_rows_at_least
from generation.phase import in_prefill


def per_channel_int8(
    weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32, limit: int = 127
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (int8 weights in [-limit, limit], fp32 scales). Each
    scale is first made representable in `scale_dtype` and the weights rounded against it, for
    a kernel that multiplies scales of that dtype."""
    scales = (weight.abs().amax(dim=1).clamp_min(1e-8) / limit).to(scale_dtype).float()
    return (weight / scales[:, None]).round().clamp(-limit, limit).to(torch.int8), scales


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


@torch.library.custom_op("corpusgen::fbgemm_int8_rows", mutates_args=())
def _fbgemm_int8_rows(codes: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return kernels.fbgemm_int8_rows(codes, _PACKED_WEIGHTS[handle])


@_fbgemm_int8_rows.register_fake
def _(codes: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return codes.new_empty(codes.shape[0], out_features)


DENSE_ROWS = 256  # more rows than this per call: a dense GEMM beats fbgemm's int8 kernel


class FbgemmPacked(nn.Module):
    """A linear holding fbgemm-packed int8 weights (`packed`, None off CPU), registered by a
    handle so compiled code can name them; a deep copy registers its own."""

    packed: torch.ScriptObject | None

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if self.packed is not None:
            self._register_packed()

    def _register_packed(self) -> None:
        self.handle = id(self.packed)
        _PACKED_WEIGHTS[self.handle] = self.packed


class Int8Linear(FbgemmPacked):
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


class ExactInt8Linear(FbgemmPacked):
    """Int8 weights x int8 activations scaled per row, summed exactly in int32.

    A row's result depends on that row alone, never on its neighbours or the call's row count,
    so a [b, K+1] verify reproduces the [b, 1] step: what speculation and seeded sampling need
    of a target. Where fbgemm's AVX2 code adds pairs of u8 x s8 products in int16 (no AVX-512
    VNNI) the weights keep 7 bits and a sign (`kernels.WEIGHT_CODE_LIMITS`), so whole 8-bit
    activation codes never saturate: one pass over the rows, where 8-bit weights needed each
    code split into two 7-bit halves, twice the rows (a [1, 3] verify of Qwen 1.5B's linears
    cost 1.3x a [1, 1] step, a prefill twice the arithmetic). The 7th bit costs precision
    (`bench/int8_precision.py`: KL to the float model 0.016 against 0.012 for Qwen 1.5B, 0.037
    against 0.017 for SmolLM2), so VNNI CPUs keep 8 bits. Two kernels sum exactly. fbgemm's
    (`kernels.fbgemm_int8_rows`, AVX2 and up) runs every call, prefills included: with AVX2
    code it reads 8960 x 1536 at 1 row in 0.59 ms (torch's int8 weight-only kernel: 1.41 ms).
    Where fbgemm is missing, torch._int_mm (1.23 ms vs 1.60 ms bf16 at 1 row on the AVX-512
    Xeon; it saturates with AVX2 code) runs decode steps, and prefills (`prefilling()`, 212 vs
    70 ms at 2048 rows) dequantize to the compute dtype: as batch-invariant as that dtype's
    GEMM.

    `smoothing` (SmoothQuant's per-input-channel factors, from `smoothing_factors`) moves
    rounding from activations to weights: W * s is quantized and rows are divided by s.
    """

    def __init__(self, linear: nn.Linear, smoothing: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        if smoothing is not None:
            weight = weight * smoothing.to(weight.device)
        self.register_buffer(
            "inverse_smoothing", None if smoothing is None else 1.0 / smoothing.float())
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.packed = None
        on_cpu = linear.weight.device.type == "cpu"
        fbgemm = on_cpu and kernels.fbgemm_int8_rows_exact().available
        self._kernel = kernels.fbgemm_int8_rows_kernel() if fbgemm else kernels.INT_MM
        quantized, scales = per_channel_int8(weight, limit=kernels.WEIGHT_CODE_LIMITS[self._kernel])
        self.register_buffer("scales", scales)
        if fbgemm:
            self.packed = kernels.fbgemm_prepack(quantized, scales, None)
            self._register_packed()
            self.weight_t = None  # fbgemm's packed copy is all it multiplies
            return
        if on_cpu and not kernels.int_mm().available:  # asked only where fbgemm is missing
            kernels.require(
                kernels.Probe(False, f"fbgemm: {kernels.fbgemm_int8_rows_exact().reason}; "
                              f"torch._int_mm: {kernels.int_mm().reason}"),
                "an int8 target (quantize: int8)",
                "load the target in bfloat16 or float32 (remove quantize)",
            )
        self.register_buffer("weight_t", quantized.t())  # [in, out] view, as _int_mm wants

    @property
    def kernel(self) -> str:
        return self._kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inverse_smoothing is not None:
            x = x * self.inverse_smoothing.to(x.dtype)
        if self.packed is None and in_prefill():
            weight = self.weight_t.t().to(x.dtype) * self.scales[:, None].to(x.dtype)
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, weight, bias)
        flat = x.reshape(-1, x.shape[-1]).float()
        scale = flat.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / kernels.ROW_CODE_LIMIT
        codes = (flat / scale).round().clamp(-kernels.ROW_CODE_LIMIT, kernels.ROW_CODE_LIMIT)
        if self.packed is None:
            out = _int_mm(codes.to(torch.int8), self.weight_t) * (scale * self.scales)
        elif torch.compiler.is_compiling():
            out = _fbgemm_int8_rows(codes, self.handle, self.out_features) * scale
        else:
            out = kernels.fbgemm_int8_rows(codes, self.packed) * scale
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kernel}"


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


def int8_weights(
    model: CausalLM, linear: Callable[..., nn.Module] = Int8Linear,
    smoothing: dict[str, torch.Tensor] | None = None,
) -> CausalLM:
    """Our causal LM with int8 linears, in place; a tied head gets its own int8 copy.
    `smoothing`: per-input-channel factors by linear name (ExactInt8Linear's)."""
    if model.config.tie_word_embeddings:  # untie: the head is quantized, the embedding is not
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    return int8_linears(model, lambda name, child: linear(child, smoothing[name])
                        if smoothing else linear(child))


def int8_linears(
    model: nn.Module,
    linear: Callable[[str, nn.Linear], nn.Module] = lambda _, child: Int8Linear(child),
) -> nn.Module:
    """Swap every nn.Linear for `linear(name, child)`, in place (any causal LM, ours or HF's)."""
    for prefix, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, linear(f"{prefix}.{name}" if prefix else name, child))
    return model


SMOOTHING_ALPHA = 0.5  # SmoothQuant's: the rounding split evenly between weights and rows
# What the calibration forward reads: prose and code, as a corpus job's prompts are. Outlier
# channels belong to the model, not the text: calibrated on this repository's README instead,
# SmolLM2's logits moved alike (KL 0.015 against 0.014 from a code file).
CALIBRATION_TEXT = """Rayleigh scattering makes the sky blue: air molecules scatter short
wavelengths of sunlight far more than long ones. Write a haiku about autumn rain.
def merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
Three tips for learning a language: read every day, speak early, review mistakes."""


def smoothing_factors(model: CausalLM, tokens: list[int]) -> dict[str, torch.Tensor]:
    """SmoothQuant's factors for each linear of a float model, from one forward of `tokens`:
    s_j = max|x_j|^a / max|W_:j|^(1-a). Per-row int8 activations give a row's outlier
    channels most of its 126 steps; dividing rows by s and multiplying weights by it first
    evens the channels out. On SmolLM2, KL from its float logits: 0.048 with per-row int8
    activations, 0.017 smoothed, 0.005 for the int8 weights alone (bench/int8_precision.py)."""
    maxima: dict[str, torch.Tensor] = {}

    def record(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            seen = args[0].detach().float().reshape(-1, args[0].shape[-1]).abs().amax(0)
            maxima[name] = torch.maximum(maxima.get(name, seen), seen)
        return hook

    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    hooks = [m.register_forward_pre_hook(record(n)) for n, m in linears.items()]
    try:
        with torch.no_grad():
            known = [t for t in tokens if t < model.config.vocab_size]  # a test's tiny vocab
            forward_all(model, known[: len(model.rope_cos)])  # the positions it has
    finally:
        for hook in hooks:
            hook.remove()
    return {name: (maxima[name].clamp_min(1e-5) ** SMOOTHING_ALPHA
                   / linear.weight.detach().float().abs().amax(0).clamp_min(1e-5)
                   ** (1 - SMOOTHING_ALPHA)).cpu()
            for name, linear in linears.items()}


def forward_all(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    """One causal forward of `tokens` into a throwaway cache; the logits of every token (the
    LM head sees every position, as the other linears do)."""
    embedding = model.model.embed_tokens.weight
    device, length = embedding.device, len(tokens)
    cache = KVCache(model.config, 2, length, embedding.dtype, device)
    positions = torch.arange(length, device=device)[None]
    return model(
        torch.tensor([tokens], device=device), positions, torch.tensor([0], device=device),
        torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None],
        positions, cache, 0,
    )
