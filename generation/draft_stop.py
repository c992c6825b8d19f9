"""Where a round's drafting stops: at a smaller grid K once more draft tokens would not pay.

transformers stops its assistant at a fixed confidence threshold (0.4), token by token, at
batch 1 with dynamic shapes. Here the stop is priced for the whole batch and lands only on
grid K values, so verify shapes stay static. Greedy and coupled completions do not depend on
K, so stopping early never changes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoundPrices:
    """What drafting on from a checkpoint costs and earns in one round.

    `onward[i] = (steps, seconds)`: from grid K i, the next grid K lies `steps` draft tokens on
    and reaching it costs `seconds` more (its draft steps plus the wider verify). A token is
    worth `seconds_per_token`, the batch's current cost of one. `tokens_left[r]`: what row r
    may still generate (0: an idle row); a round gives it at most that many.
    """

    onward: dict[int, tuple[int, float]]
    seconds_per_token: float
    tokens_left: list[int]


class BinnedOdds:
    """P(a draft token is kept), per bin of a draft probability, learned from verified rounds.
    Prior: the bin's probability itself, worth `prior_trials`; old rounds fade by `decay`."""

    def __init__(self, bins: int, prior_trials: float, decay: float):
        self.bins, self.decay = bins, decay
        centres = (torch.arange(bins, dtype=torch.float64) + 0.5) / bins
        self.kept = centres * prior_trials
        self.trials = torch.full((bins,), prior_trials, dtype=torch.float64)

    def bin(self, probability: torch.Tensor) -> torch.Tensor:
        return (probability.float() * self.bins).long().clamp_(0, self.bins - 1)

    def __call__(self, probability: torch.Tensor) -> torch.Tensor:
        table = (self.kept / self.trials).to(probability.device, torch.float32)
        return table[self.bin(probability)]

    def observe(self, probability: torch.Tensor, kept: torch.Tensor) -> None:
        bins = self.bin(probability)
        self.kept.mul_(self.decay).index_add_(0, bins, kept.double())
        self.trials.mul_(self.decay).index_add_(0, bins, torch.ones(len(bins), dtype=torch.float64))


class DraftStopper:
    """Decides, after each drafted grid K, whether the batch drafts on to the next one.

    Expected extra kept tokens = sum over live rows of P(all the row's tokens so far are kept)
    x (f + f^2 + ... + f^steps). Two tables learned from verified rounds, keyed by the
    probability the draft gave a token: `kept`, the odds that token is kept; `onward`, the odds
    the token after it is kept when it was (a sure draft tends to stay sure). So an over- or
    under-confident draft is corrected by what the target actually kept.
    """

    def __init__(self, bins: int = 10, prior_trials: float = 2.0, decay: float = 0.995):
        self.kept = BinnedOdds(bins, prior_trials, decay)
        self.onward = BinnedOdds(bins, prior_trials, decay)
        self._left: torch.Tensor | None = None
        self._prices: RoundPrices | None = None
        self._survival: torch.Tensor | None = None
        self._confidences: list[torch.Tensor] = []

    def start_round(self, prices: RoundPrices) -> None:
        self._left, self._prices = torch.tensor(prices.tokens_left), prices
        self._survival, self._confidences = None, []

    def keep_going(self, drafted: int, confidence: torch.Tensor) -> bool:
        """After the round's `drafted`-th token, with the draft's probability of each row's."""
        self._confidences.append(confidence)
        odds = self.kept(confidence)
        self._survival = odds if self._survival is None else self._survival * odds
        if drafted not in self._prices.onward:
            return True
        steps, seconds = self._prices.onward[drafted]
        follow = self.onward(confidence).cpu()
        # Token `drafted + m` is worth something only to a row with more than that many left
        # (each round ends with the target's own token).
        m = torch.arange(1, steps + 1)
        useful = drafted + m[None, :] < self._left[:, None]
        future = (follow[:, None] ** m * useful).sum(-1)
        gain = float((self._survival.cpu() * future).sum())
        return gain * self._prices.seconds_per_token > seconds

    def observe(self, accepted: list[int]) -> None:
        """The verifier kept `accepted[i]` of row i's drafted tokens: token m was tested when
        all before it were kept, and kept when m <= accepted."""
        confidence = torch.stack(self._confidences, 1).cpu()  # [b, K]
        position = torch.arange(1, confidence.shape[1] + 1)
        kept_count = torch.tensor(accepted)[:, None]
        live = self._left[:, None] > 0
        tested = (position <= kept_count + 1) & live
        kept = (position <= kept_count).expand_as(tested)
        self.kept.observe(confidence[tested], kept[tested])
        # The token after m was tested when m was kept (and m was not the last drafted).
        after = kept[:, :-1] & live
        self.onward.observe(confidence[:, :-1][after], kept[:, 1:][after])
