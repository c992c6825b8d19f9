"""Is K auto ever below plain decoding? Every draft kind, with and without the payoff check.

SmolLM2 (packaged), greedy, free-text and copy-heavy prompts, batch 1 (each prompt its own
call, one after another on one engine, as a shard runs them) and batch 8. Per draft kind: K
auto as shipped, and K auto with the realized-payoff check switched off (`payoff_rounds`
out of reach: the model of acceptance and step prices alone decides, as before the check).
Contenders take turns call by call; medians over repetitions. Prints JSON with each ratio to
plain and the lowest one.

    python bench/k_auto_floor.py [--repeats 3] [--threads 1] [--max-new-tokens 64]
"""

from __future__ import annotations

import json
import statistics

import torch

from bench._common import EngineTimings, decoding_arguments, engine_contender, machine
from bench.workloads import PROMPT_SETS, SMOLLM2
from generation import Engine
from schemas import BucketGrid, DraftSpec, EngineConfig, SamplingParams

GRID = BucketGrid(
    batch_sizes=[1, 8], prompt_lengths=[64, 128], cache_lengths=[256], draft_lengths=[2, 4, 6]
)
DRAFTS = {
    "int8": DraftSpec(kind="quantized", dtype="int8"),
    "bf16": DraftSpec(kind="quantized", dtype="bfloat16"),
    "prompt_lookup": DraftSpec(kind="prompt_lookup", ngram_max=3),
}
UNCHECKED = 10**9  # payoff rounds never reached: the check never vetoes


def build_engines(threads: int) -> dict[str, Engine]:
    engines = {}
    for name, draft in {"plain": None, **DRAFTS}.items():
        for checked in (True, False) if draft else (True,):
            config = EngineConfig(target=SMOLLM2, device="cpu", bucket_grid=GRID, draft=draft,
                                  cpu_threads=threads)  # fmt: skip
            engine = Engine.from_config(config)
            engine.warmup()
            if not checked:
                engine.draft_length.chooser.payoff_rounds = UNCHECKED
            engines[name if checked else f"{name}_unchecked"] = engine
    return engines


def main() -> None:
    parser = decoding_arguments(__doc__)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    engines = build_engines(args.threads)
    contenders = {name: engine_contender(engine, params) for name, engine in engines.items()}
    timings = EngineTimings()
    for _ in range(args.repeats):
        for set_name, prompts in PROMPT_SETS.items():
            timings.time_contenders(contenders, set_name, prompts, [1], len(prompts))
            timings.time_contenders(contenders, set_name, prompts, [8])
    tps = {key: round(statistics.median(v), 2) for key, v in timings.rates.items()}
    ratios = {
        f"{set_name}/b{b}/{name}": round(tps[f"{set_name}/b{b}/{name}"]
                                         / tps[f"{set_name}/b{b}/plain"], 3)
        for set_name in PROMPT_SETS for b in (1, 8) for name in engines if name != "plain"
    }  # fmt: skip
    checked = {key: ratio for key, ratio in ratios.items() if not key.endswith("_unchecked")}
    print(json.dumps({
        "machine": machine(engines),
        "model": SMOLLM2.path,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "all_engine_outputs_identical_to_plain": timings.outputs_identical(),
        "tokens_per_second": tps,
        "ratios_to_plain": ratios,
        "lowest_ratio_with_check": min(checked.items(), key=lambda item: item[1]),
        "lowest_ratio_without_check": min(
            ((k, r) for k, r in ratios.items() if k.endswith("_unchecked")),
            key=lambda item: item[1]),
        "steps_per_k": {key: value["steps_per_k"] for key, value in timings.acceptance.items()},
        "goal": "every ratio with the check >= 0.97",
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
