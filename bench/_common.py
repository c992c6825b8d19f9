"""Shared by the benchmarks: prompt sets, side-by-side timing with medians, HF baselines.

Runs are interleaved (every contender once per repetition) so drift on this shared, noisy
machine hits all contenders alike; each figure is the median over repetitions.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from generation.loading import resolve_model_dir
from schemas import ModelSpec

SMOLLM2 = ModelSpec(path="packaged:smollm2-135m-instruct")

STORY_TOPICS = [
    "a lighthouse keeper who finds a message in a bottle",
    "a robot learning to paint",
    "two friends lost in a night market",
    "a dragon who is afraid of heights",
    "a detective cat solving a mystery in a library",
    "the last tree on a space station",
    "a baker who can taste memories",
    "a girl who befriends a thunderstorm",
]
FREE_TEXT = [[{"role": "user", "content": f"Write a short story about {t}."}] for t in STORY_TOPICS]

PARAGRAPHS = [
    "The city council met on Tuesday evening to discuss the new public library. Residents asked "
    "for longer opening hours, more study rooms and a larger children's section. The council "
    "agreed to publish a revised plan before the end of the month.",
    "Photosynthesis is the process by which green plants use sunlight to make food from carbon "
    "dioxide and water. It takes place mainly in the leaves, inside small structures called "
    "chloroplasts, and it releases oxygen into the air as a by-product.",
    "Our team shipped the new release on Friday. It fixes the login timeout, speeds up the search "
    "page by a third and adds an export button to every report. Please update before Monday so "
    "that the old servers can be switched off.",
    "The river rises every spring when the snow melts in the mountains. Farmers along its banks "
    "plant late, after the water has gone down, and the rich soil it leaves behind gives them "
    "some of the best harvests in the region.",
]
COPY_HEAVY = [
    [{"role": "user", "content": f"Rewrite the following paragraph, keeping its wording:\n\n{p}"}]
    for p in PARAGRAPHS * 2
]
PROMPT_SETS = {"free_text": FREE_TEXT, "copy": COPY_HEAVY}


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


@dataclass
class EngineTimings:
    """What the speculative benchmarks record per `set/bBATCH/engine` key, over repetitions."""

    rates: dict[str, list[float]] = field(default_factory=dict)  # tokens/s per repetition
    acceptance: dict[str, dict] = field(default_factory=dict)
    outputs: dict[str, list] = field(default_factory=dict)  # per set/batch: tokens per engine

    def time_engines(self, engines: dict, set_name: str, prompts: list, batches, params) -> None:
        """One repetition: every engine once on each batch size, side by side."""
        for b in batches:
            batch = prompts[:b]
            for name, engine in engines.items():
                engine.reset_stats()
                seconds, done = timed(lambda e=engine, p=batch: e.generate(p, params))
                key = f"{set_name}/b{b}/{name}"
                self.rates.setdefault(key, []).append(sum(len(c.token_ids) for c in done) / seconds)
                stats = engine.stats
                self.acceptance[key] = {
                    "acceptance_rate": rounded(stats.acceptance_rate),
                    "mean_accepted_length": rounded(stats.mean_accepted_length),
                    "steps_per_k": stats.steps_per_k,
                }
                self.outputs.setdefault(f"{set_name}/b{b}", []).append(
                    [c.token_ids for c in done]
                )

    def outputs_identical(self) -> bool:
        """Greedy: every engine config produced the same tokens."""
        return not self.outputs_differing()

    def outputs_differing(self) -> list[str]:
        """The set/batch keys where some engine config's tokens differ from the others'."""
        return [key for key, runs in self.outputs.items() if any(run != runs[0] for run in runs)]


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
    """Bytes of distinct parameters: what one decoding forward reads (tied weights once)."""
    seen, total = set(), 0
    for param in model.parameters():
        if param.data_ptr() not in seen:
            seen.add(param.data_ptr())
            total += param.numel() * param.element_size()
    return total
