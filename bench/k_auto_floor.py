"""Is K auto ever below plain decoding? Every draft kind, with and without the payoff check.

SmolLM2 (packaged), greedy, free-text and copy-heavy prompts, batch 1 (each prompt its own
call, one after another on one engine, as a shard runs them) and batch 8. Per draft kind: K
auto as shipped, and K auto with the realized-payoff check switched off (`payoff_rounds`
out of reach: the model of acceptance and step prices alone decides, as before the check).
Contenders take turns call by call; medians over repetitions. Prints JSON with each ratio to
plain and the lowest one.

With `--qwen` (needs `make models`): the Qwen2.5-Coder pair as bench/peers.py runs it, the
1.5B target `quantize: int8` plain and with the 0.5B int8 draft (eager; `--compiled-draft`
adds it compiled), K auto with the check, on the chat code and free-text prompts (4 each at
batch 1, 8 in one call): where a 0.5B draft's first pass over a long prompt makes each try
dear.

A batch-8 call is one short timing (~3-9 s), and identical work read 0.90-1.04x between
engines on a shared host: each repetition runs it `--batch8-turns` times, and `plain_again`
(the plain engine timed again as a contender) measures in the same run how far plain reads
from itself: the noise floor every other ratio must be read against.

    python bench/k_auto_floor.py [--qwen [--compiled-draft]] [--repeats 3] [--threads 1]
        [--batch8-turns 3] [--batches 1 8] [--drafts int8 bf16 prompt_lookup]
        [--max-new-tokens 64] [--out FILE]
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from bench import peers
from bench._common import (
    EngineTimings,
    decoding_arguments,
    engine_contender,
    machine,
    print_result,
)
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
NOISE = "plain_again"  # the plain engine timed twice a turn: how far plain reads from itself


def build_engines(threads: int, drafts: list[str]) -> dict[str, Engine]:
    engines = {}
    for name, draft in {"plain": None, **{name: DRAFTS[name] for name in drafts}}.items():
        for checked in (True, False) if draft else (True,):
            config = EngineConfig(target=SMOLLM2, device="cpu", bucket_grid=GRID, draft=draft,
                                  cpu_threads=threads)  # fmt: skip
            engine = Engine.from_config(config)
            engine.warmup()
            if not checked:
                engine.draft_length.chooser.payoff_rounds = UNCHECKED
            engines[name if checked else f"{name}_unchecked"] = engine
    return engines


def qwen_engines(threads: int, compiled_draft: bool) -> dict[str, Engine]:
    """peers.py's int8 target, plain and with its draft, named as the SmolLM2 engines are."""
    built, _ = peers.our_engines(threads, [1, 8], ["int8"], compiled_draft)
    names = {"ours_int8_plain": "plain", "ours_int8_draft_0.5b_int8_auto": "int8",
             "ours_int8_draft_0.5b_int8_compiled_auto": "int8_compiled"}
    return {names[name]: engine for name, engine in built.items()}


def main() -> None:
    parser = decoding_arguments(__doc__)
    parser.add_argument("--qwen", action="store_true", help="the Qwen pair, int8 (make models)")
    parser.add_argument("--compiled-draft", action="store_true", help="--qwen: also compiled")
    parser.add_argument("--batch8-turns", type=int, default=3, help="batch-8 calls a repeat")
    parser.add_argument("--batches", type=int, nargs="+", choices=(1, 8), default=[1, 8])
    parser.add_argument("--drafts", nargs="+", choices=list(DRAFTS), default=list(DRAFTS))
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    if args.qwen:
        engines = qwen_engines(args.threads, args.compiled_draft)
        prompt_sets, solo = peers.PROMPT_SETS, 4
    else:
        engines, prompt_sets, solo = build_engines(args.threads, args.drafts), PROMPT_SETS, None
    contenders = {name: engine_contender(engine, params) for name, engine in engines.items()}
    contenders[NOISE] = contenders["plain"]
    timings = EngineTimings()
    for _ in range(args.repeats):
        for set_name, prompts in prompt_sets.items():
            if 1 in args.batches:
                timings.time_contenders(contenders, set_name, prompts, [1], solo or len(prompts))
            for _ in range(args.batch8_turns if 8 in args.batches else 0):
                timings.time_contenders(contenders, set_name, prompts, [8])
    tps = {key: round(statistics.median(v), 2) for key, v in timings.rates.items()}
    ratios = {
        f"{set_name}/b{b}/{name}": round(tps[f"{set_name}/b{b}/{name}"]
                                         / tps[f"{set_name}/b{b}/plain"], 3)
        for set_name in prompt_sets for b in args.batches for name in contenders if name != "plain"
    }  # fmt: skip
    noise = {key: ratio for key, ratio in ratios.items() if key.endswith(NOISE)}
    checked = {key: ratio for key, ratio in ratios.items()
               if not key.endswith(("_unchecked", NOISE))}  # fmt: skip
    unchecked = [(k, r) for k, r in ratios.items() if k.endswith("_unchecked")]
    print_result({
        "machine": machine(engines),
        "model": peers.TARGET.path if args.qwen else SMOLLM2.path,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "batch8_turns_per_repeat": args.batch8_turns,
        "all_engine_outputs_identical_to_plain": timings.outputs_identical(),
        "tokens_per_second": tps,
        "ratios_to_plain": ratios,
        "ratios_per_repetition": {
            key: [round(rate / plain, 3) for rate, plain in zip(
                timings.rates[key], timings.rates[key.rsplit("/", 1)[0] + "/plain"], strict=True)]
            for key in ratios
        },
        "lowest_ratio_with_check": min(checked.items(), key=lambda item: item[1]),
        "lowest_ratio_without_check": min(unchecked, key=lambda item: item[1], default=None),
        "noise_floor_plain_against_itself": noise,
        "steps_per_k": {key: value["steps_per_k"] for key, value in timings.acceptance.items()},
        "seconds": {key: value["seconds"] for key, value in timings.acceptance.items()},
        "goal": "every ratio with the check >= 0.97",
    }, args.out)  # fmt: skip


if __name__ == "__main__":
    main()
