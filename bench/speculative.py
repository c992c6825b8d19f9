"""Speculative decoding on the packaged SmolLM2: which draft pays, at batch 1 and 8.

Greedy, free-text and copy-heavy prompt sets, medians of interleaved repetitions, one run.
Engine: draft=None, int8 and bf16 quantized drafts, prompt lookup (K auto unless named), plus
int8 at fixed K=4. transformers at batch 1 (its assisted generation refuses batch > 1): plain,
assisted with the same int8 draft, prompt lookup. Prints JSON.
Usage: python bench/speculative.py [--repeats 3] [--threads 1] [--max-new-tokens 64]
"""

from __future__ import annotations

import copy
import json
import statistics

import torch

from bench._common import (
    EngineTimings,
    decoding_arguments,
    engine_contender,
    hf_contender,
    load_hf_smollm2,
    machine,
)
from bench.workloads import PROMPT_SETS, SMOLLM2
from generation import Engine
from generation.quantize import int8_linears
from schemas import BucketGrid, DraftSpec, EngineConfig, SamplingParams

GRID = BucketGrid(
    batch_sizes=[1, 8], prompt_lengths=[64, 128], cache_lengths=[256], draft_lengths=[2, 4, 6]
)
ENGINES = {
    "plain": dict(draft=None),
    "int8_auto": dict(draft=DraftSpec(kind="quantized", dtype="int8")),
    "int8_k4": dict(draft=DraftSpec(kind="quantized", dtype="int8"), num_draft_tokens=4),
    "bf16_auto": dict(draft=DraftSpec(kind="quantized", dtype="bfloat16")),
    "prompt_lookup_auto": dict(draft=DraftSpec(kind="prompt_lookup", ngram_max=3)),
}


def main() -> None:
    parser = decoding_arguments(__doc__)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)

    engines = {}
    for name, overrides in ENGINES.items():
        config = EngineConfig(
            target=SMOLLM2, device="cpu", bucket_grid=GRID, cpu_threads=args.threads, **overrides
        )
        engines[name] = Engine.from_config(config)
        engines[name].warmup()
    hf_model, tokenizer = load_hf_smollm2()
    hf_draft = int8_linears(copy.deepcopy(hf_model))
    encode = engines["plain"].encode
    baselines = {
        name: hf_contender(hf_model, tokenizer, encode, args.max_new_tokens, **kwargs)
        for name, kwargs in {
            "hf_plain": {},
            "hf_assisted_int8": {"assistant_model": hf_draft},
            "hf_prompt_lookup": {"prompt_lookup_num_tokens": 4},
        }.items()
    }
    contenders = {name: engine_contender(engine, params) for name, engine in engines.items()}

    timings = EngineTimings()
    rates = timings.rates
    for _ in range(args.repeats):
        for set_name, prompts in PROMPT_SETS.items():
            timings.time_contenders(contenders | baselines, set_name, prompts, [1])
            timings.time_contenders(contenders, set_name, prompts, [8])

    tps = {key: round(statistics.median(values), 2) for key, values in rates.items()}
    ratios = {}
    for set_name in PROMPT_SETS:
        for b in (1, 8):
            plain = tps[f"{set_name}/b{b}/plain"]
            for name in ENGINES:
                if name != "plain":
                    ratios[f"{set_name}/b{b}/{name}_vs_plain"] = round(
                        tps[f"{set_name}/b{b}/{name}"] / plain, 3
                    )
        ratios[f"{set_name}/b1/int8_auto_vs_hf_assisted_int8"] = round(
            tps[f"{set_name}/b1/int8_auto"] / tps[f"{set_name}/b1/hf_assisted_int8"], 3
        )
        ratios[f"{set_name}/b1/plain_vs_hf_plain"] = round(
            tps[f"{set_name}/b1/plain"] / tps[f"{set_name}/b1/hf_plain"], 3
        )
    identical = timings.outputs_identical()
    print(
        json.dumps(
            {
                "machine": machine(engines),
                "model": SMOLLM2.path,
                "max_new_tokens": args.max_new_tokens,
                "repeats": args.repeats,
                "torch_threads": args.threads,
                "all_engine_outputs_identical_to_plain": identical,
                "tokens_per_second": tps,
                "ratios": ratios,
                "acceptance": timings.acceptance,
                "goals": {
                    "free_text/b1 speculative vs plain": ">= 1.3",
                    "copy/b1 speculative vs plain": ">= 1.8",
                    "b1 vs HF assisted, same draft": ">= 1.5",
                    "b8 K auto vs plain": ">= 0.97",
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
