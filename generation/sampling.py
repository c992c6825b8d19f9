"""Token choice from logits. Sampling is inverse-CDF with uniforms drawn from each row's own
generator, so a record's completion depends on its seed only, never on its batch neighbours.
"""

from __future__ import annotations

import torch

from schemas import SamplingParams


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to [..., vocab] logits, as probabilities."""
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: [..., vocab] probabilities and [...] uniforms in [0, 1)."""
    cdf = probs.cumsum(-1)
    threshold = (uniforms.to(cdf.device) * cdf[..., -1]).unsqueeze(-1)
    choice = torch.searchsorted(cdf, threshold, right=True).squeeze(-1)
    return choice.clamp_(max=probs.shape[-1] - 1)


def choose(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor) -> torch.Tensor:
    if params.greedy:
        return logits.argmax(-1)
    return sample(probabilities(logits, params), uniforms)


class RowRandom:
    """A record's private uniform stream, seeded by the record's seed."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)

    def uniforms(self, count: int) -> torch.Tensor:
        return torch.rand(count, generator=self.generator, dtype=torch.float64)
