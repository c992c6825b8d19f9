"""The engine's own decoder must compute what transformers computes on the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from generation.model import CausalLM, DecoderConfig, KVCache, UnsupportedModelError

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 500000.0,
}

VARIANTS = {
    "llama-tied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "llama3-untied-bias-rope-scaling": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(tie_word_embeddings=False, attention_bias=True, rope_scaling=LLAMA3_ROPE),
    ),
    "mistral-sliding-window": (
        MistralConfig,
        MistralForCausalLM,
        dict(sliding_window=8, tie_word_embeddings=False),
    ),
    "qwen2-qkv-bias": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen2-window-on-upper-layers": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
    ),
}


def build_pair(config_class, model_class, overrides, max_positions=64):
    torch.manual_seed(0)
    config = config_class(**TINY, **overrides)
    reference = model_class(config).eval()
    ours = CausalLM(DecoderConfig.from_hf(config.to_dict()), max_positions)
    ours.load_hf_weights(reference.state_dict())
    return reference, ours.eval()


def full_forward(model: CausalLM, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Prefill from position 0 with logits for every position."""
    b, t = tokens.shape
    positions = torch.arange(t).expand(b, t)
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None].expand(b, 1, t, t)
    return model(tokens, positions, torch.arange(b), mask, positions, cache, attend_len=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(variant):
    reference, ours = build_pair(*VARIANTS[variant])
    tokens = torch.randint(0, TINY["vocab_size"], (3, 20))
    cache = KVCache(ours.config, rows=4, length=64, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        expected = reference(tokens).logits
        got = full_forward(ours, tokens, cache)
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_decode_matches_full_forward(variant):
    """Prefill 12 tokens, then feed 5 more through the cache at per-row positions."""
    reference, ours = build_pair(*VARIANTS[variant])
    tokens = torch.randint(0, TINY["vocab_size"], (2, 17))
    cache = KVCache(ours.config, rows=3, length=64, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        expected = reference(tokens).logits[:, 12:]
        full_forward(ours, tokens[:, :12], cache)
        positions = 12 + torch.arange(5).expand(2, 5)
        keys = torch.arange(32)[None, None, :]
        visible = keys <= positions[:, :, None]  # causal only: the model applies windows
        got = ours(
            tokens[:, 12:],
            positions,
            torch.arange(2),
            visible[:, None],
            torch.arange(5).expand(2, 5),
            cache,
            attend_len=32,
        )
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2_dir):
    from generation.loading import load_state_dict, read_config

    reference = LlamaForCausalLM.from_pretrained(smollm2_dir).eval()
    ours = CausalLM(DecoderConfig.from_hf(read_config(smollm2_dir)), 64)
    ours.load_hf_weights(load_state_dict(smollm2_dir))
    tokens = torch.randint(0, 49152, (2, 24))
    cache = KVCache(ours.config, rows=3, length=64, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        diff = (full_forward(ours.eval(), tokens, cache) - reference(tokens).logits).abs().max()
    assert diff.item() < 1e-4


def test_sliding_window_only_where_the_config_says():
    base = {**Qwen2Config(**TINY).to_dict(), "layer_types": None, "sliding_window": 6}
    assert DecoderConfig.from_hf(base).sliding_layers == (False, False)  # use_sliding_window off
    on = {**base, "use_sliding_window": True, "max_window_layers": 1}
    assert DecoderConfig.from_hf(on).sliding_layers == (False, True)
    listed = {**on, "layer_types": ["sliding_attention", "full_attention"]}
    assert DecoderConfig.from_hf(listed).sliding_layers == (True, False)
    mistral = {**MistralConfig(**TINY, sliding_window=8).to_dict(), "layer_types": None}
    assert DecoderConfig.from_hf(mistral).sliding_layers == (True, True)


def test_an_unimplemented_activation_is_refused():
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
        DecoderConfig.from_hf({**Qwen2Config(**TINY).to_dict(), "hidden_act": "gelu"})


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*llama, mistral, qwen2"):
        DecoderConfig.from_hf({"model_type": "gpt2"})
