"""Bad input to the engine: a clear error naming the problem, on that record only (or at config
time, before anything runs), and the other records go on."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import SMALL_GRID, engine_for
from pydantic import ValidationError

from schemas import DraftSpec, EngineConfig, ModelSpec, SamplingParams


def test_underflowing_temperature_is_refused_at_validation():
    with pytest.raises(ValidationError, match=r"temperature 1e-40 is below 0.001.*0 for greedy"):
        SamplingParams(temperature=1e-40)
    assert SamplingParams(temperature=0.001).temperature == 0.001
    assert SamplingParams(temperature=0.0).greedy


def test_empty_stop_string_is_refused_at_validation():
    with pytest.raises(ValidationError, match=r"stop contains an empty string \(at index 1\)"):
        SamplingParams(stop=["\n", ""])
    with pytest.raises(ValidationError, match="stop_token_ids must be token ids >= 0"):
        SamplingParams(stop_token_ids=[-1])


def test_model_draft_with_k_auto_needs_a_cache_as_wide_as_the_catch_up():
    grid = SMALL_GRID.model_copy(update={"cache_lengths": [48]})
    target = ModelSpec(path="unused")
    quantized = DraftSpec(kind="quantized")
    with pytest.raises(ValidationError, match=r"largest cache length \(48\) is below the draft "
                       r"catch-up width \(64\)"):
        EngineConfig(target=target, draft=quantized, bucket_grid=grid)
    EngineConfig(target=target, draft=quantized, bucket_grid=grid, num_draft_tokens=2)
    EngineConfig(target=target, draft=DraftSpec(kind="prompt_lookup"), bucket_grid=grid)


def test_tensor_prompts_are_token_ids_and_bad_ones_are_error_rows(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir)
    ids = engine.encode("the cat sat")
    params = SamplingParams(max_new_tokens=4, temperature=0.9)
    prompts = [torch.tensor(ids), torch.tensor([ids]), torch.tensor(ids, dtype=torch.float32),
               ids, [ids[0], "x"], 42]
    done = engine.generate(prompts, params, seeds=[3] * len(prompts))
    assert done[0].token_ids == done[3].token_ids and done[0].finish_reason == "length"
    assert [c.finish_reason for c in done[1:3] + done[4:]] == ["error"] * 4
    assert f"got shape (1, {len(ids)})" in done[1].error
    assert "dtype torch.float32" in done[2].error
    assert "a list of token ids" in done[4].error and "got a int" in done[5].error


def test_seed_list_of_the_wrong_length_names_both_lengths(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir)
    with pytest.raises(ValueError, match="seeds has 2 entries for 3 prompts"):
        engine.generate(["a", "b", "c"], SamplingParams(max_new_tokens=2), seeds=[1, 2])
