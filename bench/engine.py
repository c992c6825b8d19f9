"""Plain decoding: corpusgen's engine vs transformers' generate on the packaged SmolLM2.

Greedy, 64 new tokens, batch 1 and 8, medians of interleaved repetitions, all in one run.
Prints JSON. Usage: python bench/engine.py [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench._common import (
    copy_bandwidth_bytes_per_second,
    hf_generate,
    hf_rate,
    load_hf_smollm2,
    machine,
    timed,
    weight_bytes,
)
from bench.workloads import FREE_TEXT, SMOLLM2
from generation import Engine
from schemas import EngineConfig, SamplingParams

MAX_NEW_TOKENS = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, same for both")
    args = parser.parse_args()

    engine = Engine.from_config(
        EngineConfig(target=SMOLLM2, device="cpu", cpu_threads=args.threads)
    )
    torch.set_num_threads(args.threads)
    engine.warmup()
    hf_model, tokenizer = load_hf_smollm2()
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
    prompt_ids = [engine.encode(p) for p in FREE_TEXT]
    batches = {1: prompt_ids[:1], 8: prompt_ids[:8]}
    hf_generate(hf_model, tokenizer, batches[1], 4)  # HF warm-up

    runs: dict[str, list[float]] = {}
    decode_rates: list[float] = []
    fractions: list[float] = []  # achieved / copy bandwidth, both read in the same repetition
    weights = weight_bytes(engine.target.model)
    for _ in range(args.repeats):
        for b, prompts in batches.items():
            engine.reset_stats()
            seconds, completions = timed(lambda p=prompts: engine.generate(p, params))
            runs.setdefault(f"engine_b{b}", []).append(
                sum(len(c.token_ids) for c in completions) / seconds
            )
            if b == 1:
                stats = engine.stats
                decode_rates.append((stats.target_forwards - 1) / stats.decode_seconds)
                # Paired: the copy runs right after the decode it is compared with, so a busy
                # neighbour on this shared host moves both figures, not only the ratio.
                fractions.append(weights * decode_rates[-1] / copy_bandwidth_bytes_per_second())
            seconds, rows = timed(
                lambda p=prompts: hf_generate(hf_model, tokenizer, p, MAX_NEW_TOKENS)
            )
            runs.setdefault(f"hf_b{b}", []).append(hf_rate(seconds, rows))

    tps = {name: statistics.median(values) for name, values in runs.items()}
    achieved = weights * statistics.median(decode_rates)
    print(
        json.dumps(
            {
                "machine": machine({"engine": engine}),
                "model": SMOLLM2.path,
                "max_new_tokens": MAX_NEW_TOKENS,
                "repeats": args.repeats,
                "torch_threads": args.threads,
                "tokens_per_second": {k: round(v, 2) for k, v in tps.items()},
                "engine_vs_hf": {
                    "batch_1": round(tps["engine_b1"] / tps["hf_b1"], 3),
                    "batch_8": round(tps["engine_b8"] / tps["hf_b8"], 3),
                },
                "bandwidth": {
                    "weight_bytes": weights,
                    "decode_forwards_per_second_b1": round(statistics.median(decode_rates), 2),
                    "achieved_bytes_per_second": round(achieved),
                    "fraction_of_copy_bandwidth": round(statistics.median(fractions), 3),
                    "fraction_range": [round(min(fractions), 3), round(max(fractions), 3)],
                },
                "goals": {
                    "b1_vs_hf": ">= 1.0",
                    "b8_vs_hf": ">= 1.5",
                    "bandwidth_fraction_b1": ">= 0.6",
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
