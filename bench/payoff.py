"""How close the metrics' plain-decoding estimate comes to a real plain run, printed as JSON.

SmolLM2-135M (packaged), greedy, 48 new tokens, 4 copy-heavy chat prompts at batch 4: a
prompt-lookup run (K=4) estimates what plain decoding would have taken (the plain schedule
replayed on its rows' lengths, each step at its warm-up [b, 1] time x the load measured in the
run); the same prompts are then decoded plain. The runs alternate; figures are medians, and each
repeat's own error shows the spread. tests/test_reporting.py checks the replayed step count and
shapes exactly; timings are only compared here.

    python bench/payoff.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench._common import machine
from bench.workloads import COPY_PROMPTS, PAYOFF_GRID
from generation import Engine
from schemas import DraftSpec, EngineConfig, ModelSpec, SamplingParams


def measure_plain_estimate(target: ModelSpec, repeats: int) -> dict:
    """Plain wall seconds of one batch of copy-heavy prompts, estimated and measured, and
    plain steps, replayed and run.

    The estimate is a prompt-lookup run's wall time plus the seconds speculation saved; the
    measurement the same prompts decoded plain. Runs alternate, so machine drift hits both.
    """
    params = SamplingParams(max_new_tokens=48)
    engines = {}
    for name, draft in (("plain", None), ("lookup", DraftSpec(kind="prompt_lookup"))):
        config = EngineConfig(target=target, draft=draft, device="cpu", bucket_grid=PAYOFF_GRID,
                              num_draft_tokens=4 if draft else "auto")  # fmt: skip
        engines[name] = Engine.from_config(config)
        engines[name].warmup()
    measured, estimated, speculative = [], [], []
    for _ in range(repeats):
        for name, engine in engines.items():
            engine.reset_stats()
            engine.generate(COPY_PROMPTS, params)
            stats = engine.stats
            if name == "plain":
                measured.append(stats.wall_seconds)
            else:
                speculative.append(stats.wall_seconds)
                estimated.append(stats.wall_seconds + stats.seconds_saved_by_speculation)
    return {
        "seconds": {
            "measured_plain_seconds": statistics.median(measured),
            "estimated_plain_seconds": statistics.median(estimated),
            "speculative_seconds": statistics.median(speculative),
        },
        "estimate_error_per_repeat": [
            round(est / real - 1, 3) for est, real in zip(estimated, measured, strict=True)
        ],
        "plain_steps": {
            "replayed_by_lookup_run": engines["lookup"].stats.plain_decode_steps,
            "run_plain": engines["plain"].stats.steps_per_k[0],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = measure_plain_estimate(ModelSpec(path="packaged:smollm2-135m-instruct"), args.repeats)
    seconds = result["seconds"]
    estimate, measured = seconds["estimated_plain_seconds"], seconds["measured_plain_seconds"]
    print(json.dumps({
        "machine": machine(),
        "model": "packaged:smollm2-135m-instruct", "draft": "prompt_lookup, K=4",
        "prompts": "4 copy-heavy chat prompts, batch 4, 48 new tokens, greedy",
        "repeats": args.repeats, "torch_threads": 1,
        "seconds": {key: round(value, 3) for key, value in seconds.items()},
        "estimate_error": round(estimate / measured - 1, 3),
        "estimate_error_per_repeat": result["estimate_error_per_repeat"],
        "plain_steps": result["plain_steps"],
        "measured_speedup": round(measured / seconds["speculative_seconds"], 3),
        "estimated_speedup": round(estimate / seconds["speculative_seconds"], 3),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
