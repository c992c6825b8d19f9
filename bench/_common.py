"""Shared by the benchmarks: prompt sets, side-by-side timing with medians, HF baselines.

Runs are interleaved (every contender once per repetition) so drift on this shared, noisy
machine hits all contenders alike; each figure is the median over repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.workloads import SMOLLM2
from generation import kernels
from generation.loading import resolve_model_dir


def machine(engines: dict | None = None) -> dict:
    """What every result file records of where it ran: CPU model, ISA (and any library capped
    below it), torch, threads, and the linear kernels each engine used
    (`CORPUSGEN_DISABLE_KERNELS` forces the fallbacks)."""
    return {
        **kernels.hardware(),
        "isa_caps": {name: os.environ[name] for name in kernels.AVX2_CAPS if name in os.environ},
        "torch_threads": torch.get_num_threads(),
        "disabled_kernels": sorted(kernels.disabled_paths()),
        "kernels": {name: e.hardware_info["cpu_kernels"] for name, e in (engines or {}).items()},
    }


def decoding_arguments(description: str | None, repeats: int = 3) -> argparse.ArgumentParser:
    """The options every decoding benchmark takes: repetitions, torch threads, tokens."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    return parser


def print_result(result: dict, out: Path | None) -> None:
    """A benchmark's JSON on stdout, and in `out` too when given (a results file)."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.write_text(text + "\n")


def median_seconds(runs: list[float]) -> float:
    return statistics.median(runs)


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def load_hf_smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = resolve_model_dir(SMOLLM2)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return model, tokenizer


def hf_generate(
    model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int, **kwargs
) -> list[list[int]]:
    """transformers' generate, greedy, left-padded batch; each row's tokens up to its EOS."""
    width = max(len(p) for p in prompt_ids)
    pad = tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            **kwargs,
        )
    return [row[: row.index(pad) + 1] if pad in row else row for row in out[:, width:].tolist()]


def hf_rate(seconds: float, rows: list[list[int]]) -> float:
    return sum(len(row) for row in rows) / seconds


def rounded(ratio: float | None) -> float | None:
    """Undefined ratios (plain decoding proposes nothing) stay None in the JSON."""
    return None if ratio is None else round(ratio, 3)


def engine_contender(engine, params):
    """An engine as a benchmark contender: prompts -> (each row's tokens, its stats)."""

    def run(prompts: list) -> tuple[list[list[int]], object]:
        engine.reset_stats()
        done = engine.generate(prompts, params)
        return [c.token_ids for c in done], engine.stats

    return run


def hf_contender(model, tokenizer, encode, max_new_tokens: int, **kwargs):
    """transformers' `generate` as a contender (no engine stats); `encode` makes prompt ids."""

    def run(prompts: list) -> tuple[list[list[int]], None]:
        ids = [encode(p) for p in prompts]
        return hf_generate(model, tokenizer, ids, max_new_tokens, **kwargs), None

    return run


def summed_acceptance(stats: list) -> dict:
    """vLLM's acceptance figures over several calls' engine stats, their steps by K, and where
    their time went (prefill, the draft's share of it, plain steps, drafting, verifying, the
    host's work between them)."""
    accepted = sum(s.accepted for s in stats)
    proposed = sum(s.proposed for s in stats)
    rounds = sum(s.rounds for s in stats)
    steps: dict[int, int] = {}
    for s in stats:
        for k, count in s.steps_per_k.items():
            steps[k] = steps.get(k, 0) + count
    seconds = {
        phase: sum(getattr(s, f"{phase}_seconds") for s in stats)
        for phase in ("wall", "prefill", "draft_prefill", "decode", "draft", "verify", "host")
    }
    return {
        "acceptance_rate": rounded(accepted / proposed if proposed else None),
        "mean_accepted_length": rounded(1 + accepted / rounds if rounds else None),
        "steps_per_k": dict(sorted(steps.items())),
        "seconds": {phase: rounded(value) for phase, value in seconds.items()},
        # what decides whether a round pays: a plain step, drafting one token (catch-ups after
        # plain steps included), one verify
        "ms_per": {
            "plain_step": per_call_ms(seconds["decode"], steps.get(0, 0)),
            "drafted_token": per_call_ms(seconds["draft"], sum(k * n for k, n in steps.items())),
            "verify": per_call_ms(seconds["verify"], sum(n for k, n in steps.items() if k)),
        },
    }


def per_call_ms(seconds: float, calls: int) -> float | None:
    return round(1000 * seconds / calls, 1) if calls else None


@dataclass
class EngineTimings:
    """What the speculative benchmarks record per `set/bBATCH/contender` key, over repetitions.

    A contender maps a list of prompts to (each row's tokens, engine stats or None). At batch 1
    the first `solo_prompts` prompts run one at a time, each by every contender before the next
    prompt: a repetition records tokens/s over all of them and each prompt's own rate, so
    ratios can be read per prompt, not from one prompt that may happen to suit one side.
    """

    rates: dict[str, list[float]] = field(default_factory=dict)  # per repetition, all calls
    prompt_rates: dict[str, list[list[float]]] = field(default_factory=dict)  # each call's
    tokens: dict[str, list[list]] = field(default_factory=dict)  # per repetition, each call's
    acceptance: dict[str, dict] = field(default_factory=dict)  # last repetition, summed
    engine_keys: set[str] = field(default_factory=set)

    def time_contenders(
        self, contenders: dict, set_name: str, prompts: list, batches, solo_prompts: int = 1
    ) -> None:
        """One repetition: every contender on each call, side by side."""
        for b in batches:
            calls = [[p] for p in prompts[:solo_prompts]] if b == 1 else [prompts[:b]]
            runs: dict[str, list] = {name: [] for name in contenders}
            for call in calls:
                for name, contender in contenders.items():
                    seconds, (rows, stats) = timed(lambda c=contender, p=call: c(p))
                    runs[name].append((seconds, rows, stats))
            for name, results in runs.items():
                self._record(f"{set_name}/b{b}/{name}", results)

    def _record(self, key: str, results: list) -> None:
        seconds = [s for s, _, _ in results]
        counts = [sum(len(row) for row in rows) for _, rows, _ in results]
        self.rates.setdefault(key, []).append(sum(counts) / sum(seconds))
        self.prompt_rates.setdefault(key, []).append(
            [n / s for n, s in zip(counts, seconds, strict=True)]
        )
        self.tokens.setdefault(key, []).append([rows for _, rows, _ in results])
        stats = [s for _, _, s in results if s is not None]
        if stats:
            self.engine_keys.add(key)
            self.acceptance[key] = summed_acceptance(stats)

    def same_tokens(self, key: str, other: str) -> list[bool]:
        """Per call: whether `key` gave `other`'s tokens in every repetition."""
        return [
            all(
                mine[i] == theirs[i]
                for mine, theirs in zip(self.tokens[key], self.tokens[other], strict=True)
            )
            for i in range(len(self.tokens[key][0]))
        ]

    def outputs_identical(self) -> bool:
        """Greedy: every engine config produced the same tokens."""
        return not self.outputs_differing()

    def outputs_differing(self) -> list[str]:
        """The set/batch keys where some engine config's tokens differ from the others'."""
        runs: dict[str, list] = {}
        for key in sorted(self.engine_keys):
            runs.setdefault(key.rsplit("/", 1)[0], []).extend(self.tokens[key])
        return [key for key, tokens in runs.items() if any(t != tokens[0] for t in tokens)]


def copy_bandwidth_bytes_per_second(megabytes: int = 256, repeats: int = 5) -> float:
    """STREAM-style copy: bytes read + written per second, median of `repeats`."""
    source = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32).uniform_()
    target = torch.empty_like(source)
    runs = []
    for _ in range(repeats):
        seconds, _ = timed(lambda: target.copy_(source))
        runs.append(2 * source.numel() * 4 / seconds)
    return statistics.median(runs)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of distinct weights: what one decoding forward reads (tied weights once, and the
    oneDNN-packed copies of bf16 linears, whose originals are gone)."""
    from generation.packing import PackedLinear

    seen, total = set(), 0
    for param in model.parameters():
        if param.data_ptr() not in seen:
            seen.add(param.data_ptr())
            total += param.numel() * param.element_size()
    for module in model.modules():
        if isinstance(module, PackedLinear):
            total += module.packed.numel() * module.packed.element_size()
    return total
