"""Do 4-bit weights (quantize: int4) pay on this CPU? Decode step times and the weight bytes a
step reads, int4 against bf16 and fp32, on the Qwen 1.5B target and SmolLM2.

int4 is the model's GGUF 4-bit blocks run by torch's int4 kernel, its other linears bf16
(packed by oneDNN where it runs); bf16 and fp32 are the GGUF's dequantized weights. One
process, one thread; the three runners take turns shape by shape within each repetition, so
drift hits all of them; medians. Shapes: [b, 1] decode steps at batch 1 and 8 (tok/s = b /
step time) and the [b, 5] verifies a K=4 round costs. Also: the LM head the int4 model keeps
(Q6_K / Q8_0 in the GGUFs) in bf16 against torch's int8 weight-only kernel; how far the
kernel's bf16 scales move the shipped weights (`scale_rounding`), beside what bf16 weights
move them. Prints
JSON naming the machine and writes it to bench/results/int4-<isa>-<date>.json.
Usage: python bench/int4.py [--repeats 7] [--models NAME ...]  (packaged names: Qwen 1.5B, SmolLM2)
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
from generation.int4 import Int4Linear, Int4Weights, int4_linears, int4_weights_of
from generation.loading import load_model, load_state_dict, resolve_model_dir, shipped_int4
from generation.packing import PackedLinear
from generation.runner import ModelRunner
from schemas import BucketGrid, ModelSpec

GRID = BucketGrid(batch_sizes=[1, 8], prompt_lengths=[64], cache_lengths=[384], draft_lengths=[4])
SHAPES = [(1, 1), (8, 1), (1, 5), (8, 5)]
RESULTS = Path(__file__).resolve().parent / "results"


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: each linear's kernel operand (4-bit codes and
    bf16 scales, oneDNN's packed bf16, or plain weights; not an int4 linear's bf16 copy, which
    only prefills run) and the norms. Embedding rows (b of them) are left out."""
    prefill_only = {id(m.dense) for m in model.modules() if isinstance(m, Int4Linear)}
    total = 0
    for module in model.modules():
        if id(module) in prefill_only or isinstance(module, nn.Embedding):
            continue
        if isinstance(module, Int4Linear):
            tensors = [module.packed, module.scales_and_zeros, module.bias]
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


def runners(name: str) -> tuple[dict[str, ModelRunner], dict[str, Int4Weights]]:
    """fp32, bf16 and int4 runners of one packaged model, each on its own copy; the int4 one
    built as load_model builds it, from the shipped 4-bit tensors (cached once)."""
    cpu = torch.device("cpu")
    spec = ModelSpec(path=f"packaged:{name}")
    fp32 = load_model(spec, GRID.max_cache, cpu).model
    bf16 = copy.deepcopy(fp32).to_dtype(torch.bfloat16)
    directory = resolve_model_dir(spec)
    cached = (directory / gguf_int4.CACHE_FILE).is_file()
    shipped = shipped_int4(spec, directory, {} if cached else load_state_dict(directory))
    int4 = int4_linears(copy.deepcopy(bf16), int4_weights_of(bf16, shipped), cpu)
    built = {
        "fp32": ModelRunner(fp32, GRID, cpu, torch.float32),
        "bf16": ModelRunner(bf16, GRID, cpu, torch.bfloat16),
        "int4": ModelRunner(int4, GRID, cpu, torch.bfloat16),
    }
    return built, shipped


def kept_head_ms(
    head: nn.Module, weight: torch.Tensor, repeats: int
) -> dict[str, dict[str, float]]:
    """The LM head the int4 model keeps (not 4-bit in either GGUF) as it runs (bf16, packed by
    oneDNN here) against torch's int8 weight-only kernel on the same `weight` rounded per
    channel, at 1 and 8 rows, taking turns; medians in ms."""
    scales = weight.float().abs().amax(1).clamp_min(1e-8) / 127
    int8 = (weight.float() / scales[:, None]).round().to(torch.int8)
    contenders = {"bf16": head, "int8_weight_only": lambda x: torch.ops.aten._weight_int8pack_mm(
        x, int8, scales.bfloat16())}
    times: dict[str, dict[str, list[float]]] = {kind: {} for kind in contenders}
    for _ in range(repeats + 1):  # the first round pays set-up
        for rows in (1, 8):
            x = torch.randn(rows, weight.shape[1]).bfloat16()
            for kind, product in contenders.items():
                started = time.perf_counter()
                product(x)
                times[kind].setdefault(f"rows_{rows}", []).append(time.perf_counter() - started)
    return {kind: {rows: round(statistics.median(v[1:]) * 1e3, 1) for rows, v in by_rows.items()}
            for kind, by_rows in times.items()}


def measure(name: str, repeats: int) -> dict:
    built, shipped = runners(name)
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
                             for shape in ms[kind]} for kind in ms if kind != "bf16"},
        "weight_bytes_per_step": step_bytes,
        "weight_bytes_per_token": {kind: {f"batch_{b}": round(v / b) for b in (1, 8)}
                                   for kind, v in step_bytes.items()},
        "int4_linears": sum(isinstance(m, Int4Linear) for m in built["int4"].model.modules()),
        "kept_lm_head_ms": kept_head_ms(built["int4"].model.lm_head,
                                        built["fp32"].model.lm_head.weight.detach(), repeats),
        "scale_rounding": scale_rounding(shipped),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--models", nargs="+",
                        default=["qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"])
    level = kernels.cpu_isa().split()[0].lower()  # the file names the machine's ISA level
    parser.add_argument("--out", type=Path, default=RESULTS / f"int4-{level}-"
                        f"{datetime.date.today().isoformat()}.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {"repeats": args.repeats, "models": {}}
    for name in args.models:
        result["models"][name] = measure(name, args.repeats)
    text = json.dumps({"machine": machine(), **result}, indent=2)
    print(text)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
