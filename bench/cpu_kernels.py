"""The CPU linear kernel paths side by side on a Qwen model, per decode shape and a prefill:
oneDNN-packed bf16 (where this CPU runs it), the bf16 fallback (fp32 compute, as on a CPU
without AVX-512 BF16), fp32 as the reference, and the row-exact forms a target runs of the
fp32 and fallback paths (`*_row_exact`: oneDNN's prepacked fp32 under a row plan) beside
MKL's F.linear that a draft runs. `--paths` picks some (each holds a copy of the weights).
Run it under `kernels.AVX2_CAPS` (generation/kernels.py) for an AVX2 CPU's MKL and oneDNN code.

One process, one thread; the runners hold loads of the same weights and take turns, one
set of shapes each, so machine drift hits all of them; medians. Prints JSON naming the CPU;
commit it under bench/results/.
Usage: python bench/cpu_kernels.py [--repeats 9] [--model target|draft] [--paths fp32 ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench._common import machine
from bench.compile_pair import SHAPES, decode_seconds
from bench.qwen_pair import DRAFT, TARGET
from generation import kernels
from generation.loading import load_model
from generation.runner import ModelRunner
from schemas import BucketGrid

GRID = BucketGrid(batch_sizes=[1, 8], prompt_lengths=[128], cache_lengths=[384], draft_lengths=[4])


def prefill_seconds(runner: ModelRunner, b: int, t: int) -> float:
    started = time.perf_counter()
    runner.prefill([[0] * t] * b, list(range(b)))
    return time.perf_counter() - started


def timings(runner: ModelRunner) -> dict[str, float]:
    """One call of every measured shape: decode steps / verifies, and a 128-token prefill."""
    times = {f"b{b}_t{t}": decode_seconds(runner, b, t) for b, t in SHAPES}
    times["prefill_b1_t128"] = prefill_seconds(runner, 1, 128)
    return times


PATHS = ["fp32", "fp32_row_exact", "bf16_packed", "bf16_fallback", "bf16_fallback_row_exact"]


def runners(spec, paths: list[str]) -> dict[str, ModelRunner]:
    """name -> a runner on its own load of the weights, its linears as the name says."""
    cpu = torch.device("cpu")

    def weights(dtype: torch.dtype):
        fp32 = load_model(spec.model_copy(update={"dtype": "float32"}), GRID.max_cache, cpu).model
        return fp32 if dtype == torch.float32 else fp32.to_dtype(dtype)

    built = {}
    for path in paths:
        exact = path.endswith("_row_exact")
        if path.startswith("fp32"):
            built[path] = ModelRunner(weights(torch.float32), GRID, cpu, torch.float32,
                                      exact_rows=exact)
        elif path == "bf16_packed" and kernels.packed_bf16().available:
            built[path] = ModelRunner(weights(torch.bfloat16), GRID, cpu, torch.bfloat16)
        elif path.startswith("bf16_fallback"):
            with kernels.disabled(kernels.ONEDNN_PACKED_BF16):  # as on an AVX2 CPU
                built[path] = ModelRunner(weights(torch.bfloat16), GRID, cpu, torch.bfloat16,
                                          exact_rows=exact)
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--model", choices=["target", "draft"], default="target")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=PATHS[:1] + PATHS[2:4])
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = TARGET if args.model == "target" else DRAFT
    built = runners(spec, args.paths)
    for runner in built.values():  # first calls pay one-time set-up
        timings(runner)
    times: dict[str, dict[str, list[float]]] = {name: {} for name in built}
    for _ in range(args.repeats):
        for name, runner in built.items():
            for shape, seconds in timings(runner).items():
                times[name].setdefault(shape, []).append(seconds)
    ms = {name: {shape: round(statistics.median(v) * 1e3, 1) for shape, v in by_shape.items()}
          for name, by_shape in times.items()}
    first = next(iter(ms.values()))
    result = {
        "machine": machine(),
        "model": spec.path,
        "repeats": args.repeats,
        "kernels": {name: runner.kernels for name, runner in built.items()},
        "forward_ms": ms,
        "over_first": {  # each path's time over the first path's, per shape
            name: {shape: round(ms[name][shape] / first[shape], 3) for shape in first}
            for name in list(ms)[1:]
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
