"""Proposers: what drafts the K tokens a speculation round verifies (after transformers'
CandidateGenerator). One job each: a draft model, prompt lookup, or nothing (plain decoding).

Every proposer keeps its own per-row state in step with the target's committed tokens: a
row's context is `tokens[slot]`, whose last token is not yet in any cache.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from generation.grammar import masked
from generation.runner import ModelRunner, bucket
from generation.sampling import Draws, chosen_probability, draft_choice
from schemas import SamplingParams
from schemas.engine import CATCH_UP_WIDTHS

if TYPE_CHECKING:
    from generation.draft_length import DraftStopper
    from generation.grammar import DraftConstraint


class Proposer(Protocol):
    runner: ModelRunner | None  # a draft model's runner (its cache, shapes, timings), if any

    @property
    def forwards(self) -> int:
        """Draft model forwards so far."""

    def seconds_for(self, b: int, k: int) -> float:
        """Recent time to draft K tokens for batch bucket b."""

    def prefill_seconds(self, prompts: list[list[int]]) -> float:
        """Recent time of a prefill of these prompts, to price it beforehand."""

    def prefill(self, prompts: list[list[int]], rows: list[int]) -> None:
        """Bring admitted rows' draft state level with their prompts."""

    def catch_up_seconds(self, contexts: list[list[int] | None], seen: list[int]) -> float:
        """Extra seconds the next round pays to bring the draft level with the contexts."""

    def propose(
        self,
        contexts: list[list[int] | None],
        seen: list[int],
        k: int,
        params: SamplingParams,
        draws: Draws | None,
        stopper: DraftStopper | None = None,
        constraint: DraftConstraint | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens [b, K'] and, under rejection verification, their probabilities
        [b, K', V]: K' = K, or the grid K where `stopper` ended the round. With `constraint`
        a model draft proposes under the rows' grammars."""


class NoProposer:
    """Plain decoding's proposer: nothing to draft and nothing to prepare, so the engine's loop
    runs one code path (its draft-length policy never asks for K > 0)."""

    runner = None
    forwards = 0

    def seconds_for(self, b: int, k: int) -> float:
        return 0.0

    def prefill_seconds(self, prompts: list[list[int]]) -> float:
        return 0.0

    def prefill(self, prompts: list[list[int]], rows: list[int]) -> None:
        pass

    def catch_up_seconds(self, contexts, seen) -> float:
        return 0.0

    def propose(self, contexts, seen, k, params, draws, stopper=None, constraint=None):
        raise RuntimeError("plain decoding drafts nothing: its policy never chooses K > 0")


def _windows(contexts: list[list[int] | None], firsts: list[int], width: int):
    """Each row's tokens from `firsts[i]`, at most `width`; and them zero-padded, [b, width]."""
    window = [
        ctx[first : first + width] if ctx else []
        for ctx, first in zip(contexts, firsts, strict=True)
    ]
    return window, torch.tensor([w + [0] * (width - len(w)) for w in window])


class ModelProposer:
    """A draft model (separate, or the target quantized) decoding K tokens autoregressively.

    The draft's cache lags the context by at least one token (the pending one) and by more after
    plain (K = 0) steps, which skip the draft. Its first step therefore feeds the row's last
    `width` tokens, width from CATCH_UP_WIDTHS covering the largest lag in the batch; re-feeding
    positions the draft has already seen is harmless. A row the draft has never seen (seen 0:
    admitted while plain decoding won) is prefilled first, and a lag wider than the widest
    window is fed in widest-window chunks. Static shapes, no per-row branching.
    """

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.seconds = 0.0

    @property
    def forwards(self) -> int:
        return self.runner.forwards

    def seconds_for(self, b: int, k: int) -> float:
        return self.runner.recent_seconds_for(b, 2) + (k - 1) * self.runner.recent_seconds_for(b, 1)

    def prefill_seconds(self, prompts: list[list[int]]) -> float:
        """Recent time of a prefill of these prompts, for pricing it beforehand."""
        return self.runner.recent_prefill_seconds(prompts) if prompts else 0.0

    def prefill(self, prompts: list[list[int]], rows: list[int]) -> None:
        started = time.perf_counter()
        self.runner.prefill(prompts, rows)
        self.seconds += time.perf_counter() - started

    def _prefill_length(self, context: list[int]) -> int:
        """What a never-seen row's prefill covers: all but the pending token, within the grid."""
        return min(len(context) - 1, self.runner.grid.max_prompt)

    def catch_up_seconds(self, contexts: list[list[int] | None], seen: list[int]) -> float:
        """Extra seconds the next round pays to bring the draft level with the contexts."""
        live = [(ctx, done) for ctx, done in zip(contexts, seen, strict=True) if ctx]
        missing = [ctx[: self._prefill_length(ctx)] for ctx, done in live if done == 0]
        extra = self.prefill_seconds(missing)
        lag = max(len(ctx) - (done or self._prefill_length(ctx)) for ctx, done in live)
        widest, b = CATCH_UP_WIDTHS[-1], len(contexts)
        chunks = max(0, -(-(lag - widest) // widest))
        extra += chunks * self.runner.recent_seconds_for(b, widest)
        width = bucket(CATCH_UP_WIDTHS, min(lag - chunks * widest, widest))
        if width > CATCH_UP_WIDTHS[0]:
            extra += self.runner.recent_seconds_for(b, width) - self.runner.recent_seconds_for(b, 2)
        return extra

    def _catch_up(self, contexts: list[list[int] | None], seen: list[int], live: int) -> list[int]:
        """Prefill never-seen rows, then feed chunks until every lag fits the widest window."""
        seen = list(seen)
        missing = [i for i, ctx in enumerate(contexts) if ctx and seen[i] == 0]
        if missing:
            lengths = [self._prefill_length(contexts[i]) for i in missing]
            self.runner.prefill(
                [contexts[i][:n] for i, n in zip(missing, lengths, strict=True)], missing
            )
            for i, n in zip(missing, lengths, strict=True):
                seen[i] = n
        widest = CATCH_UP_WIDTHS[-1]
        while (
            max(len(ctx) - done for ctx, done in zip(contexts, seen, strict=True) if ctx) > widest
        ):
            firsts = [
                min(done, len(ctx) - widest) if ctx else 0
                for ctx, done in zip(contexts, seen, strict=True)
            ]
            _, tokens = _windows(contexts, firsts, widest)
            self.runner.decode(
                tokens, torch.tensor(firsts), live, torch.zeros(len(contexts), 1, dtype=torch.long)
            )
            seen = [
                first + widest if ctx else 0 for ctx, first in zip(contexts, firsts, strict=True)
            ]
        return seen

    def propose(
        self,
        contexts: list[list[int] | None],
        seen: list[int],
        k: int,
        params: SamplingParams,
        draws: Draws | None,
        stopper: DraftStopper | None = None,
        constraint: DraftConstraint | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens [b, K'] and, under rejection verification, their probabilities [b, K', V]:
        K' = K, or the grid K where `stopper` ended the round. Under `constraint` each step's
        logits are masked by the rows' grammars after the tokens drafted so far.

        `contexts[i]` is None for an idle row (it runs at position 0 of its own free cache row);
        `seen[i]` is how many of row i's context tokens the draft cache holds. Drafted tokens
        stay on the device between steps: no host sync until the verifier's results are read,
        except the stopper's one read at each grid K it weighs.
        """
        started = time.perf_counter()
        idle = torch.tensor([ctx is None for ctx in contexts])
        live = len(contexts) - int(idle.sum())
        seen = self._catch_up(contexts, seen, live)
        lag = max(len(ctx) - done for ctx, done in zip(contexts, seen, strict=True) if ctx)
        width = bucket(CATCH_UP_WIDTHS, lag)
        firsts = [max(len(ctx) - width, 0) if ctx else 0 for ctx in contexts]
        window, tokens = _windows(contexts, firsts, width)
        starts = torch.tensor(firsts)
        last = torch.tensor([[max(len(w) - 1, 0)] for w in window])
        drafted, probs = [], []
        for step in range(k):
            logits = self.runner.decode(tokens, starts, live, logit_index=last)[:, 0]
            if constraint is not None:
                logits = masked(logits, constraint.mask())
            token, token_probs = draft_choice(logits, params, draws.at(step) if draws else None)
            if constraint is not None:
                constraint.advance(token.tolist())
            drafted.append(token)
            if token_probs is not None:
                probs.append(token_probs)
            if stopper and not stopper.keep_going(
                step + 1, chosen_probability(logits, token, params, token_probs)
            ):
                break
            starts = (starts + last[:, 0] + 1).masked_fill(idle, 0)
            tokens, last = token[:, None], torch.zeros_like(last)
        if constraint is not None:
            constraint.release()
        self.seconds += time.perf_counter() - started
        return torch.stack(drafted, dim=1), (torch.stack(probs, dim=1) if probs else None)


FILLER_CONFIDENCE = 0.05  # a token past what the prompt offers to copy: a guess, rarely kept


def copy_confidence(ngram: int) -> float:
    """A prior guess of how likely a copied token is kept, from the n-gram it continues; the
    stopper's tables replace it with what the target kept."""
    return min(0.25 + 0.2 * ngram, 0.95)


class PromptLookupProposer:
    """Copies what followed the latest earlier occurrence of the context's last n-gram.

    Example, ngram_max 3, ngram_min 1, K 3, a row's context (prompt + text so far):

        [5 9 2 7 1 5 9 2]     last 3-gram: 5 9 2
         ^^^^^                it occurred at position 0, followed by 7 1 5
        proposal: [7 1 5]

    Without a 3-gram match it tries the last 2-gram, then 1-gram (down to ngram_min); fewer
    than K tokens after the match repeat the last one copied; no match at all proposes the
    last token K times, which the verifier rejects cheaply. Deterministic, so the verifier
    treats its distribution as one-hot. With a stopper, each token's confidence says what
    backs it (the matched n-gram's length, or nothing), so a round runs long where a row
    copies and ends at the smallest K where none does.
    """

    runner = None  # no model: nothing to warm up, compact or count

    def __init__(self, ngram_max: int, ngram_min: int):
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.seconds = 0.0
        self.forwards = 0
        self.calls = 0

    def seconds_for(self, b: int, k: int) -> float:
        return self.seconds / self.calls if self.calls else 0.0

    def prefill_seconds(self, prompts: list[list[int]]) -> float:
        return 0.0

    def prefill(self, prompts: list[list[int]], rows: list[int]) -> None:
        """Nothing to precompute: the context itself is the draft's whole state."""

    def catch_up_seconds(self, contexts, seen) -> float:
        return 0.0  # never behind: it reads the context as it is

    def propose(self, contexts, seen, k, params, draws, stopper=None, constraint=None):
        """Drafts [b, K'] (K' = K, or the grid K where `stopper` ended the round), and None
        for their probabilities (one-hot). Copies ignore a grammar: the verifier's masks
        reject a copied token the grammar refuses."""
        started = time.perf_counter()
        found = [self._lookup(ctx, k) if ctx else ([0] * k, 0, 0) for ctx in contexts]
        drafts = torch.tensor([tokens for tokens, _, _ in found], dtype=torch.long)
        if stopper:
            confidence = torch.tensor([
                [copy_confidence(ngram) if j < copied else FILLER_CONFIDENCE for j in range(k)]
                for _, ngram, copied in found
            ])
            for step in range(k):
                if not stopper.keep_going(step + 1, confidence[:, step]):
                    drafts = drafts[:, : step + 1]
                    break
        self.seconds += time.perf_counter() - started
        self.calls += 1
        return drafts, None

    def _lookup(self, context: list[int], k: int) -> tuple[list[int], int, int]:
        """K tokens to propose, the n-gram length matched (0: none) and how many are copied."""
        seq = np.asarray(context)
        for n in range(min(self.ngram_max, len(seq) - 1), self.ngram_min - 1, -1):
            tail = seq[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                follow = seq[hits[-1] + n : hits[-1] + n + k].tolist()
                return follow + [follow[-1]] * (k - len(follow)), n, len(follow)
        return [int(seq[-1])] * k, 0, 0
