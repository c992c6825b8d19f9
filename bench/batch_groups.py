"""What grouping a batch file's requests by sampling parameters costs.

The engine samples a whole generate() call with one SamplingParams, so a batch file's requests
run as one call per parameter group (one shard each), not as one call mixing them. This runs
the same 16 chat prompts (free text and copy-heavy, greedy, packaged SmolLM2, plain decoding)
as one call, as an engine with per-row parameters would, and split into group calls of the
given sizes; the tokens are the same, only the batching differs. Per split: seconds (median
of interleaved repetitions), target forwards and padding waste. Prints JSON.
Usage: python bench/batch_groups.py [--repeats 3] [--threads 1] [--max-new-tokens 24]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from bench._common import machine, timed
from bench.workloads import PROMPT_SETS, SMOLLM2
from generation import Engine
from schemas import BucketGrid, EngineConfig, SamplingParams

GRID = BucketGrid(batch_sizes=[1, 2, 4, 8], prompt_lengths=[64, 128], cache_lengths=[256],
                  draft_lengths=[2])
SPLITS = {"one call": [16], "2 groups": [8, 8], "4 groups": [4, 4, 4, 4],
          "4 uneven groups": [7, 5, 3, 1]}


def run_split(engine: Engine, prompts: list, sizes: list[int], params: SamplingParams):
    """The prompts as consecutive calls of `sizes` rows: (tokens per row, seconds, stats)."""
    engine.reset_stats()
    tokens, seconds, start = [], 0.0, 0
    for size in sizes:
        took, done = timed(lambda s=start, n=size: engine.generate(prompts[s : s + n], params))
        tokens += [c.token_ids for c in done]
        seconds += took
        start += size
    return tokens, seconds, engine.stats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = round(os.getloadavg()[0], 2)
    engine = Engine.from_config(EngineConfig(target=SMOLLM2, device="cpu", bucket_grid=GRID))
    engine.warmup()
    prompts = PROMPT_SETS["free_text"] + PROMPT_SETS["copy"]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    seconds: dict[str, list[float]] = {name: [] for name in SPLITS}
    found: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, sizes in SPLITS.items():  # interleaved: a busy spell hits every split alike
            tokens, took, stats = run_split(engine, prompts, sizes, params)
            seconds[name].append(took)
            found[name] = {"tokens": tokens, "target_forwards": stats.target_forwards,
                           "padding_waste": round(stats.padding_waste, 3)}
    one_call = statistics.median(seconds["one call"])
    result = {
        "question": "cost of one generate() call per sampling-parameter group",
        "model": SMOLLM2.path, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "grid": GRID.model_dump(), "repeats": args.repeats, "machine": machine({"e": engine}),
        "load_average_1m": [load_before, round(os.getloadavg()[0], 2)],  # a shared host's
        "splits": {
            name: {
                "sizes": SPLITS[name],
                "seconds": round(statistics.median(seconds[name]), 3),
                "seconds_per_repeat": [round(t, 3) for t in seconds[name]],
                "vs_one_call": round(statistics.median(seconds[name]) / one_call, 3),
                "target_forwards": found[name]["target_forwards"],
                "padding_waste": found[name]["padding_waste"],
                "same_tokens": found[name]["tokens"] == found["one call"]["tokens"],
                "generated_tokens": sum(len(t) for t in found[name]["tokens"]),
            }
            for name in SPLITS
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
