"""Prefill: each prompt in its own bucket vs each padded to the longest one's bucket.

The engine prefills every admitted prompt alone, padded to its own prompt bucket (a [b, t]
prefill padded every prompt to the longest one's). Here that layout is replayed as the same
calls with each prompt filled to the longest one's bucket, so both run the same kernels and
only the padded tokens differ. (Results dated 2026-12-06 measured a packed layout, all
prompts in one sequence, since replaced: its rounding depended on the batch.) Qwen2.5-Coder-1.5B
(`make models`; else SmolLM2), the code and free-text prompts of bench/qwen_pair.py, chat
template applied, 8 at once, and each alone (prompt tokens per second, what llama.cpp's
"prompt eval" reports); and one prompt admitted 8 times (samples_per_prompt: one forward, its
cache copied). Calls alternate; medians. Prints JSON.

    python bench/prefill.py [--repeats 5] [--threads 1] [--model packaged:...]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench._common import machine, timed
from bench.qwen_pair import GRID, PROMPT_SETS, TARGET
from bench.workloads import SMOLLM2
from generation import Engine
from generation.loading import resolve_model_dir
from generation.runner import bucket
from schemas import EngineConfig, ModelSpec


def available_target() -> ModelSpec:
    try:
        resolve_model_dir(TARGET)
        return TARGET
    except (OSError, ValueError, ImportError):
        return SMOLLM2


def padded_to_longest(prompts: list[list[int]], sizes: list[int]) -> list[list[int]]:
    """Each prompt filled (with its own first token) to the longest prompt's bucket."""
    width = bucket(sizes, max(len(p) for p in prompts))
    return [p + [p[0]] * (width - len(p)) for p in prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=None, help="a model path; default the Qwen target")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = ModelSpec(path=args.model) if args.model else available_target()
    engine = Engine.from_config(EngineConfig(target=target, device="cpu", bucket_grid=GRID,
                                             cpu_threads=args.threads))  # fmt: skip
    runner = engine.target
    sets = {name: [engine.encode(p) for p in prompts] for name, prompts in PROMPT_SETS.items()}
    calls = {}
    for name, prompts in sets.items():
        batch = prompts[: GRID.max_batch]
        calls[f"{name}/b{len(batch)}/own_bucket"] = [batch]
        calls[f"{name}/b{len(batch)}/padded"] = [padded_to_longest(batch, GRID.prompt_lengths)]
        calls[f"{name}/b1/alone"] = [[p] for p in prompts]
        calls[f"{name}/b{len(batch)}/one_prompt_sampled"] = [[batch[0]] * len(batch)]
    useful = {key: sum(len(p) for p in call[0]) * len(call) if key.endswith("sampled") else
              sum(len(p) for p in sets[key.split("/")[0]][: len(call[0]) * len(call)])
              for key, call in calls.items()}  # fmt: skip
    for call in calls.values():  # warm every shape these calls use
        for prompts in call:
            runner.prefill(prompts, list(range(len(prompts))))
    seconds: dict[str, list[float]] = {key: [] for key in calls}
    for _ in range(args.repeats):
        for key, call in calls.items():
            seconds[key].append(sum(timed(lambda p=p: runner.prefill(p, list(range(len(p)))))[0]
                                    for p in call))  # fmt: skip
    median = {key: statistics.median(values) for key, values in seconds.items()}
    rate = {key: round(useful[key] / median[key], 1) for key in calls}
    print(json.dumps({
        "machine": machine({"target": engine}),
        "model": target.path,
        "repeats": args.repeats,
        "prompt_tokens": {name: [len(p) for p in prompts] for name, prompts in sets.items()},
        "prompt_lengths": GRID.prompt_lengths,
        "median_seconds": {key: round(value, 3) for key, value in median.items()},
        "prompt_tokens_per_second": rate,
        "own_bucket_vs_padded": {
            name: round(median[f"{name}/b8/padded"] / median[f"{name}/b8/own_bucket"], 2)
            for name in sets
        },
        "eight_prompts_vs_one_prompt_sampled_eight_times": {
            name: round(median[f"{name}/b8/own_bucket"] / median[f"{name}/b8/one_prompt_sampled"],
                        2) for name in sets
        },
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
