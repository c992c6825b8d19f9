"""Token choice from logits, and the randomness it is keyed by.

Coupled sampling (the default): the noise at a record's absolute position t is Gumbel noise
from a counter-based hash of (record seed, t, token id), so the token there is
argmax(logits / T + g) over the allowed tokens: an exact sample of the filtered target
distribution that depends on no earlier draw. Plain decoding, every draft and every K use the
same noise, so a completion is a function of (model, prompt, seed, sampling params) alone.
Rejection mode keeps each record's uniform stream (inverse CDF), consumed 2K + 1 per round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from schemas import SamplingParams

TOP_P_CANDIDATES = 1024  # top-p sorts this many logits, the whole vocabulary only when needed
_WORD = 0xFFFF_FFFF
# Odd multipliers below 2**31: products with 32-bit words stay below 2**63, so the int64
# arithmetic never overflows and gives the same bits on every device.
_M1, _M2 = 0x7FEB352D, 0x5BD1E995
_ROW_SALT, _SECOND_SALT = 0x243F6A88, 0x85A308D3


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit bijective integer hash (lowbias32-style), in place on int64 words."""
    x ^= x >> 16
    x.mul_(_M1).bitwise_and_(_WORD)
    x ^= x >> 15
    x.mul_(_M2).bitwise_and_(_WORD)
    x ^= x >> 16
    return x


def position_keys(seed_words: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[b, 2] seed words (low, high 32 bits) and [b, T] positions -> [b, T, 2] noise keys."""
    row = _mix(_mix(seed_words[:, 0] ^ _ROW_SALT) ^ seed_words[:, 1])
    first = _mix(row[:, None] ^ positions)
    return torch.stack([first, _mix(first ^ _SECOND_SALT)], dim=-1)


def gumbel(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise [..., n] for `token_ids` ([..., n] or [n]) under keys [..., 2].

    The second key enters mid-hash, so two positions whose first keys differ by a small xor do
    not share noise values. 24-bit uniforms in (0, 1): the top one, 1 - 2**-25, rounds to 1.0
    in float32 (infinite noise, a token outside top-p or a response format), so it is clamped
    to 1 - 2**-24. The noise lies in [-2.9, 16.7].
    """
    x = token_ids ^ keys[..., :1]
    x ^= x >> 16
    x.mul_(_M1).bitwise_and_(_WORD)
    x ^= keys[..., 1:]
    x ^= x >> 15
    x.mul_(_M2).bitwise_and_(_WORD)
    x ^= x >> 16
    uniform = (x >> 8).float().add_(0.5).mul_(2.0**-24).clamp_max_(1.0 - 2.0**-24)
    return uniform.log_().neg_().log_().neg_()


def allowed_logits(
    logits: torch.Tensor, params: SamplingParams, exact: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits / T with top-k and top-p applied (others -inf): (values, their token ids).

    ids None means values cover the whole vocabulary. Top-p looks at the TOP_P_CANDIDATES
    largest logits. Where a row's nucleus reaches past them (a flat distribution), `exact`
    sorts the whole vocabulary (a host sync), while a draft (exact=False: its proposals need
    not be exact) keeps that row's whole vocabulary, a superset of the nucleus, without a sync.
    Ties at the nucleus edge are all kept, so the set does not depend on sort order.
    """
    scaled = logits.float() / params.temperature
    if not params.top_k and params.top_p >= 1.0:
        return scaled, None
    width = min(scaled.shape[-1], params.top_k or TOP_P_CANDIDATES)
    values, ids = scaled.topk(width, dim=-1)
    if params.top_p >= 1.0:
        return values, ids
    log_total = (values if params.top_k else scaled).logsumexp(-1, keepdim=True)
    edge = _nucleus_edge(values, log_total, params.top_p)
    if params.top_k:  # the top-k set holds the whole (renormalised) distribution
        return values.masked_fill(values < edge, float("-inf")), ids
    contained = (values - log_total).exp().sum(-1, keepdim=True) >= params.top_p
    if not exact:
        edge = edge.masked_fill(~contained, float("-inf"))
    elif bool(contained.all()):
        return values.masked_fill(values < edge, float("-inf")), ids
    else:
        edge = _nucleus_edge(scaled.sort(dim=-1, descending=True).values, log_total, params.top_p)
    return scaled.masked_fill(scaled < edge, float("-inf")), None


def _nucleus_edge(descending: torch.Tensor, log_total: torch.Tensor, top_p: float):
    """The smallest logit whose preceding probability mass is below top_p: [..., 1]."""
    probs = (descending - log_total).exp()
    in_nucleus = probs.cumsum(-1) - probs < top_p
    return descending.masked_fill(~in_nucleus, float("inf")).amin(-1, keepdim=True)


def probabilities(logits: torch.Tensor, params: SamplingParams, exact: bool = True) -> torch.Tensor:
    """The filtered distribution [..., vocab] (rejection sampling needs it whole)."""
    values, ids = allowed_logits(logits, params, exact)
    if ids is None:
        return torch.softmax(values, dim=-1)
    return torch.zeros_like(logits, dtype=values.dtype).scatter(-1, ids, values.softmax(-1))


def coupled_choice(
    logits: torch.Tensor, params: SamplingParams, draws: Draws, exact: bool = True
) -> torch.Tensor:
    """argmax(logits / T + g) over the allowed tokens, for [..., vocab] logits."""
    values, ids = allowed_logits(logits, params, exact)
    if ids is None:
        return (values + draws.vocabulary_noise(values.shape[-1])).argmax(-1)
    best = gumbel(draws.keys, ids).add_(values).argmax(-1, keepdim=True)
    return ids.gather(-1, best).squeeze(-1)


def sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: [..., vocab] probabilities and [...] uniforms in [0, 1)."""
    cdf = probs.cumsum(-1)
    threshold = (uniforms.to(cdf.device) * cdf[..., -1]).unsqueeze(-1)
    choice = torch.searchsorted(cdf, threshold, right=True).squeeze(-1)
    return choice.clamp_(max=probs.shape[-1] - 1)


@dataclass
class Draws:
    """The randomness of one step for a batch, fixed before any token of it is chosen.

    Coupled: keys [b, T, 2] for the T absolute positions the step may fill. Rejection: each
    record's next uniforms [b, 2T - 1] (T - 1 draft draws, T - 1 acceptance tests, 1 final).
    """

    keys: torch.Tensor | None = None
    uniforms: torch.Tensor | None = None
    _parent: tuple[Draws, int] | None = None  # (the step's draws, position) of a slice
    _noise: torch.Tensor | None = field(default=None, repr=False)

    def at(self, j: int) -> Draws:
        """The draws for the token at the step's j-th position (a plain step or draft step j)."""
        if self.keys is not None:
            return Draws(keys=self.keys[:, j], _parent=(self, j))
        return Draws(uniforms=self.uniforms[:, j])

    def head(self, positions: int) -> Draws:
        """The draws of a step's first `positions` positions, for a round that drafted fewer
        tokens than it had draws for. Rejection uniforms are read at offsets from K, so whole."""
        if self.keys is None:
            return self
        noise = None if self._noise is None else self._noise[:, :positions]
        return Draws(keys=self.keys[:, :positions], _noise=noise)

    def vocabulary_noise(self, vocab: int) -> torch.Tensor:
        """Gumbel noise for every token [..., vocab], made once per step: the draft's steps
        and the verifier read the same positions."""
        if self._parent is not None:
            step, j = self._parent
            return step.vocabulary_noise(vocab)[:, j]
        if self._noise is None:
            self._noise = gumbel(self.keys, torch.arange(vocab, device=self.keys.device))
        return self._noise


def choose(logits: torch.Tensor, params: SamplingParams, draws: Draws | None) -> torch.Tensor:
    """The target's token for [b, vocab] logits, with `draws` for one position."""
    if params.greedy:
        return logits.argmax(-1)
    if draws.keys is not None:
        return coupled_choice(logits, params, draws)
    return sample(probabilities(logits, params), draws.uniforms)


def draft_choice(
    logits: torch.Tensor, params: SamplingParams, draws: Draws | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft's token for [b, vocab] logits and, for rejection verification, the distribution
    it was drawn from. Coupled drafts use the target's noise, so they propose what it would."""
    if params.greedy:
        return logits.argmax(-1), None
    if draws.keys is not None:
        return coupled_choice(logits, params, draws, exact=False), None
    probs = probabilities(logits, params, exact=False)
    return sample(probs, draws.uniforms), probs


def chosen_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, params: SamplingParams
) -> torch.Tensor:
    """log p(token) [...] under the distribution sampled from [..., vocab] logits: logits / T
    with top-k / top-p applied (greedy: the softmax of the logits as they are). Logits that a
    response format refused are -inf already."""
    if params.greedy:
        logp = torch.log_softmax(logits.float(), -1)
        return logp.gather(-1, tokens[..., None]).squeeze(-1)
    values, ids = allowed_logits(logits, params)
    logp = torch.log_softmax(values, -1)
    if ids is None:
        return logp.gather(-1, tokens[..., None]).squeeze(-1)
    match = ids == tokens[..., None]
    found = logp.masked_fill(~match, 0.0).sum(-1)
    return found.masked_fill(~match.any(-1), float("-inf"))


def chosen_probability(
    logits: torch.Tensor, token: torch.Tensor, params: SamplingParams, probs: torch.Tensor | None
) -> torch.Tensor:
    """How sure a draft was of its tokens [b]: their probability under the distribution it
    drew from (greedy: the softmax; `probs` when draft_choice returned it)."""
    if probs is None:
        probs = (
            torch.softmax(logits.float(), -1)
            if params.greedy
            else probabilities(logits, params, exact=False)
        )
    return probs.gather(-1, token[:, None]).squeeze(-1)


class RowRandom:
    """A record's randomness: its seed's noise keys, or (rejection mode) its uniform stream."""

    def __init__(self, seed: int):
        self.seed = seed & 0xFFFF_FFFF_FFFF_FFFF
        self.words = (self.seed & _WORD, self.seed >> 32)
        self._generator: torch.Generator | None = None

    def uniforms(self, count: int) -> torch.Tensor:
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self.seed)
        return torch.rand(count, generator=self._generator, dtype=torch.float64)


def step_draws(
    rows: list[tuple[RowRandom, int] | None],
    positions: int,
    params: SamplingParams,
    device: torch.device,
) -> Draws | None:
    """Draws for a step filling `positions` tokens per row; rows are (randomness, length)."""
    if params.greedy:
        return None
    live = [row if row else (None, 0) for row in rows]
    if params.verification == "rejection":
        count = 2 * positions - 1
        idle = torch.zeros(count, dtype=torch.float64)
        return Draws(uniforms=torch.stack([r.uniforms(count) if r else idle for r, _ in live]))
    words = torch.tensor([r.words if r else (0, 0) for r, _ in live], device=device)
    lengths = torch.tensor([length for _, length in live], device=device)
    offsets = torch.arange(positions, device=device)
    return Draws(keys=position_keys(words, lengths[:, None] + offsets))
