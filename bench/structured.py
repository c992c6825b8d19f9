"""What structured output (SamplingParams.response_format) costs and buys, on SmolLM2 and on the
Qwen2.5-Coder pair.

Four prompts ask for one quiz record each as a JSON object with "question", "answer" and
"difficulty" keys. Every contender decodes the same prompts twice: free (the prompt alone asks for
JSON) and under the record's JSON schema. Reported, per model, batch and contender: tokens/s
(medians of interleaved repetitions; batch 1 runs each prompt alone, every contender in both
modes on a prompt before the next, so free and schema meet the same load on this shared host),
speculation's acceptance and its speed against plain decoding under the same constraint, the
share of valid records (whole text through `json.loads` and the schema; also leniently, the span
from the first "{" to the last "}", which forgives code fences and chatter), and what
`logprobs=True` costs. Engines: SmolLM2 plain, its int8 self-draft and prompt lookup (K auto);
the Qwen 1.5B target plain and with its 0.5B int8 draft (K auto), as bench/qwen_pair.py builds
them. Also the engine's mask work alone per step (generation.grammar) beside llguidance's
bitmask fills alone, logprobs' work alone, and the one-time cost of a first structured call.

Greedy, one torch thread, one process. Prints JSON; `--out FILE` writes it too.
Usage: python bench/structured.py [--models smollm2 qwen] [--repeats 2] [--qwen-repeats 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jsonschema
import torch

from bench._common import EngineTimings, machine, print_result, rounded, timed
from bench.grammar_libraries import SCHEMA, TEXTS
from bench.workloads import SMOLLM2
from generation import Engine
from generation.grammar import masks_after
from schemas import BucketGrid, DraftSpec, EngineConfig, SamplingParams
from schemas.engine import ResponseFormat

RECORD = ResponseFormat.model_validate(
    {"type": "json_schema", "json_schema": {"name": "quiz_record", "schema": SCHEMA}}
)
TOPICS = ["the water cycle", "prime numbers", "the French Revolution", "how vaccines work"]
PROMPTS = [
    [{"role": "user", "content": f"Write one quiz record about {topic} as a JSON object with "
      'the keys "question", "answer" and "difficulty" (one of "easy", "medium", "hard"). '
      "Keep the question short and the answer to one short sentence. Reply with the JSON "
      "object only."}]
    for topic in TOPICS
]
MODES = {"free": None, "schema": RECORD}
SMOLLM2_GRID = BucketGrid(
    batch_sizes=[1, 4], prompt_lengths=[96], cache_lengths=[192], draft_lengths=[2, 4, 6]
)
SMOLLM2_ENGINES = {
    "plain": dict(draft=None),
    "int8_auto": dict(draft=DraftSpec(kind="quantized", dtype="int8")),
    "prompt_lookup_auto": dict(draft=DraftSpec(kind="prompt_lookup", ngram_max=3)),
}
QWEN_ENGINES = ["plain", "draft_0.5b_int8_auto"]  # bench/qwen_pair.py's names
QWEN_GRID = BucketGrid(  # the prompts are 99-101 tokens with Qwen's template
    batch_sizes=[1, 4], prompt_lengths=[128], cache_lengths=[192],
    draft_lengths=[2, 3, 4, 5, 6],
)


def build(model: str, threads: int) -> dict[str, Engine]:
    if model == "smollm2":
        engines = {}
        for name, overrides in SMOLLM2_ENGINES.items():
            config = EngineConfig(target=SMOLLM2, device="cpu", bucket_grid=SMOLLM2_GRID,
                                  cpu_threads=threads, **overrides)
            engines[name] = Engine.from_config(config)
            engines[name].warmup()
        return engines
    from bench.qwen_pair import build_engines

    return build_engines("bfloat16", threads, QWEN_ENGINES, QWEN_GRID)


def contender(engine: Engine, params: SamplingParams, texts: dict, key: str):
    """An engine as an EngineTimings contender, keeping its completions (the last repetition's)
    under `texts[key]` for the validity count."""

    def run(prompts: list) -> tuple[list[list[int]], object]:
        engine.reset_stats()
        done = engine.generate(prompts, params)
        texts.setdefault(key, {}).update({id(p): c for p, c in zip(prompts, done, strict=True)})
        return [c.token_ids for c in done], engine.stats

    return run


def first_structured_call(engine: Engine) -> dict:
    """The one-time cost a first structured call pays: llguidance's view of the tokenizer
    (`Engine.grammars`, built per engine), a matcher and its first mask."""
    built, grammars = timed(lambda: engine.grammars)
    first_mask, _ = timed(lambda: grammars.matcher(RECORD).allowed())
    return {"grammars_seconds": round(built, 2), "first_mask_seconds": round(first_mask, 3)}


def mask_overhead(engine: Engine, batch: int = 4, k: int = 4, repeats: int = 3) -> dict:
    """The engine's grammar work per decode step alone, ms, `batch` rows walking reference
    records: `masks_after` for a plain step (1 mask a row) and for a verify of K drafted tokens
    (K + 1 masks a row, the K rolled back), as [rows, positions, vocab] bool; and llguidance's
    bitmask fills alone for the same masks, the floor of that work."""
    grammars = engine.grammars
    rows = [engine.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS[:batch]]
    bits = grammars.words(1)
    timings: dict[str, list[float]] = {"plain_step": [], f"verify_k{k}": [],
                                       "fills_alone_plain_step": [],
                                       f"fills_alone_verify_k{k}": []}
    for _ in range(repeats):
        matchers = [grammars.matcher(RECORD) for _ in rows]
        for step in range(min(len(r) for r in rows) - k):
            drafts = [r[step:step + k] for r in rows]
            for width in (0, k):
                cut = [d[:width] for d in drafts]
                started = time.perf_counter()
                masks_after(matchers, cut)
                timings[f"verify_k{k}" if width else "plain_step"].append(ms_since(started))
                started = time.perf_counter()
                for m, d in zip(matchers, cut, strict=True):
                    m.fill(bits, 0)
                    for token in d:
                        m.matcher.consume_token(token)
                        m.fill(bits, 0)
                    m.rollback(len(d))
                name = f"fills_alone_verify_k{k}" if width else "fills_alone_plain_step"
                timings[name].append(ms_since(started))
            for m, r in zip(matchers, rows, strict=True):
                m.consume([r[step]])
    return {"rows": batch, "vocab": grammars.vocab,
            "ms_median": {name: round(statistics.median(v), 3) for name, v in timings.items()}}


def logprobs_ms(engine: Engine, dtype: torch.dtype, batch: int = 4, repeats: int = 20) -> dict:
    """What logprobs=True adds to a step alone: the kept tokens' log-probabilities from the
    step's logits [batch, positions, vocab], ms (median)."""
    vocab = engine.target.model.config.vocab_size
    params = SamplingParams(logprobs=True)
    out = {}
    for positions in (1, 5):
        logits = torch.randn(batch, positions, vocab).to(dtype)
        kept = [[1] * positions] * batch
        runs = [timed(lambda lg=logits, k=kept: engine._kept_logprobs(lg, k, params))[0]
                for _ in range(repeats)]
        out[f"[{batch}, {positions}]"] = round(1000 * statistics.median(runs), 3)
    return out


def ms_since(started: float) -> float:
    return 1000 * (time.perf_counter() - started)


def validity(completions: list) -> dict:
    """Of the rows: how many closed (finish stop), parse and validate whole, and leniently."""
    def valid(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            return True
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False

    def braces(text: str) -> str:
        return text[text.find("{"):text.rfind("}") + 1] if "{" in text else ""

    return {"rows": len(completions),
            "finished_stop": sum(c.finish_reason == "stop" for c in completions),
            "valid": sum(valid(c.text) for c in completions),
            "valid_lenient": sum(valid(braces(c.text)) for c in completions),
            "tokens": sum(len(c.token_ids) for c in completions)}


def parts(key: str) -> tuple[str, str, str]:
    """'qa/b1/plain|schema' -> ('b1', 'plain', 'schema')."""
    _, batch, contender_mode = key.split("/")
    name, mode = contender_mode.split("|")
    return batch, name, mode


def run_model(model: str, args) -> dict:
    started = time.perf_counter()
    engines = build(model, args.threads)
    repeats = args.repeats if model == "smollm2" else args.qwen_repeats
    logprob_batches = args.logprobs_batches if model == "smollm2" else args.qwen_logprobs_batches
    one_time = {name: first_structured_call(engine) for name, engine in engines.items()}
    for engine in engines.values():  # every contender's first structured call done before timing
        engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4, response_format=RECORD))
    texts: dict[str, dict] = {}
    timings = EngineTimings()
    for _ in range(repeats):
        for b in args.batches:
            # Free and schema side by side: on each prompt every engine runs in both modes.
            side_by_side = {}
            for mode, response_format in MODES.items():
                params = SamplingParams(max_new_tokens=args.max_new_tokens,
                                        response_format=response_format)
                for name, engine in engines.items():
                    side_by_side[f"{name}|{mode}"] = contender(
                        engine, params, texts, f"b{b}/{name}|{mode}")
                if b in logprob_batches:
                    side_by_side[f"plain+logprobs|{mode}"] = contender(
                        engines["plain"], params.model_copy(update={"logprobs": True}), texts,
                        f"b{b}/plain+logprobs|{mode}")
            timings.time_contenders(side_by_side, "qa", PROMPTS, [b], len(PROMPTS))
    tps = {key.split("/", 1)[1]: round(statistics.median(v), 3)
           for key, v in timings.rates.items()}
    ratios = {}
    for key, value in tps.items():
        batch, name, mode = parts(f"qa/{key}")
        if name != "plain":
            ratios[f"{key}_vs_plain"] = rounded(value / tps[f"{batch}/plain|{mode}"])
        if mode == "schema":
            ratios[f"{batch}/{name}_schema_vs_free"] = rounded(value / tps[f"{batch}/{name}|free"])
    per_prompt = {}  # batch 1, each prompt's ratio (median over repetitions)
    for key, rates in timings.prompt_rates.items():
        batch, name, mode = parts(key)
        others = [(f"qa/{batch}/plain|{mode}", "plain")] if name != "plain" else []
        others += [(f"qa/{batch}/{name}|free", "free")] if mode == "schema" else []
        for other, label in others if batch == "b1" else []:
            base = timings.prompt_rates[other]
            per_prompt[f"{key.split('/', 1)[1]}_vs_{label}"] = [
                rounded(statistics.median(m[i] / p[i] for m, p in zip(rates, base, strict=True)))
                for i in range(len(rates[0]))]
    identical = {}  # per batch and mode: every contender's tokens equal plain's, every call
    for key in timings.tokens:
        batch, name, mode = parts(key)
        if name != "plain":
            same = timings.same_tokens(key, f"qa/{batch}/plain|{mode}")
            identical[f"{batch}/{mode}"] = identical.get(f"{batch}/{mode}", True) and all(same)
    records = {key: validity([done[id(p)] for p in PROMPTS]) for key, done in texts.items()}
    steps = {}  # the last repetition's decoding alone: prefill and rows left idle set aside
    for key, summed in timings.acceptance.items():
        key = key.split("/", 1)[1]
        seconds, batch_steps = summed["seconds"], sum(summed["steps_per_k"].values())
        decoding = seconds["decode"] + seconds["draft"] + seconds["verify"]
        steps[key] = {
            "ms_per_batch_step": rounded(1000 * decoding / batch_steps),
            "decode_tokens_per_second": rounded(
                (records[key]["tokens"] - records[key]["rows"])
                / (seconds["wall"] - seconds["prefill"])),
            "batch_steps": batch_steps,
        }
    dtype = torch.float32 if model == "smollm2" else torch.bfloat16
    return {
        "machine": machine(engines),
        "engines": list(engines), "repeats": repeats,
        "grid": (SMOLLM2_GRID if model == "smollm2" else QWEN_GRID).model_dump(),
        "prompt_tokens": [len(engines["plain"].encode(p)) for p in PROMPTS],
        "tokens_identical_to_plain": identical,
        "tokens_per_second": tps, "ratios": ratios, "batch_1_per_prompt_ratios": per_prompt,
        "acceptance": {key.split("/", 1)[1]: value for key, value in timings.acceptance.items()},
        "decoding": steps,
        "records": records,
        "sample_texts": {key: [done[id(p)].text for p in PROMPTS[:2]]
                         for key, done in texts.items() if key.startswith("b1/plain|")},
        "first_structured_call": one_time,
        "mask_overhead": mask_overhead(engines["plain"]),
        "logprobs_ms_alone": logprobs_ms(engines["plain"], dtype),
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", choices=["smollm2", "qwen"],
                        default=["smollm2", "qwen"])
    parser.add_argument("--repeats", type=int, default=2, help="SmolLM2's repetitions")
    parser.add_argument("--qwen-repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--logprobs-batches", type=int, nargs="*", default=[4],
                        help="SmolLM2 batches that also run plain with logprobs=True")
    parser.add_argument("--qwen-logprobs-batches", type=int, nargs="*", default=[4])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result = {"schema": SCHEMA, "prompts": PROMPTS, "max_new_tokens": args.max_new_tokens,
              "torch_threads": args.threads, "batches": args.batches, "models": {}}
    for model in args.models:
        result["models"][model] = run_model(model, args)
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    print_result(result, args.out)


if __name__ == "__main__":
    main()
