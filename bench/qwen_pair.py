"""Speculation on a real pair: Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft (`make models`).

One process, one thread, greedy, the same prompts for every contender, interleaved repetitions,
medians. Engine: plain target; + 0.5B draft (bf16, and its linears int8) at K fixed and auto;
+ prompt lookup. transformers at batch 1 (its assisted generation refuses batch > 1): plain
`generate`, assisted with the same 0.5B (`assistant_model`), prompt lookup. Code prompts
(copy-heavy: refactor / complete this code) and free text, batch 1 and 8. Batch 1 runs each of
a set's 8 prompts alone, every contender on a prompt before the next, and reports per-prompt
ratios beside the set's tokens/s. Prints JSON; commit it under bench/results/.
Usage: python bench/qwen_pair.py [--repeats 3] [--threads 1] [--max-new-tokens 64]
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
    hf_generate,
    machine,
)
from generation import Engine
from generation.loading import (
    DTYPES,
    draft_proposer,
    load_model,
    load_tokenizer,
    resolve_model_dir,
)
from generation.proposers import ModelProposer, PromptLookupProposer
from generation.quantize import int8_weights
from schemas import BucketGrid, DraftSpec, EngineConfig, ModelSpec, SamplingParams

TARGET = ModelSpec(path="packaged:qwen2.5-coder-1.5b-instruct")
DRAFT = ModelSpec(path="packaged:qwen2.5-coder-0.5b-instruct")
GRID = BucketGrid(
    batch_sizes=[1, 8],
    # Power-of-two buckets with midpoints: a prefill is compute-bound here, and every padded
    # token costs plain and speculating engines alike (code prompts are 73-88 tokens).
    prompt_lengths=[32, 48, 64, 96, 128, 192, 256],
    cache_lengths=[384],
    draft_lengths=[2, 3, 4, 5, 6, 8],  # fine steps: where a round's drafting may stop
)
SNIPPETS = [
    "def mean(xs):\n    total = 0\n    for x in xs:\n        total = total + x\n"
    "    return total / len(xs)\n",
    "def find_user(users, name):\n    for user in users:\n        if user['name'] == name:\n"
    "            return user\n    return None\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
    "def read_lines(path):\n    f = open(path)\n    lines = f.readlines()\n    f.close()\n"
    "    return [l.strip() for l in lines]\n",
]
CODE = [
    [{"role": "user", "content": f"Add type hints and a docstring to this function, keep the "
                                 f"rest unchanged:\n\n```python\n{code}```"}]
    for code in SNIPPETS
] + [
    [{"role": "user", "content": f"Rename the variables to clearer names in this code:\n\n"
                                 f"```python\n{code}```"}]
    for code in SNIPPETS
]
FREE_TEXT = [
    [{"role": "user", "content": question}]
    for question in (
        "Explain what a hash table is to a new programmer.",
        "Why do databases use indexes?",
        "What is the difference between a process and a thread?",
        "Describe how HTTP caching works.",
        "What makes a good code review?",
        "Explain recursion with an everyday example.",
        "Why is floating point arithmetic inexact?",
        "What does a compiler do?",
    )
]
PROMPT_SETS = {"code": CODE, "free_text": FREE_TEXT}
ENGINES = {
    "plain": dict(draft=None),
    "draft_0.5b_auto": dict(draft=DraftSpec(kind="model", model=DRAFT)),
    "draft_0.5b_k4": dict(draft=DraftSpec(kind="model", model=DRAFT), num_draft_tokens=4),
    "draft_0.5b_int8_auto": dict(draft=DraftSpec(kind="model", model=DRAFT, dtype="int8")),
    # Its forwards compiled (the target stays eager: packed bf16 beats compiled there).
    "draft_0.5b_int8_compiled_auto": dict(
        draft=DraftSpec(kind="model", model=DRAFT, dtype="int8", compile=True)
    ),
    "draft_0.5b_int8_auto_no_early_stop": dict(
        draft=DraftSpec(kind="model", model=DRAFT, dtype="int8"), stop_drafting_early=False
    ),
    "draft_0.5b_int8_k4": dict(
        draft=DraftSpec(kind="model", model=DRAFT, dtype="int8"), num_draft_tokens=4
    ),
    "prompt_lookup_auto": dict(draft=DraftSpec(kind="prompt_lookup", ngram_max=3)),
    # The target's own linears int8 (quantize: int8, exact integer GEMMs): another model, so
    # its speculation is compared with its own plain decoding.
    "int8_target_plain": dict(draft=None, int8_target=True),
    "int8_target_draft_0.5b_int8_auto": dict(
        draft=DraftSpec(kind="model", model=DRAFT, dtype="int8"), int8_target=True
    ),
}
DEFAULT_ENGINES = [name for name, overrides in ENGINES.items() if "int8_target" not in overrides]


def hf_models(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(resolve_model_dir(TARGET), dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(resolve_model_dir(DRAFT), dtype=dtype).eval()
    return target, draft, load_tokenizer(resolve_model_dir(TARGET))


def build_engines(
    dtype: str, threads: int, names: list[str], grid: BucketGrid
) -> dict[str, Engine]:
    """Every contender over the same loaded weights (one copy of each model in memory)."""
    device = torch.device("cpu")
    target_spec = TARGET.model_copy(update={"dtype": dtype})
    draft_spec = DRAFT.model_copy(update={"dtype": dtype})
    target = load_model(target_spec, grid.max_cache, device)
    draft = load_model(draft_spec, grid.max_cache, device)
    draft_models = {None: draft.model}
    if any(ENGINES[name].get("draft") and ENGINES[name]["draft"].dtype for name in names):
        draft_models["int8"] = int8_weights(copy.deepcopy(draft.model))
    targets = {False: (target_spec, target)}
    if any(ENGINES[name].get("int8_target") for name in names):
        int8_spec = target_spec.model_copy(update={"quantize": "int8"})
        targets[True] = (int8_spec, load_model(int8_spec, grid.max_cache, device))  # smoothed
    engines = {}
    for name in names:
        overrides = dict(ENGINES[name])
        spec = overrides.get("draft")
        engine_target_spec, engine_target = targets[overrides.pop("int8_target", False)]
        if spec is not None and spec.kind == "model":
            overrides = {**overrides, "draft": spec.model_copy(update={"model": draft_spec})}
        config = EngineConfig(target=engine_target_spec, device="cpu", bucket_grid=grid,
                              cpu_threads=threads, **overrides)
        proposer, loaded_draft = None, None
        if spec is not None and spec.kind == "model":
            model = draft_models[spec.dtype]
            proposer = draft_proposer(model, grid, device, DTYPES[dtype], bool(spec.compile))
            loaded_draft = draft
        elif spec is not None:
            proposer = PromptLookupProposer(spec.ngram_max, spec.ngram_min)
        engines[name] = Engine(config, engine_target, device, proposer, loaded_draft)
        engines[name].warmup()
    return engines


def main() -> None:
    parser = decoding_arguments(__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--solo-prompts", type=int, default=8,
                        help="batch 1 runs this many of each set's prompts, one at a time")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--engines", nargs="+", choices=list(ENGINES), default=DEFAULT_ENGINES)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    parser.add_argument("--draft-lengths", type=int, nargs="+", default=GRID.draft_lengths)
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=GRID.prompt_lengths,
                        help="prefill buckets (v4 and earlier results: 64 128 256)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    names = ["plain", *(name for name in args.engines if name != "plain")]
    grid = GRID.model_copy(update={  # only the batch sizes run: warm-up skips the others
        "batch_sizes": sorted(args.batches), "prompt_lengths": args.prompt_lengths,
        "draft_lengths": args.draft_lengths,
    })
    engines = build_engines(args.dtype, args.threads, names, grid)
    contenders = {name: engine_contender(engine, params) for name, engine in engines.items()}
    baselines = {}
    if not args.no_hf and 1 in args.batches:  # transformers' assisted generation is batch 1
        baselines = hf_baselines(DTYPES[args.dtype], engines["plain"].encode, args.max_new_tokens)

    timings = EngineTimings()
    for _ in range(args.repeats):
        for set_name, prompts in PROMPT_SETS.items():
            for b in args.batches:
                side_by_side = contenders | (baselines if b == 1 else {})
                timings.time_contenders(side_by_side, set_name, prompts, [b], args.solo_prompts)

    tps = {key: round(statistics.median(values), 3) for key, values in timings.rates.items()}
    hf_same_as_plain = {  # per batch-1 prompt: transformers' tokens == our plain engine's
        key: timings.same_tokens(key, f"{key.rsplit('/', 1)[0]}/plain")
        for key in timings.rates if key.rsplit("/", 1)[1] in baselines
    }
    print(json.dumps({
        "machine": machine(engines),
        "target": TARGET.path, "draft": DRAFT.path, "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens, "draft_lengths": grid.draft_lengths,
        "prompt_lengths": grid.prompt_lengths,
        "repeats": args.repeats, "torch_threads": args.threads,
        "batch_1_prompts_per_set": args.solo_prompts,
        "all_engine_outputs_identical_to_plain": timings.outputs_identical(),
        "outputs_differing_in": timings.outputs_differing(),
        "transformers_tokens_equal_to_plain_engine": hf_same_as_plain,
        "tokens_per_second": tps, "ratios": ratios_between(tps),
        "batch_1_per_prompt": per_prompt_ratios(timings),
        "acceptance": timings.acceptance,
        "decode_step_ms": decode_step_ms(engines),
        "targets": {"code/b1 draft vs plain": ">= 1.8", "free_text/b1 draft vs plain": ">= 1.3",
                    "b1 draft vs hf assisted": ">= 1.3", "b8 vs plain": ">= 1.0",
                    "prompt lookup vs hf prompt lookup (code)": ">= 1.0"},
    }, indent=2))


def hf_baselines(dtype: torch.dtype, encode, max_new_tokens: int) -> dict:
    """transformers at batch 1 over the same weights: plain, assisted by the 0.5B, prompt
    lookup; each warmed up once, so no contender pays a first call's one-off costs."""
    target, draft, tokenizer = hf_models(dtype)
    options = {"hf_plain": {}, "hf_assisted_0.5b": {"assistant_model": draft},
               "hf_prompt_lookup": {"prompt_lookup_num_tokens": 4}}
    for kwargs in options.values():
        hf_generate(target, tokenizer, [encode(FREE_TEXT[0])], 8, **kwargs)
    return {name: hf_contender(target, tokenizer, encode, max_new_tokens, **kwargs)
            for name, kwargs in options.items()}


PAIRS = [("draft_0.5b_auto", "hf_assisted_0.5b"), ("draft_0.5b_int8_auto", "hf_assisted_0.5b"),
         ("draft_0.5b_int8_compiled_auto", "hf_assisted_0.5b"),
         ("prompt_lookup_auto", "hf_prompt_lookup"), ("hf_assisted_0.5b", "hf_plain"),
         ("int8_target_draft_0.5b_int8_auto", "int8_target_plain")]


def ratios_between(tps: dict[str, float]) -> dict[str, float]:
    """Each contender vs plain at its set and batch; ours vs transformers' at batch 1."""
    ratios = {}
    for key, value in tps.items():
        prefix, name = key.rsplit("/", 1)
        if name != "plain" and not name.startswith("hf_") and f"{prefix}/plain" in tps:
            ratios[f"{key}_vs_plain"] = round(value / tps[f"{prefix}/plain"], 3)
        for ours, theirs in PAIRS:
            if name == ours and f"{prefix}/{theirs}" in tps:
                ratios[f"{key}_vs_{theirs}"] = round(value / tps[f"{prefix}/{theirs}"], 3)
    return ratios


def decode_step_ms(engines: dict[str, Engine]) -> dict[str, dict[str, dict[str, float]]]:
    """Each engine's decode forwards per model and [batch, tokens] shape, in ms, as its runners
    priced them at the end of the run (the fastest warm-up call, then a moving average over
    the calls made)."""
    out = {}
    for name, engine in engines.items():
        runners = {"target": engine.target}
        if isinstance(engine.proposer, ModelProposer):
            runners["draft"] = engine.proposer.runner
        out[name] = {
            model: {f"[{b}, {t}]": round(1000 * seconds, 1)
                    for (kind, b, t, _), seconds in sorted(runner.recent_seconds.items())
                    if kind == "decode"}
            for model, runner in runners.items()
        }
    return out


def per_prompt_ratios(timings: EngineTimings) -> dict:
    """Batch 1, prompt by prompt: each pair's ratio (median over repetitions), their median, and
    vs transformers the median over only the prompts where both decoded the same tokens (in
    bf16 a near tie can flip either way, and a different continuation is a different task)."""
    out = {}
    for key in timings.prompt_rates:
        prefix, name = key.rsplit("/", 1)
        if not prefix.endswith("/b1"):
            continue
        others = ([] if name == "plain" or name.startswith("hf_") else ["plain"]) + [
            theirs for ours, theirs in PAIRS if ours == name]
        for other in others:
            if f"{prefix}/{other}" not in timings.prompt_rates:
                continue
            mine, theirs = timings.prompt_rates[key], timings.prompt_rates[f"{prefix}/{other}"]
            ratios = [
                round(statistics.median(m[i] / t[i] for m, t in zip(mine, theirs, strict=True)), 3)
                for i in range(len(mine[0]))
            ]
            entry = {"each": ratios, "median": round(statistics.median(ratios), 3)}
            if other.startswith("hf_"):
                same = timings.same_tokens(key, f"{prefix}/{other}")
                alike = [r for r, s in zip(ratios, same, strict=True) if s]
                entry["same_tokens"] = same
                entry["median_same_tokens"] = round(statistics.median(alike), 3) if alike else None
            out[f"{key}_vs_{other}"] = entry
    return out


if __name__ == "__main__":
    main()
