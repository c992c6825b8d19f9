"""Which linear kernels this process may use, decided once by trying each fast path.

A CPU's flag list does not say what a torch build's kernels need: oneDNN's prepacked bf16
linear refuses CPUs without AVX512-BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only AMD EPYC), and
fbgemm's int8 kernels need AVX2. So each fast path is run once on a tiny tensor and compared
with the public reference before it is trusted; where the probe fails, the engine uses the
public fallback (bf16 `F.linear`), or refuses with the missing feature named where nothing
fits (an int8 draft without fbgemm). The choice is logged once with its reason, and every
shard's metrics name the kernels its engine ran (`cpu_kernels`) and the CPU (`cpu_model`,
`cpu_isa`).

`CORPUSGEN_DISABLE_KERNELS` (comma-separated names from FAST_PATHS) turns fast paths off as
if their probe had failed: the fallbacks run in `make test` on any CPU, and a user can rule out
a kernel without a code change.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger("corpusgen.kernels")

DISABLE_ENV = "CORPUSGEN_DISABLE_KERNELS"
ONEDNN_PACKED_BF16 = "onednn-packed-bf16"  # private op, prepacked once: measured faster
FBGEMM_INT8 = "fbgemm-int8"  # dynamic W8A8 linears of int8 drafts
INT_MM = "int-mm"  # exact int8 x int8 -> int32 GEMM of int8 targets
FBGEMM_INT8_ROWS = "fbgemm-int8-rows"  # the same, in fbgemm: activations per row, 7-bit weights
FBGEMM_INT8_WHOLE = "fbgemm-int8-whole"  # fbgemm-int8-rows with 8-bit weights (int32 pair sums)
INT4PACK_MM = "int4pack-mm"  # 4-bit group-wise weights x bf16 rows, each row alone
INT8PACK_MM = "int8pack-mm"  # int8 per-channel weights x bf16 rows, each row alone
ONEDNN_PACKED_FP32 = "onednn-packed-fp32"  # a target's fp32 linears: one rounding from 2 rows on
FAST_PATHS = (ONEDNN_PACKED_BF16, FBGEMM_INT8, FBGEMM_INT8_ROWS, FBGEMM_INT8_WHOLE, INT_MM,
              INT4PACK_MM, INT8PACK_MM, ONEDNN_PACKED_FP32)


class KernelUnavailable(RuntimeError):
    """No kernel this CPU and torch build can run fits the requested weights."""


@dataclass(frozen=True)
class Probe:
    available: bool
    reason: str  # why it is (or is not) used, in words for the log and errors


def disabled_paths() -> set[str]:
    names = {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}
    unknown = names - set(FAST_PATHS)
    if unknown:
        raise ValueError(
            f"{DISABLE_ENV} names unknown kernels {sorted(unknown)}; known: {', '.join(FAST_PATHS)}"
        )
    return names


PROBES: list = []  # every probe function, so `disabled` can make them ask afresh


def _probe(function):
    cached = functools.cache(function)
    PROBES.append(cached)
    return cached


@contextlib.contextmanager
def disabled(*names: str) -> Iterator[None]:
    """The body runs as if these fast paths had failed their probes (for side-by-side
    benchmarks and tests); the environment and every probe are restored afterwards."""
    before = os.environ.get(DISABLE_ENV)
    os.environ[DISABLE_ENV] = ",".join(sorted(disabled_paths() | set(names)))
    for probe in PROBES:
        probe.cache_clear()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(DISABLE_ENV, None)
        else:
            os.environ[DISABLE_ENV] = before
        for probe in PROBES:
            probe.cache_clear()


def _tried(name: str, attempt) -> Probe:
    """Run `attempt` (True when its result matched the reference) unless disabled."""
    if name in disabled_paths():
        return Probe(False, f"disabled by {DISABLE_ENV}")
    try:
        matched = attempt()
    except Exception as error:  # the kernel's own refusal names the missing CPU feature
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return Probe(False, first_line[:300])
    if not matched:
        return Probe(False, "its probe's result differed from the reference")
    return Probe(True, "probe passed")


def _reported(name: str, probe: Probe) -> Probe:
    level = logging.INFO if probe.available else logging.WARNING
    verdict = "used" if probe.available else "unavailable, using the fallback"
    log.log(level, "kernel %s %s (%s); CPU: %s", name, verdict, probe.reason, cpu_summary())
    return probe


def _tiny(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=generator).to(dtype)
    weight = torch.randn(16, 32, generator=generator).to(dtype)
    return x, weight


@_probe
def packed_bf16() -> Probe:
    """oneDNN's prepacked bf16 linear (torch.ops.mkldnn, private): the weight reordered once
    instead of on every call."""

    def attempt() -> bool:
        ops = torch.ops.mkldnn
        if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")):
            raise RuntimeError("this torch build has no oneDNN prepacked linear")
        x, weight = _tiny(torch.bfloat16)
        packed = ops._reorder_linear_weight(weight, 1)
        out = ops._linear_pointwise(x, packed, None, "none", [], "")
        return torch.equal(out, F.linear(x, weight))

    return _reported(ONEDNN_PACKED_BF16, _tried(ONEDNN_PACKED_BF16, attempt))


def fbgemm_prepack(
    weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.ScriptObject:
    """fbgemm's packed form of int8 weights [out, in] with per-output-channel fp32 scales."""
    with warnings.catch_warnings():  # quantized tensors are deprecated, their kernels are not
        warnings.simplefilter("ignore")
        zero = torch.zeros(len(scales), dtype=torch.long)
        per_channel = torch._make_per_channel_quantized_tensor(weight, scales.double(), zero, 0)
        return torch.ops.quantized.linear_prepack(per_channel, bias)


@_probe
def fbgemm_int8() -> Probe:
    """fbgemm's dynamic int8 linear (per-channel int8 weights, activations quantized per call)."""

    def attempt() -> bool:
        if not any(e in ("fbgemm", "x86") for e in torch.backends.quantized.supported_engines):
            raise RuntimeError("this torch build has no fbgemm quantized engine")
        x, weight = _tiny(torch.float32)
        scales = weight.abs().amax(1) / 127
        quantized = (weight / scales[:, None]).round().to(torch.int8)
        out = torch.ops.quantized.linear_dynamic(x, fbgemm_prepack(quantized, scales, None), True)
        reference = F.linear(x, quantized.float() * scales[:, None])
        return bool(torch.allclose(out, reference, atol=0.1 * float(reference.abs().max())))

    return _reported(FBGEMM_INT8, _tried(FBGEMM_INT8, attempt))


ROW_CODE_LIMIT = 126  # activation codes of an exact int8 linear: [-126, 126], a scale per row
SEVEN_BIT_WEIGHTS = 64  # its weight codes where int16 pair sums must not saturate: [-64, 64]
EIGHT_BIT_WEIGHTS = 127  # ... where the CPU sums u8 x s8 pairs in int32 (AVX-512 VNNI)
CODE_ZERO_POINT = 128  # an activation code is stored as an unsigned 2..254
WEIGHT_CODE_LIMITS = {  # each exact int8 kernel: the widest weight codes it sums exactly
    FBGEMM_INT8_WHOLE: EIGHT_BIT_WEIGHTS, FBGEMM_INT8_ROWS: SEVEN_BIT_WEIGHTS,
    INT_MM: EIGHT_BIT_WEIGHTS,
}


def fbgemm_int8_rows(codes: torch.Tensor, packed: torch.ScriptObject) -> torch.Tensor:
    """Rows of integer activation codes (fp32 holding [-126, 126]) times fbgemm-packed weight
    codes (`WEIGHT_CODE_LIMITS`), each row's sum exact in int32, then times the weights'
    scales: [rows, out] fp32.

    fbgemm takes activations as unsigned 8-bit numbers with a scale and zero point given per
    call (here 1 and a zero point: the codes themselves). Where it sums u8 x s8 products in
    int32 (AVX-512 VNNI: `fbgemm_int8_whole`) the weights keep 8 bits. Its AVX2 code adds pairs
    of products in int16 and saturates past 32767, which 8-bit weights reach (254 x 127 x 2);
    there the weights keep 7 bits and a sign (254 x 64 x 2 = 32512 fits). Either way the sums
    are integers, so a row's result is independent of the call's other rows."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        codes, 1.0, CODE_ZERO_POINT, packed)


def fbgemm_int8_rows_kernel() -> str:
    """What fbgemm_int8_rows runs here: 8-bit weights where int32 sums allow, else 7-bit."""
    return FBGEMM_INT8_WHOLE if fbgemm_int8_whole().available else FBGEMM_INT8_ROWS


def _sums_exactly(
    product: Callable[[torch.Tensor, torch.ScriptObject], torch.Tensor],
    limit: int,
) -> bool:
    """`product` of codes and packed weights in [-limit, limit] equals the integer product at
    its extremes (codes +-126 times weights +-limit, where int16 pair sums come closest to
    saturating) and on random codes, in calls of a few rows and of a prefill's many, and a row
    alone equals the same row among others."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.randint(-limit, limit + 1, (32, 64), generator=generator, dtype=torch.int8)
    weights[0], weights[1] = limit, -limit
    scales = torch.rand(32, generator=generator) / 100 + 1e-3
    codes = torch.randint(-126, 127, (48, 64), generator=generator).float()
    codes[0], codes[1] = ROW_CODE_LIMIT, -ROW_CODE_LIMIT
    packed = fbgemm_prepack(weights, scales, None)
    out = product(codes, packed)
    integer = codes.double() @ weights.double().t() * scales.double()
    close = torch.allclose(out.double(), integer, rtol=1e-6, atol=1e-6)
    return close and all(torch.equal(product(codes[:rows], packed), out[:rows])
                         for rows in (1, 2, 6))


@_probe
def fbgemm_int8_rows_exact() -> Probe:
    """fbgemm_int8_rows sums 7-bit weights exactly (int8 targets' kernel wherever fbgemm runs)."""
    return _reported(FBGEMM_INT8_ROWS, _tried(
        FBGEMM_INT8_ROWS, lambda: _sums_exactly(fbgemm_int8_rows, SEVEN_BIT_WEIGHTS)))


@_probe
def fbgemm_int8_whole() -> Probe:
    """fbgemm_int8_rows sums 8-bit weights exactly too (int32 pair sums: AVX-512 VNNI)."""

    def attempt() -> bool:
        if not fbgemm_int8_rows_exact().available:
            raise RuntimeError(f"{FBGEMM_INT8_ROWS} is unavailable")
        if not _sums_exactly(fbgemm_int8_rows, EIGHT_BIT_WEIGHTS):
            raise RuntimeError("fbgemm adds pairs of u8 x s8 products in int16 on this CPU (no "
                               "AVX-512 VNNI) and saturates 8-bit weights; they keep 7 bits")
        return True

    return _reported(FBGEMM_INT8_WHOLE, _tried(FBGEMM_INT8_WHOLE, attempt))


@_probe
def int_mm() -> Probe:
    """torch._int_mm on CPU: int8 x int8 summed exactly in int32."""

    def attempt() -> bool:
        generator = torch.Generator().manual_seed(0)
        a = torch.randint(-127, 128, (4, 32), generator=generator, dtype=torch.int8)
        b = torch.randint(-127, 128, (32, 16), generator=generator, dtype=torch.int8)
        return torch.equal(torch._int_mm(a, b), a.int() @ b.int())

    return _reported(INT_MM, _tried(INT_MM, attempt))


def _close_and_row_exact(
    product: Callable[[torch.Tensor], torch.Tensor], weight: torch.Tensor,
    generator: torch.Generator,
) -> bool:
    """A weight-only kernel's probe: `product` of 5 bf16 rows is close to their fp32 product
    with `weight` ([in, out], the values it multiplies), and its last row computed alone is bit
    for bit the same as among the others (what a target's exactness rests on)."""
    x = torch.randn(5, weight.shape[0], generator=generator).bfloat16()
    out = product(x)
    reference = x.float() @ weight
    close = torch.allclose(out.float(), reference, atol=0.02 * float(reference.abs().max()))
    return close and torch.equal(product(x[4:]), out[4:])


@_probe
def int4pack_mm() -> Probe:
    """torch's int4 weight-only CPU kernel (aten._weight_int4pack_mm_for_cpu): its result
    matches the dequantized weights', and a row computed alone equals the same row computed
    among others (what an int4 target's exactness rests on)."""

    def attempt() -> bool:
        generator = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 16, (16, 64), generator=generator, dtype=torch.int32)
        scales = torch.rand(2, 16, generator=generator) / 10 + 0.01  # [in / 32, out]
        zeros = torch.randn(2, 16, generator=generator) / 10
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).bfloat16()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        per_input = scales_and_zeros.float().repeat_interleave(32, dim=0)  # [in, out, 2]
        weight = (codes.t() - 8) * per_input[..., 0] + per_input[..., 1]  # [in, out]
        return _close_and_row_exact(
            lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros),
            weight, generator)

    return _reported(INT4PACK_MM, _tried(INT4PACK_MM, attempt))


@_probe
def int8pack_mm() -> Probe:
    """torch's int8 weight-only CPU kernel (aten._weight_int8pack_mm: int8 weights with a
    scale per output channel, bf16 rows): its result matches the dequantized weights', and a
    row computed alone equals the same row among others (as for int4pack_mm)."""

    def attempt() -> bool:
        generator = torch.Generator().manual_seed(0)
        codes = torch.randint(-127, 128, (16, 64), generator=generator, dtype=torch.int8)
        scales = (torch.rand(16, generator=generator) / 100 + 1e-3).bfloat16()
        weight = (codes.float() * scales.float()[:, None]).t()  # [in, out]
        return _close_and_row_exact(
            lambda x: torch.ops.aten._weight_int8pack_mm(x, codes, scales), weight, generator)

    return _reported(INT8PACK_MM, _tried(INT8PACK_MM, attempt))


def rows_as_alone(
    product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, alone: list[torch.Tensor],
    rows: int, padded: int,
) -> bool:
    """Whether the first `rows` rows of a call of `padded` rows of x get the bits `alone` holds
    for them (each row computed at the start of a call of the fewest rows)."""
    out = product(x[:padded])
    return all(torch.equal(out[row], alone[row]) for row in range(rows))


def rows_alone(
    product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, fewest: int, count: int
) -> list[torch.Tensor]:
    """Each of the first `count` rows of x computed at the start of a call of `fewest` rows."""
    return [product(x[row : row + fewest])[0] for row in range(count)]


def rows_round_alike(
    product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, row_counts: Sequence[int]
) -> bool:
    """Whether `product` gives every row of a call of any of `row_counts` rows the bits that
    row gets at the start of a call of the fewest rows. A GEMM library picks its kernel, and
    so its summation order, by the call's shape: MKL's sgemm has a GEMV for 1 row and other
    kernels for 2-15 and 16+ rows on AVX-512, for 1, 2, 3, 4-48 and 64+ with AVX2 code, which
    would make a record depend on its batch."""
    alone = rows_alone(product, x, min(row_counts), max(row_counts))
    return all(rows_as_alone(product, x, alone, rows, rows) for rows in row_counts)


PROBE_ROWS = (2, 3, 4, 5, 8, 15, 16, 40, 56, 72)  # 1 + K and (1 + K) * batch of usual grids
# oneDNN's batch-size hint for the packed fp32 layout. Measured on the Xeon, 1 thread, Qwen
# 1.5B's five linear shapes: with 64, 2 rows cost what MKL's GEMV costs for 1 (83.7 vs 79.1 ms
# with AVX-512 code, 104 ms at hint 1) and with AVX2 code 1 row rounds as 2-72 do.
FP32_ROWS_HINT = 64


def onednn_packed_fp32(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, FP32_ROWS_HINT)


@_probe
def packed_fp32() -> Probe:
    """oneDNN's prepacked fp32 linear: close to F.linear, and from 2 rows on one rounding
    whatever the row count (measured at 2-72 rows with AVX-512 and with AVX2), where MKL's
    sgemm behind F.linear changes kernel with the rows in the call."""

    def attempt() -> bool:
        ops = torch.ops.mkldnn
        if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")):
            raise RuntimeError("this torch build has no oneDNN prepacked linear")
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 256, generator=generator)
        x = torch.randn(PROBE_ROWS[-1] + PROBE_ROWS[0], 256, generator=generator)
        packed = onednn_packed_fp32(weight)

        def product(rows: torch.Tensor) -> torch.Tensor:
            return ops._linear_pointwise(rows, packed, None, "none", [], "")

        close = torch.allclose(product(x[:5]), F.linear(x[:5], weight), rtol=1e-4, atol=1e-4)
        return close and rows_round_alike(product, x, PROBE_ROWS)

    return _reported(ONEDNN_PACKED_FP32, _tried(ONEDNN_PACKED_FP32, attempt))


def require(probe: Probe, what: str, instead: str) -> None:
    """Refuse `what` naming why its kernel is missing and what to use `instead`."""
    if not probe.available:
        raise KernelUnavailable(
            f"{what} needs a kernel this CPU/torch lacks ({probe.reason}; CPU: {cpu_summary()}); "
            f"{instead}"
        )


# ---- the CPU, as metrics and bench results name it ------------------------------------------

ISA_PROBES = {  # torch asks cpuid itself, so these hold under an emulated CPU too
    "avx2": "_is_avx2_supported",
    "avx512": "_is_avx512_supported",
    "avx512_vnni": "_is_vnni_supported",
    "avx512_bf16": "_is_avx512_bf16_supported",
    "amx": "_is_amx_tile_supported",
    "amx_fp16": "_is_amx_fp16_supported",
}


@functools.cache
def cpu_model() -> str:
    """The model name with its x86 family / model numbers: a virtual machine often shows a
    generic name ("Intel(R) Xeon(R) Processor") that only the numbers tell apart."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


@functools.cache
def cpu_isa() -> str:
    """torch's vector ISA level and the extensions that matter here, e.g.
    `AVX512 avx2 avx512 avx512_vnni avx512_bf16 amx`."""
    found = [name for name, probe in ISA_PROBES.items()
             if getattr(torch.cpu, probe, lambda: False)()]
    return " ".join([torch.backends.cpu.get_cpu_capability(), *found])


def cpu_summary() -> str:
    return f"{cpu_model()}, {cpu_isa()}"


# What an AVX2-only CPU makes each library do, asked of the libraries themselves: torch's own
# kernels, MKL and oneDNN each run their AVX2 code, and oneDNN refuses its bf16 kernels. Set
# in the environment before torch loads, they give an AVX2 CPU's kernel paths on any x86 CPU.
AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "ONEDNN_MAX_CPU_ISA": "AVX2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"}


def hardware() -> dict[str, str]:
    """What a benchmark result or a metrics row records about the machine."""
    return {
        "cpu_model": cpu_model(),
        "cpu_isa": cpu_isa(),
        "torch_version": torch.__version__,
    }


def linear_kernels(model: torch.nn.Module) -> str:
    """The kernels a model's linears run, e.g. `onednn-packed-bf16` or `aten-float32+int-mm`:
    a module's `kernel` attribute, else torch's own F.linear at the weight's dtype."""
    names = {
        getattr(module, "kernel", None) or f"aten-{str(module.weight.dtype).removeprefix('torch.')}"
        for module in model.modules()
        if isinstance(module, torch.nn.Linear) or hasattr(module, "kernel")
    }
    return "+".join(sorted(names))
