"""Seeded sampling under speculation (coupled verification, the default): a record's completion
is a function of (target model, prompt, seed, sampling params) alone, the same alone or in any
batch, with no draft or any draft kind, at any K, fixed or auto, on any call."""

from __future__ import annotations

import math
import random

import pytest
import torch
from engine_helpers import (
    DRAFT_NAMES,
    SMALL_GRID,
    drafts,
    engine_for,
    needs_exact_int8,
    varied_prompts,
)

from generation import Engine
from generation.draft_length import FixedDraftLength
from generation.sampling import RowRandom, gumbel, position_keys
from schemas import DraftSpec, EngineConfig, ModelSpec, SamplingParams

PROMPTS = [*varied_prompts(7), "the cat sat on the mat the cat sat on the mat the cat"]
SEEDS = [1000 + 17 * i for i in range(len(PROMPTS))]
SAMPLING = {
    "plain": SamplingParams(max_new_tokens=12, temperature=1.0),
    "top-k-top-p": SamplingParams(max_new_tokens=12, temperature=0.8, top_k=40, top_p=0.9),
    "top-p": SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.8),  # full-sort fallback
}


def alone(engine: Engine, params: SamplingParams) -> list[list[int]]:
    """Each prompt in its own call: no neighbours."""
    return [
        engine.generate([prompt], params, seeds=[seed])[0].token_ids
        for prompt, seed in zip(PROMPTS, SEEDS, strict=True)
    ]


def shuffled(engine: Engine, params: SamplingParams, order_seed: int) -> list[list[int]]:
    """All prompts in one call, in a shuffled order (other neighbours and cache rows)."""
    order = list(range(len(PROMPTS)))
    random.Random(order_seed).shuffle(order)
    done = engine.generate([PROMPTS[i] for i in order], params, seeds=[SEEDS[i] for i in order])
    tokens: list[list[int] | None] = [None] * len(PROMPTS)
    for position, index in enumerate(order):
        tokens[index] = done[position].token_ids
    return tokens


def assert_seeded_records_hold_under_an_int8_draft(
    spec: ModelSpec, plain: Engine, draft_model: ModelSpec
) -> None:
    """`spec`'s seeded records are the same alone, in a shuffled batch of `plain` (an engine of
    `spec`), and under an int8 draft of `draft_model` at K=2 and K auto."""
    params = SAMPLING["top-k-top-p"]
    one_row = SMALL_GRID.model_copy(update={"batch_sizes": [1]})
    expected = alone(engine_for(spec.path, target=spec, bucket_grid=one_row), params)
    assert shuffled(plain, params, order_seed=3) == expected
    draft = DraftSpec(kind="model", model=draft_model.model_copy(update={"dtype": "bfloat16"}),
                      dtype="int8")
    speculative = engine_for(spec.path, target=spec, draft=draft, num_draft_tokens="auto")
    auto = speculative.draft_length
    for order_seed, k in enumerate([2, None]):
        speculative.draft_length = auto if k is None else FixedDraftLength(k)
        assert shuffled(speculative, params, order_seed) == expected, k
    assert speculative.stats.rounds > 0


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> dict[str, list[list[int]]]:
    """Plain decoding, batch 1, every prompt alone: what every other setting must reproduce."""
    one_row = SMALL_GRID.model_copy(update={"batch_sizes": [1]})
    engine = engine_for(tiny_llama_dir, bucket_grid=one_row)
    return {name: alone(engine, params) for name, params in SAMPLING.items()}


def test_reference_is_really_sampled(tiny_llama_dir, reference):
    """Guards the tests below against a vacuous pass: the seed matters and it is not greedy."""
    engine = engine_for(tiny_llama_dir)
    params = SAMPLING["plain"]
    reseeded = engine.generate(PROMPTS, params, seeds=[s + 1 for s in SEEDS])
    greedy = engine.generate(PROMPTS, params.model_copy(update={"temperature": 0.0}))
    assert sum(r.token_ids != t for r, t in zip(reseeded, reference["plain"], strict=True)) >= 6
    assert sum(g.token_ids != t for g, t in zip(greedy, reference["plain"], strict=True)) >= 6


def test_plain_sampling_ignores_batch_and_order(tiny_llama_dir, reference):
    engine = engine_for(tiny_llama_dir)
    for name, params in SAMPLING.items():
        assert shuffled(engine, params, order_seed=1) == reference[name], name
        assert shuffled(engine, params, order_seed=2) == reference[name], name


def prefill_forwards(runner) -> int:
    return sum(count for key, count in runner.shapes.items() if key[0] == "prefill")


def test_a_prompt_repeated_in_a_call_prefills_once_and_samples_as_if_alone(
    tiny_llama_dir, tiny_llama_other_dir
):
    """samples_per_prompt's samples of one prompt, admitted together: target and draft run one
    prefill per distinct prompt, and every copy gets the records it gets alone (a copied cache
    that differed from its own prefill's would move its tokens)."""
    one_row = SMALL_GRID.model_copy(update={"batch_sizes": [1]})
    params = SAMPLING["plain"]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[0]]
    seeds = [5, 6, 7, 8]
    alone = engine_for(tiny_llama_dir, bucket_grid=one_row)
    expected = [alone.generate([prompt], params, seeds=[seed])[0].token_ids
                for prompt, seed in zip(prompts, seeds, strict=True)]
    assert len({tuple(expected[i]) for i in (0, 2, 3)}) == 3  # the copies are sampled apart
    spec = drafts(tiny_llama_dir, tiny_llama_other_dir)["independent-model"]
    engine = engine_for(tiny_llama_dir, draft=spec, num_draft_tokens=2)
    runners = {"target": engine.target, "draft": engine.proposer.runner}
    before = {name: prefill_forwards(runner) for name, runner in runners.items()}
    done = engine.generate(prompts, params, seeds=seeds)
    assert [c.token_ids for c in done] == expected
    assert engine.stats.rounds > 0
    assert {name: prefill_forwards(runner) - before[name] for name, runner in runners.items()} \
        == {"target": 2, "draft": 2}


@pytest.mark.parametrize("draft", DRAFT_NAMES)
def test_every_draft_and_k_reproduces_plain_sampling(
    draft, tiny_llama_dir, tiny_llama_other_dir, reference
):
    spec = drafts(tiny_llama_dir, tiny_llama_other_dir)[draft]
    engine = engine_for(tiny_llama_dir, draft=spec, num_draft_tokens="auto")
    accepted, auto = 0, engine.draft_length
    for order_seed, (name, k) in enumerate(
        [("plain", 2), ("top-k-top-p", 4), ("plain", None), ("top-k-top-p", None)]
    ):  # fixed K, then the chooser's own K
        engine.draft_length = auto if k is None else FixedDraftLength(k)
        engine.reset_stats()
        assert shuffled(engine, SAMPLING[name], order_seed) == reference[name], (name, k)
        assert engine.stats.rounds > 0 or k is None
        accepted += engine.stats.accepted
    if draft in ("same-model", "quantized-int8", "quantized-bf16"):  # close to the target:
        assert accepted > 0  # drafted tokens were kept, not only the target's own
    engine.draft_length = auto
    assert alone(engine, SAMPLING["plain"]) == reference["plain"]  # K auto, no neighbours


def test_k_auto_alone_repeats_itself(tiny_llama_dir):
    """The issue's report: one prompt, one seed, K auto, five calls -> one completion."""
    engine = engine_for(
        tiny_llama_dir, draft=DraftSpec(kind="quantized", dtype="int8"), num_draft_tokens="auto"
    )
    params = SamplingParams(max_new_tokens=40, temperature=0.8, seed=5)
    runs = {tuple(engine.generate([PROMPTS[3]], params)[0].token_ids) for _ in range(5)}
    assert len(runs) == 1


@pytest.mark.slow
def test_smollm2_int8_draft_reproduces_plain_sampling(smollm2_spec):
    prompts = [
        [{"role": "user", "content": "Write one sentence about the sea."}],
        [{"role": "user", "content": "Name three colours and a fruit."}],
        "Once upon a time",
    ]
    seeds = [11, 12, 13]
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.95)
    grid = SMALL_GRID.model_copy(
        update={"prompt_lengths": [32, 64], "cache_lengths": [96], "draft_lengths": [2, 4]}
    )
    config = EngineConfig(target=smollm2_spec, device="cpu", bucket_grid=grid)
    plain = Engine.from_config(config).generate(prompts, params, seeds=seeds)
    draft = config.model_copy(update={"draft": DraftSpec(kind="quantized", dtype="int8")})
    speculative = Engine.from_config(draft)
    auto = speculative.draft_length
    for k in (4, None):
        speculative.draft_length = auto if k is None else FixedDraftLength(k)
        completions = speculative.generate(prompts[::-1], params, seeds=seeds[::-1])[::-1]
        assert [c.token_ids for c in completions] == [c.token_ids for c in plain]
    assert speculative.stats.accepted > 0


@needs_exact_int8
def test_an_int8_target_keeps_its_completions_whatever_the_batch_draft_or_k(
    tiny_llama_dir, tiny_llama_other_dir
):
    """quantize=int8 makes a different model, but still one: its seeded completions are the
    same alone, in a shuffled batch, and under speculation (exact integer GEMMs in decode)."""
    int8 = ModelSpec(path=str(tiny_llama_dir), quantize="int8")
    one_row = SMALL_GRID.model_copy(update={"batch_sizes": [1]})
    params = SAMPLING["top-k-top-p"]
    expected = alone(engine_for(tiny_llama_dir, target=int8, bucket_grid=one_row), params)
    assert expected != alone(engine_for(tiny_llama_dir, bucket_grid=one_row), params)
    assert shuffled(engine_for(tiny_llama_dir, target=int8), params, order_seed=3) == expected
    draft = drafts(tiny_llama_dir, tiny_llama_other_dir)["independent-model"]
    speculative = engine_for(tiny_llama_dir, target=int8, draft=draft, num_draft_tokens=4)
    assert shuffled(speculative, params, order_seed=4) == expected
    assert speculative.stats.rounds > 0
    assert speculative.model_info["target_model"] == f"{tiny_llama_dir}#int8"


def test_noise_is_finite_for_every_token_even_at_the_top_hash():
    """Seed 3 at position 50 hashes token 45288 to the largest 24-bit uniform, which rounds to
    1.0 in float32: infinite noise there picked a token outside top-p (and, under a response
    format's mask, a refused one) in steps that sort the whole vocabulary, and not in steps
    that look at the top logits only, so a record depended on its batch."""
    keys = position_keys(torch.tensor([RowRandom(3).words]), torch.tensor([[50]]))[0, 0]
    noise = gumbel(keys, torch.arange(49152))
    assert bool(torch.isfinite(noise).all())
    assert float(noise[45288]) == pytest.approx(-math.log(-math.log1p(-(2.0**-24))), rel=1e-6)
