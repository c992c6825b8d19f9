"""Does `compile=True` pay on the Qwen pair? Forward time per static shape, compiled vs eager.

One process, one thread, bf16; the compiled and eager runners hold the same weights (the
eager one oneDNN-packed, the compiled one a copy made before packing) and alternate call by
call, so machine drift hits both; medians. Shapes: the [b, 1] step and the [b, 5] verify
(K=4) at batch 1 and 8, for the 1.5B target and the 0.5B draft. Also the one-time cost:
seconds to compile each shape. Prints JSON; commit it under bench/results/.
Usage: python bench/compile_pair.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from bench._common import machine
from bench.qwen_pair import DRAFT, TARGET
from generation.loading import load_model
from generation.runner import ModelRunner
from schemas import BucketGrid

GRID = BucketGrid(batch_sizes=[1, 8], prompt_lengths=[64], cache_lengths=[384], draft_lengths=[4])
SHAPES = [(1, 1), (1, 5), (8, 1), (8, 5)]


def decode_seconds(runner: ModelRunner, b: int, t: int) -> float:
    started = time.perf_counter()
    runner.decode(torch.zeros(b, t, dtype=torch.long), torch.full((b,), 100), b)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    result = {"dtype": "bfloat16", "torch_threads": 1, "repeats": args.repeats, "models": {}}
    for name, spec in (("target_1.5b", TARGET), ("draft_0.5b", DRAFT)):
        model = load_model(spec.model_copy(update={"dtype": "bfloat16"}), GRID.max_cache, cpu)
        unpacked = copy.deepcopy(model.model)  # the eager runner packs its linears in place
        eager = ModelRunner(model.model, GRID, cpu, torch.bfloat16, False, False)
        compiled = ModelRunner(unpacked, GRID, cpu, torch.bfloat16, True, False)
        compile_seconds = {
            f"b{b}_t{t}": round(decode_seconds(compiled, b, t), 1) for b, t in SHAPES
        }
        times: dict[str, dict[str, list[float]]] = {"eager": {}, "compiled": {}}
        for _ in range(args.repeats):
            for b, t in SHAPES:
                for kind, runner in (("eager", eager), ("compiled", compiled)):
                    times[kind].setdefault(f"b{b}_t{t}", []).append(decode_seconds(runner, b, t))
        ms = {kind: {shape: round(statistics.median(v) * 1e3, 1) for shape, v in by_shape.items()}
              for kind, by_shape in times.items()}
        result["models"][name] = {
            "forward_ms": ms,
            "eager_over_compiled": {
                shape: round(ms["eager"][shape] / ms["compiled"][shape], 3) for shape in ms["eager"]
            },
            "first_call_seconds_compiled": compile_seconds,
            "compiles": compiled.compiles,
        }
    print(json.dumps({"machine": machine(), **result}, indent=2))


if __name__ == "__main__":
    main()
