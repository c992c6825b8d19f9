"""Do 4-bit weights (quantize: int4) pay on this CPU? Decode step times and the weight bytes a
step reads, int4 and int4+int8 against bf16 and fp32, on the Qwen 1.5B target and SmolLM2.

int4 is the model's GGUF 4-bit blocks run by torch's int4 kernel, its other linears bf16
(packed by oneDNN where it runs, else computed in fp32); int4+int8 the same with those other
linears int8 per channel (torch's int8 weight-only kernel); int8 every linear int8 per channel
times activations int8 per row (fbgemm, exact integer sums), the rest bf16 (int8-fp32: the
rest fp32, `dtype: float32`); bf16 and fp32 are the GGUF's dequantized weights. One process,
one thread; the runners take turns shape by shape within each repetition, so drift hits all
of them; medians. `--contenders` picks some (with an
AVX2 CPU's code every bf16 weight is held in fp32, and four 1.5B runners need ~27 GB).
Shapes: [b, 1] decode steps at batch 1 and 8 (tok/s = b / step time) and the [b, 5]
verifies a K=4 round costs. Also: the LM head the int4 model keeps (Q6_K / Q8_0 in the
GGUFs) in bf16 against torch's int8 weight-only kernel; how far the kernel's bf16 scales
move the shipped weights (`scale_rounding`), beside what bf16 weights move them; what int8
per channel moves the other linears (`int8_rounding`). Prints JSON naming the machine and
writes it to bench/results/int4-<isa>-<date>.json.
Usage: python bench/int4.py [--repeats 7] [--models NAME ...] [--contenders KIND ...]
(packaged names: Qwen 1.5B, SmolLM2)
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from bench._common import machine
from bench.compile_pair import decode_seconds
from generation import gguf_int4, kernels
from generation.int4 import (
    Int4Linear,
    Int4Weights,
    Int8WeightOnlyLinear,
    Int8Weights,
    WeightOnlyLinear,
    int4_weights_of,
    int8_weights_of,
    weight_only_linears,
)
from generation.loading import load_model, load_state_dict, resolve_model_dir, shipped_int4
from generation.packing import PackedLinear
from generation.quantize import (
    CALIBRATION_TEXT,
    ExactInt8Linear,
    int8_weights,
    smoothing_factors,
)
from generation.runner import ModelRunner
from schemas import BucketGrid, ModelSpec

GRID = BucketGrid(batch_sizes=[1, 8], prompt_lengths=[64], cache_lengths=[384], draft_lengths=[4])
SHAPES = [(1, 1), (8, 1), (1, 5), (8, 5)]
RESULTS = Path(__file__).resolve().parent / "results"


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: each linear's kernel operand (4-bit codes and
    bf16 scales, int8 codes and scales, oneDNN's packed bf16, or plain weights; not a
    weight-only linear's bf16 copy, which only prefills run) and the norms. Embedding rows
    (b of them) are left out."""
    prefill_only = {id(m.dense) for m in model.modules() if isinstance(m, WeightOnlyLinear)}
    total = 0
    for module in model.modules():
        if id(module) in prefill_only or isinstance(module, nn.Embedding):
            continue
        if isinstance(module, Int4Linear):
            tensors = [module.packed, module.scales_and_zeros, module.bias]
        elif isinstance(module, Int8WeightOnlyLinear):
            tensors = [module.codes, module.scales, module.bias]
        elif isinstance(module, ExactInt8Linear):  # its int8 codes, packed by fbgemm or not
            total += module.in_features * module.out_features
            tensors = [module.scales, module.bias]
        elif isinstance(module, PackedLinear):
            tensors = [module.packed, module.bias]
        else:
            tensors = [*module.parameters(recurse=False)]
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total


def scale_rounding(shipped: dict[str, Int4Weights]) -> dict[str, float]:
    """How far the kernel's bf16 scales and zeros move the shipped 4-bit weights (against
    fp32 ones, which give the GGUF's values), beside what rounding those weights to bf16 (the
    bf16 target) moves them: RMS over the weights' RMS; the worst error within a group over the
    group's largest weight; and the RMS in 4-bit steps where the group's scale is not 0."""
    sums = {"error": 0.0, "bf16": 0.0, "weight": 0.0, "in_steps": 0.0, "stepped": 0}
    worst = 0.0
    for weights in shipped.values():
        exact = weights.dequantized()
        error = (weights.dequantized(torch.bfloat16) - exact).view(len(exact), -1,
                                                                   weights.group_size)
        groups = exact.view_as(error)
        worst = max(worst, float((error.abs().amax(-1) /
                                  groups.abs().amax(-1).clamp_min(1e-30)).max()))
        stepped = weights.scales != 0
        in_steps = error.abs().amax(-1)[stepped] / weights.scales.abs()[stepped]
        sums["in_steps"] += float(in_steps.double().square().sum())
        sums["stepped"] += int(stepped.sum())
        sums["error"] += float(error.double().square().sum())
        sums["bf16"] += float((exact.bfloat16().float() - exact).double().square().sum())
        sums["weight"] += float(exact.double().square().sum())
    return {
        "rms_over_weight_rms": round((sums["error"] / sums["weight"]) ** 0.5, 6),
        "bf16_weights_rms_over_weight_rms": round((sums["bf16"] / sums["weight"]) ** 0.5, 6),
        "worst_over_group_max": round(worst, 5),
        "group_worst_rms_in_steps": round((sums["in_steps"] / sums["stepped"]) ** 0.5, 5),
        "weights": sum(w.codes.numel() * 2 for w in shipped.values()),
    }


CONTENDERS = ("fp32", "bf16", "int4", "int4+int8", "int8", "int8-fp32")
FP32_REST = {"fp32", "int8-fp32"}  # other weights, activations and cache in fp32


def int8_rounding(int8: dict[str, Int8Weights], model: nn.Module) -> dict[str, float]:
    """How far int8 per channel moves the linears the GGUF does not ship in 4 bits (against
    their shipped values, the fp32 `model`'s): RMS over the weights' RMS, overall and at the
    worst linear."""
    modules = dict(model.named_modules())
    errors, weights = {}, {}
    for name, compact in int8.items():
        exact = modules[name].weight.detach().float()
        errors[name] = float((compact.multiplied(torch.float32) - exact).double().square().sum())
        weights[name] = float(exact.double().square().sum())
    return {
        "rms_over_weight_rms": round((sum(errors.values()) / sum(weights.values())) ** 0.5, 5),
        "worst_linear": round(max((errors[n] / weights[n]) ** 0.5 for n in int8), 5),
        "weights": sum(w.codes.numel() for w in int8.values()),
    }


def runners(name: str, contenders: list[str]) -> tuple[dict[str, ModelRunner], dict]:
    """The contenders' runners of one packaged model; the int4 ones built as load_model builds
    them, from the shipped 4-bit tensors (cached once), int4+int8 sharing int4's 4-bit linears
    where both run (with an AVX2 CPU's code each holds a 6 GB fp32 copy for prefills); and
    what was measured of the weights themselves."""
    cpu = torch.device("cpu")
    spec = ModelSpec(path=f"packaged:{name}")
    loaded = load_model(spec, GRID.max_cache, cpu)
    fp32 = loaded.model
    directory = resolve_model_dir(spec)
    cached = (directory / gguf_int4.CACHE_FILE).is_file()
    shipped = shipped_int4(spec, directory, {} if cached else load_state_dict(directory))
    int4 = int4_weights_of(fp32, shipped)
    int8 = int8_weights_of(fp32, int4)
    weights = {"scale_rounding": scale_rounding(shipped),
               "int8_rounding": int8_rounding(int8, fp32)}
    models: dict[str, nn.Module] = {}
    if "fp32" in contenders:
        models["fp32"] = copy.deepcopy(fp32)
    smoothing = smoothing_factors(fp32, loaded.tokenizer.encode(CALIBRATION_TEXT)) \
        if {"int8", "int8-fp32"} & set(contenders) else None
    if "int8-fp32" in contenders:  # quantize: int8 with dtype float32, as load_model builds it
        models["int8-fp32"] = int8_weights(copy.deepcopy(fp32), ExactInt8Linear, smoothing)
    bf16 = fp32.to_dtype(torch.bfloat16)  # in place: the fp32 weights go
    if "bf16" in contenders:
        models["bf16"] = copy.deepcopy(bf16)
    if "int8" in contenders:  # as load_model builds quantize: int8, from the cast weights
        models["int8"] = int8_weights(copy.deepcopy(bf16), ExactInt8Linear, smoothing)
    if "int4" in contenders or "int4+int8" in contenders:
        models["int4"] = weight_only_linears(bf16, int4, cpu)
    if "int4+int8" in contenders:
        shared = {id(m): m for m in models["int4"].modules() if isinstance(m, Int4Linear)}
        models["int4+int8"] = weight_only_linears(copy.deepcopy(models["int4"], shared), int8,
                                                  cpu)
    built = {kind: ModelRunner(models[kind], GRID, cpu,
                               torch.float32 if kind in FP32_REST else torch.bfloat16)
             for kind in contenders}
    if "int4" in built:
        weights["kept_lm_head_ms"] = kept_head_ms(built["int4"].model.lm_head, int8["lm_head"])
    return built, weights


def kept_head_ms(head: nn.Module, int8: Int8Weights, repeats: int = 7) -> dict[str, dict]:
    """The LM head the int4 model keeps (not 4-bit in either GGUF) as it runs (bf16, packed by
    oneDNN where it runs) against torch's int8 weight-only kernel on the same weight rounded
    per channel, at 1 and 8 rows, taking turns; medians in ms."""
    scales = int8.scales.bfloat16()
    contenders = {"bf16": head, "int8_weight_only": lambda x: torch.ops.aten._weight_int8pack_mm(
        x, int8.codes, scales)}
    times: dict[str, dict[str, list[float]]] = {kind: {} for kind in contenders}
    for _ in range(repeats + 1):  # the first round pays set-up
        for rows in (1, 8):
            x = torch.randn(rows, int8.codes.shape[1]).bfloat16()
            for kind, product in contenders.items():
                started = time.perf_counter()
                product(x)
                times[kind].setdefault(f"rows_{rows}", []).append(time.perf_counter() - started)
    return {kind: {rows: round(statistics.median(v[1:]) * 1e3, 1) for rows, v in by_rows.items()}
            for kind, by_rows in times.items()}


def measure(name: str, repeats: int, contenders: list[str]) -> dict:
    built, weights = runners(name, contenders)
    for runner in built.values():  # first calls pay one-time set-up
        for b, t in SHAPES:
            decode_seconds(runner, b, t)
    times: dict[str, dict[str, list[float]]] = {kind: {} for kind in built}
    for _ in range(repeats):
        for b, t in SHAPES:
            for kind, runner in built.items():
                times[kind].setdefault(f"b{b}_t{t}", []).append(decode_seconds(runner, b, t))
    ms = {kind: {shape: round(statistics.median(v) * 1e3, 1) for shape, v in by_shape.items()}
          for kind, by_shape in times.items()}
    step_bytes = {kind: decode_weight_bytes(runner.model) for kind, runner in built.items()}
    return {
        "kernels": {kind: runner.kernels for kind, runner in built.items()},
        "forward_ms": ms,
        "decode_tok_per_s": {
            kind: {f"batch_{b}": round(b * 1e3 / ms[kind][f"b{b}_t1"], 2) for b in (1, 8)}
            for kind in ms
        },
        "over_bf16": {kind: {shape: round(ms[kind][shape] / ms["bf16"][shape], 3)
                             for shape in ms[kind]} for kind in ms if "bf16" in ms},
        "weight_bytes_per_step": step_bytes,
        "weight_bytes_per_token": {kind: {f"batch_{b}": round(v / b) for b in (1, 8)}
                                   for kind, v in step_bytes.items()},
        "weight_only_linears": {
            kind: {cls.kernel: sum(isinstance(m, cls) for m in runner.model.modules())
                   for cls in (Int4Linear, Int8WeightOnlyLinear)}
            for kind, runner in built.items()},
        **weights,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--models", nargs="+",
                        default=["qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"])
    level = kernels.cpu_isa().split()[0].lower()  # the file names the machine's ISA level
    parser.add_argument("--out", type=Path, default=RESULTS / f"int4-{level}-"
                        f"{datetime.date.today().isoformat()}.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {"repeats": args.repeats, "contenders": args.contenders, "models": {}}
    for name in args.models:
        result["models"][name] = measure(name, args.repeats, args.contenders)
    text = json.dumps({"machine": machine(), **result}, indent=2)
    print(text)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
