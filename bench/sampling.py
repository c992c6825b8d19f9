"""Coupled vs rejection verification on the packaged SmolLM2 with its int8 draft, sampling.

Same prompts (free text and copy-heavy, batch 8), same seeds, T 0.8, K fixed at 4 so both
modes draft alike; per mode: acceptance rate, tokens/s (median of interleaved repetitions) and
whether the completions equal plain sampling's. Also the cost of top-p's filter: top-k
candidates vs a full sort of the vocabulary, on real logits. Prints JSON.
Usage: python bench/sampling.py [--repeats 3] [--threads 1] [--max-new-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench._common import machine, timed
from bench.workloads import PROMPT_SETS, SMOLLM2
from generation import Engine
from generation.sampling import allowed_logits
from schemas import BucketGrid, DraftSpec, EngineConfig, SamplingParams

GRID = BucketGrid(
    batch_sizes=[8], prompt_lengths=[64, 128], cache_lengths=[256], draft_lengths=[4]
)
SEEDS = list(range(100, 108))


def full_sort_nucleus(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p by sorting the whole vocabulary (what the filter did before): kept-token counts."""
    values = scaled.sort(-1, descending=True).values
    probs = values.softmax(-1)
    return ((probs.cumsum(-1) - probs) < top_p).sum(-1)


def filter_seconds(logits: torch.Tensor, params: SamplingParams, repeats: int) -> dict:
    """Median seconds of top-p over top-k candidates vs over a full sort, and whether both
    keep the same number of tokens."""
    scaled = logits.float() / params.temperature
    runs = {"top_k_candidates": [], "full_sort": []}
    for _ in range(repeats):
        runs["top_k_candidates"].append(timed(lambda: allowed_logits(logits, params))[0])
        runs["full_sort"].append(timed(lambda: full_sort_nucleus(scaled, params.top_p))[0])
    kept = allowed_logits(logits, params)[0].isfinite().sum(-1)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "rows": logits.shape[0],
        "vocab": logits.shape[-1],
        "median_ms": {k: round(1000 * v, 3) for k, v in medians.items()},
        "full_sort_vs_candidates": round(medians["full_sort"] / medians["top_k_candidates"], 2),
        "same_nucleus_sizes": bool((kept == full_sort_nucleus(scaled, params.top_p)).all()),
        "nucleus_sizes": kept.tolist(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = EngineConfig(target=SMOLLM2, device="cpu", bucket_grid=GRID, cpu_threads=args.threads)
    plain = Engine.from_config(base)
    speculative = Engine.from_config(
        base.model_copy(
            update={"draft": DraftSpec(kind="quantized", dtype="int8"), "num_draft_tokens": 4}
        )
    )
    plain.warmup()
    speculative.warmup()
    modes = {
        mode: SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=0.8, top_p=0.95, verification=mode
        )
        for mode in ("coupled", "rejection")
    }
    result: dict = {"machine": machine({"plain": plain, "int8_k4": speculative}),
                    "model": SMOLLM2.path, "draft": "int8", "k": 4, "batch": 8,
                    "temperature": 0.8, "top_p": 0.95, "max_new_tokens": args.max_new_tokens,
                    "repeats": args.repeats, "torch_threads": args.threads, "sets": {}}
    for set_name, prompts in PROMPT_SETS.items():
        rates: dict[str, list[float]] = {}
        accepted = {mode: [0, 0] for mode in modes}
        same_as_plain = {}
        for _ in range(args.repeats):
            for mode, params in modes.items():
                for name, engine in (("plain", plain), ("int8_k4", speculative)):
                    engine.reset_stats()
                    seconds, done = timed(
                        lambda e=engine, p=params, b=prompts: e.generate(b, p, SEEDS)
                    )
                    tokens = sum(len(c.token_ids) for c in done)
                    rates.setdefault(f"{mode}/{name}", []).append(tokens / seconds)
                    if name == "plain":
                        reference = [c.token_ids for c in done]
                        continue
                    accepted[mode][0] += engine.stats.accepted
                    accepted[mode][1] += engine.stats.proposed
                    same_as_plain[mode] = [c.token_ids for c in done] == reference
        tps = {key: round(statistics.median(v), 2) for key, v in rates.items()}
        acceptance = {mode: round(a / p, 3) for mode, (a, p) in accepted.items()}
        result["sets"][set_name] = {
            "acceptance_rate": acceptance,
            "tokens_per_second": tps,
            "speculative_vs_plain": {
                mode: round(tps[f"{mode}/int8_k4"] / tps[f"{mode}/plain"], 3) for mode in modes
            },
            "coupled_vs_rejection_acceptance": round(
                acceptance["coupled"] / acceptance["rejection"], 3
            ),
            "completions_equal_plain_sampling": same_as_plain,
        }
    ids = [plain.encode(p) for p in PROMPT_SETS["free_text"]]
    logits = plain.target.prefill(ids, list(range(len(ids))))
    result["top_p_filter"] = filter_seconds(logits, modes["coupled"], repeats=20)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
