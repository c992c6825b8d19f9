"""The verifier: how many draft tokens each row keeps, and the token that follows them.

Tensor ops, no boolean indexing; the host reads the two small result tensors afterwards (exact
top-p may read one flag, see sampling.allowed_logits).
"""

from __future__ import annotations

import torch

from generation.sampling import Draws, coupled_choice, probabilities, sample
from schemas import SamplingParams


def verify(
    target_logits: torch.Tensor,  # [b, K+1, vocab]
    draft_tokens: torch.Tensor,  # [b, K]
    draft_probs: torch.Tensor | None,  # [b, K, vocab]; None: the draft is deterministic (one-hot)
    params: SamplingParams,
    draws: Draws | None,  # None when greedy
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (accepted [b], next_token [b]).

    Greedy and coupled: the target's own token at each of the K+1 positions (argmax, or argmax
    under the record's positional noise); keep draft tokens while they equal it, then take the
    target's token after them. The result is what plain decoding gives, token for token.
    Rejection: exact rejection sampling (Leviathan et al.; Chen et al.): keep token x with
    probability min(1, p(x)/q(x)); at the first rejection draw from norm(max(0, p - q)); after K
    acceptances draw the bonus token from p. Same distribution, but the draws depend on K.
    """
    if params.greedy:
        return _keep_while_equal(target_logits.argmax(-1), draft_tokens)
    if draws.keys is not None:
        return _keep_while_equal(coupled_choice(target_logits, params, draws), draft_tokens)
    return _rejection_sampling(target_logits, draft_tokens, draft_probs, params, draws.uniforms)


def _keep_while_equal(
    target_choice: torch.Tensor, draft_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    k = draft_tokens.shape[1]
    matches = (draft_tokens == target_choice[:, :k]).long()
    accepted = matches.cumprod(-1).sum(-1)
    return accepted, target_choice.gather(1, accepted[:, None]).squeeze(1)


def _rejection_sampling(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    uniforms: torch.Tensor,  # [b, 2K+1]: K draft draws, K acceptance tests, then the final draw
) -> tuple[torch.Tensor, torch.Tensor]:
    k = draft_tokens.shape[1]
    uniforms = uniforms[:, k:]
    p = probabilities(target_logits, params)  # [b, K+1, V]
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_tokens, p.shape[-1]).to(p.dtype)
    q = torch.cat([draft_probs.to(p.dtype), torch.zeros_like(p[:, :1])], dim=1)  # q = 0 at K+1
    p_draft = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_draft = q[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    keep = (uniforms[:, :k].to(p.device) * q_draft < p_draft).long()  # u < p/q without dividing
    accepted = keep.cumprod(-1).sum(-1)
    index = accepted[:, None, None].expand(-1, 1, p.shape[-1])
    p_next, q_next = p.gather(1, index).squeeze(1), q.gather(1, index).squeeze(1)
    residual = (p_next - q_next).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 1e-12, residual / mass.clamp_min(1e-12), p_next)
    return accepted, sample(residual, uniforms[:, k])
