"""How many tokens a speculation round drafts: the one place K is decided (after vLLM's
draft-length policy). The engine asks its policy, before each step, for K (0: a plain step),
whether admitted rows get the draft's prefill, and, for a round, where its drafting may stop;
it tells the policy what each step cost and what the verifier kept.

- `PlainDecoding`: no draft, K is always 0.
- `FixedDraftLength`: the configured K, every step.
- `AutoDraftLength`: `DraftLengthChooser` picks K (or plain) from measured step costs and the
  acceptance it sees; `DraftStopper` may end a round's drafting at a smaller grid K; both are
  priced here from the runners' measured forward times.

transformers stops its assistant at a fixed confidence threshold (0.4), token by token, at
batch 1 with dynamic shapes. Here the stop is priced for the whole batch and lands only on
grid K values, so verify shapes stay static. Greedy and coupled completions do not depend on
K, so neither K nor an early stop ever changes them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from schemas import EngineConfig
from schemas.engine import CATCH_UP_WIDTHS

if TYPE_CHECKING:
    from generation.proposers import Proposer
    from generation.runner import ModelRunner


@dataclass(frozen=True)
class StepRows:
    """What a policy sees of a step's rows (None / 0 for an idle row)."""

    contexts: list[list[int] | None]  # each row's tokens so far, prompt included
    seen: list[int]  # how many of them the draft's cache holds
    left: list[int]  # tokens each row may still generate

    @property
    def horizon(self) -> float:
        """Tokens a live row has left, on average: what a one-off cost is paid back over."""
        live = [left for ctx, left in zip(self.contexts, self.left, strict=True) if ctx]
        return sum(live) / len(live)


class DraftLengthPolicy(Protocol):
    def verify_widths(self) -> list[int]:
        """Verify widths (K + 1) a warm-up must run."""

    def catch_up_widths(self) -> list[int]:
        """First-step widths a draft model may need: how far its cache may lag the context."""

    def new_prompts(self) -> None:
        """A new generate() call: its prompts are other text."""

    def wants_draft(self, width: int, prompts: list[list[int]], horizon: float) -> bool:
        """Whether rows being admitted at batch bucket `width` with these prompts should get
        the draft's prefill now; they have `horizon` tokens left to generate."""

    def choose(self, rows: StepRows) -> tuple[int, float]:
        """K for this step (0: plain) and the draft catch-up seconds a K round pays first."""

    def round_stopper(self, rows: StepRows) -> DraftStopper | None:
        """For a round about to draft: a stopper that may end it early (it then drafts up to
        the largest grid K), or None to draft exactly the chosen K."""

    def observe_round(self, k: int, accepted: list[int | None]) -> None:
        """The verifier kept accepted[i] of row i's K drafted tokens (None: an idle row)."""

    def observe_step(self, width: int, k: int, seconds: float, forward_seconds: float) -> None:
        """A step at batch bucket `width` took `seconds`, `forward_seconds` of it in forwards."""

    def observe_payoff(
        self, width: int, k: int, seconds: float, switch_seconds: float, tokens_per_row: float
    ) -> None:
        """A step at batch bucket `width` gave its live rows `tokens_per_row` tokens each in
        `seconds`, a K round's catch-up of a lagging draft included (priced `switch_seconds`)."""


class PlainDecoding:
    """No draft: every step is a plain step."""

    def verify_widths(self) -> list[int]:
        return []

    def catch_up_widths(self) -> list[int]:
        return []

    def new_prompts(self) -> None:
        pass

    def wants_draft(self, width: int, prompts: list[list[int]], horizon: float) -> bool:
        return False

    def choose(self, rows: StepRows) -> tuple[int, float]:
        return 0, 0.0

    def round_stopper(self, rows: StepRows) -> DraftStopper | None:
        return None

    def observe_round(self, k: int, accepted: list[int | None]) -> None:
        pass

    def observe_step(self, width: int, k: int, seconds: float, forward_seconds: float) -> None:
        pass

    def observe_payoff(
        self, width: int, k: int, seconds: float, switch_seconds: float, tokens_per_row: float
    ) -> None:
        pass


class FixedDraftLength(PlainDecoding):
    """The configured K every step, whatever it costs (for experiments and benchmarks)."""

    def __init__(self, k: int):
        self.k = k

    def verify_widths(self) -> list[int]:
        return [self.k + 1]

    def catch_up_widths(self) -> list[int]:
        return [CATCH_UP_WIDTHS[0]]  # every step drafts: the draft lags by one token only

    def wants_draft(self, width: int, prompts: list[list[int]], horizon: float) -> bool:
        return True

    def choose(self, rows: StepRows) -> tuple[int, float]:
        return self.k, 0.0  # a fixed K ignores the price of switching


def policy_for(config: EngineConfig, target: ModelRunner, proposer: Proposer) -> DraftLengthPolicy:
    """Plain without a draft, the configured K, or K chosen per step."""
    if config.draft is None:
        return PlainDecoding()
    if config.num_draft_tokens != "auto":
        return FixedDraftLength(config.num_draft_tokens)
    return AutoDraftLength(
        config.bucket_grid.draft_lengths, target, proposer, config.stop_drafting_early
    )


class AutoDraftLength:
    """K chosen per step by `DraftLengthChooser` from the step costs measured in this run, and
    (with `stop_early`) each round's drafting ended by `DraftStopper`."""

    def __init__(
        self, grid_ks: list[int], target: ModelRunner, proposer: Proposer, stop_early: bool
    ):
        self.grid_ks, self.target, self.proposer = grid_ks, target, proposer
        self.chooser = DraftLengthChooser(grid_ks)
        self.stopper = DraftStopper() if stop_early else None
        self._round_stopper: DraftStopper | None = None

    def verify_widths(self) -> list[int]:
        return [k + 1 for k in self.grid_ks]

    def catch_up_widths(self) -> list[int]:
        return CATCH_UP_WIDTHS  # plain steps skip the draft, which then lags

    def new_prompts(self) -> None:
        self.chooser.new_prompts()

    def _forward_prices(self, width: int):
        """Measured forward times at batch bucket `width`: target [b, t] and the draft's K."""
        return (
            lambda t: self.target.recent_seconds_for(width, t),
            lambda k: self.proposer.seconds_for(width, k),
        )

    def wants_draft(self, width: int, prompts: list[list[int]], horizon: float) -> bool:
        prefill = self.proposer.prefill_seconds(prompts)
        return self.chooser.wants_draft(width, *self._forward_prices(width), prefill, horizon)

    def choose(self, rows: StepRows) -> tuple[int, float]:
        switch = self.proposer.catch_up_seconds(rows.contexts, rows.seen)
        width = len(rows.contexts)
        k = self.chooser.choose(width, *self._forward_prices(width), switch, rows.horizon)
        return k, switch

    def round_prices(self, rows: StepRows) -> RoundPrices:
        """From each grid K to the next: the draft steps and wider verify it costs; what a
        token is worth now (the chosen step's cost per token); each row's tokens left."""
        target, draft = self._forward_prices(len(rows.contexts))
        onward = {
            i: (j - i, draft(j) - draft(i) + target(j + 1) - target(i + 1))
            for i, j in itertools.pairwise(self.grid_ks)
        }
        live = sum(1 for ctx in rows.contexts if ctx)
        return RoundPrices(onward, self.chooser.row_token_seconds / live, rows.left)

    def round_stopper(self, rows: StepRows) -> DraftStopper | None:
        """None for a try: it drafts the K its loss was priced at."""
        self._round_stopper = None if self.chooser.trying else self.stopper
        if self._round_stopper is not None:
            self._round_stopper.start_round(self.round_prices(rows))
        return self._round_stopper

    def observe_round(self, k: int, accepted: list[int | None]) -> None:
        self.chooser.observe(k, [count for count in accepted if count is not None])
        if self._round_stopper is not None:
            self._round_stopper.observe([count or 0 for count in accepted])

    def observe_step(self, width: int, k: int, seconds: float, forward_seconds: float) -> None:
        self.chooser.observe_step(width, k, seconds, forward_seconds)

    def observe_payoff(
        self, width: int, k: int, seconds: float, switch_seconds: float, tokens_per_row: float
    ) -> None:
        """Rounds' payoff leaves a catch-up out (a one-off, not what rounds earn); a try is
        charged all it took."""
        if not k:
            return
        self.chooser.observe_round_payoff(width, max(seconds - switch_seconds, 0.0),
                                          tokens_per_row)
        if self.chooser.trying:
            self.chooser.settle_try(seconds, tokens_per_row)


class DraftLengthChooser:
    """Picks K (0 = plain decoding) maximising expected tokens per second for the batch.

    Expected tokens per row per round with acceptance alpha: (1 - alpha^(K+1)) / (1 - alpha).
    A step's cost is its whole measured wall time at this batch bucket (draft, verify,
    sampling, host bookkeeping), a moving average per (b, K). A K not yet measured is priced
    from its model forwards times the overhead ratio measured for other K, so host work is
    never assumed free. Leaving plain decoding costs the draft's catch-up, and admitting rows
    with a draft costs its prefill (`switch_seconds`): a one-off paid back only over the
    tokens the rows have left (`horizon`), so short completions at a batch where a round
    barely beats a plain step stay plain. alpha is a geometric estimate over recent rounds whose
    evidence ages every step, so a change of text shows quickly, with a prior worth
    `prior_trials` draft tokens: as plain steps age the evidence, alpha returns to the prior,
    so one round that kept nothing is tried again within a few steps rather than read, as
    its bare ratio would be, as a draft that never agrees. A new call's prompts are
    other text: what earlier calls measured carries over as a prior worth `carried_trials`
    draft tokens (`new_prompts`), not as hundreds of trials that a batch of 8 piles up and a
    batch-1 text at low acceptance would need ten rounds to outweigh.
    Now and then the losing side is tried once (a K round while plain wins, keeping alpha
    fresh; a plain step while speculation wins, keeping its timing fresh); each try that
    confirms the choice doubles the interval, up to `max_explore_every`. A try of speculation
    waits until what it is expected to lose (its catch-up, and its round's cost over the plain
    steps its tokens replace) fits its credit: `explore_budget` of every plain step's time,
    less what earlier tries lost. A try is charged what it lost in wall time, not what it was
    priced at (a draft's first pass over a long prompt can cost more than warm-up said), and
    drafts exactly the K it was priced for, never drafting on under the stopper. So the tries
    of a run whose draft never pays cost at most `explore_budget` of its plain time, plus one
    try's mispricing, yet a draft that would pay is found within a bounded amount of plain
    decoding. Where rounds already ran at the batch bucket, a try's tokens are priced at what
    they realized, not at what the model expects: a model that overrates the draft would
    otherwise call every try free.
    With a DraftStopper (model drafts, K auto) a chosen K > 0 only says "speculate": the round
    drafts up to the largest grid K and the stopper picks where it ends; the rounds it ran
    are what alpha and the step costs learn from.
    The model can be wrong where its assumptions are: acceptance comes in bursts (a draft is
    right for a whole line, then wrong), which a geometric alpha overrates, and prices measured
    in warm-up drift. So the rounds' realized payoff is the last word: once `payoff_rounds`
    rounds ran at a batch bucket, their tokens per row over their wall time, against a plain
    step's measured time there, must beat plain decoding, or that bucket decodes plain. The
    veto lifts when the tries that exploration still makes bring the realized payoff back
    above plain, or at a new call where rounds paid clearly over the run (a fading sum of ~50
    rounds). Rounds and plain steps must be compared in the same stretch of time: a host
    that is busy for a while slows both, but while speculation wins plain steps are rare, and
    a plain price measured in a busy stretch made slower rounds look a win (an int4 target at
    batch 8, AVX2 code: rounds at ~0.75x of plain by fresh prices, ~1.1x by a stale one). So
    a step price last measured more than `stale_steps` steps ago is replaced by the next
    measurement, not averaged with it, and where the payoff check judges rounds against a
    plain price that old, one plain step measures it afresh first.
    """

    def __init__(
        self,
        grid_ks: list[int],
        explore_every: int = 12,
        max_explore_every: int = 48,
        decay: float = 0.9,
        prior_alpha: float = 0.7,
        prior_trials: float = 2.0,
        explore_budget: float = 0.01,  # tries lose <= 1 % of plain time (+ one try)
        carried_trials: float = 4.0,
        payoff_rounds: int = 4,
        payoff_decay: float = 0.8,
        long_payoff_decay: float = 0.98,
        lift_margin: float = 1.2,
        lift_rounds: float = 2.0,
        stale_steps: int = 32,
    ):
        self.grid_ks, self.decay = grid_ks, decay
        self.base_interval, self.max_interval = explore_every, max_explore_every
        self.interval, self.since_explore = explore_every, 0
        self.try_credit = 0.0  # what tries may still lose: budget x plain time, less losses
        self.trying = False  # the step just chosen is a try of speculation while plain wins
        self._try_prices = (0.0, 0.0)  # that try's plain step price and its priced loss
        self.prior_alpha, self.prior_trials = prior_alpha, prior_trials
        self.explore_budget = explore_budget
        self.carried_trials = carried_trials
        self.accepted, self.trials = 0.0, 0.0
        self.last_best: int | None = None
        self.row_token_seconds = 0.0  # a batch step's cost per token of one row, at the best K
        self.step_seconds: dict[tuple[int, int], float] = {}  # (b, K) -> whole step, averaged
        self.forward_seconds: dict[tuple[int, int], float] = {}  # (b, K) -> its forwards then
        self.clock = 0  # steps chosen so far
        self.measured_at: dict[tuple[int, int], int] = {}  # (b, K) -> clock when last measured
        self.stale_steps = stale_steps
        self.payoff_rounds = payoff_rounds
        self.rounds_at: dict[int, int] = {}  # b -> speculative rounds run at batch bucket b
        self.payoff_decay, self.long_payoff_decay = payoff_decay, long_payoff_decay
        self.lift_margin, self.lift_rounds = lift_margin, lift_rounds
        self.round_seconds: dict[int, float] = {}  # b -> rounds' wall time, fading sum
        self.round_row_tokens: dict[int, float] = {}  # b -> tokens they gave a row, fading sum
        self.round_weight: dict[int, float] = {}  # b -> how many rounds those sums weigh
        self.long_seconds: dict[int, float] = {}  # the same two sums, fading ~50x slower: the
        self.long_row_tokens: dict[int, float] = {}  # payoff over the run, not the last stretch

    @property
    def alpha(self) -> float:
        """Kept over drafted tokens, with `prior_trials` of them at the prior (typical of a
        same-family draft, inviting a first try). Ageing scales the evidence, not the prior."""
        prior = self.prior_trials * self.prior_alpha
        return min((self.accepted + prior) / (self.trials + self.prior_trials), 0.999)

    def new_prompts(self) -> None:
        """Keep alpha, but only as a prior: the next prompts' own rounds soon outweigh it. The
        payoff check starts again from what rounds realized over the run where the last stretch
        realized less: a draft that pays, vetoed on a stretch of text it could not guess, is not
        kept off the next prompts (at batch 1 a try must pay a new prompt's draft prefill,
        which its credit covers only after ~50 s of plain decoding). Only where they paid
        `lift_margin` x plain: a lift costs the next prompt's draft prefill and the rounds until
        the check vetoes again, which a draft paying ~1.0x over the run does not earn back
        (with AVX2 code the eager 0.5B draft, paying on code and not on free text, lost ~4 % on
        free text when lifted at 1.0x). The run's payoff weighs as `lift_rounds` rounds, not
        as the ~5 of the last stretch, at every lift: the new text's own rounds decide within
        a few (prompt lookup, paying 1.5x on copy tasks, ran ~8 losing rounds on each
        free-text prompt after its lift, 0.95x plain with AVX2 code)."""
        if self.trials > self.carried_trials:
            scale = self.carried_trials / self.trials
            self.accepted, self.trials = self.accepted * scale, self.trials * scale
        for b, seconds in self.round_seconds.items():  # start from the run's payoff
            long_rate = self.long_row_tokens[b] / self.long_seconds[b]
            plain = self.step_seconds.get((b, 0))
            paid_clearly = plain and long_rate * plain >= self.lift_margin
            if paid_clearly and self.round_row_tokens[b] < long_rate * seconds:
                self.round_seconds[b] = self.lift_rounds * seconds / self.round_weight[b]
                self.round_row_tokens[b] = long_rate * self.round_seconds[b]
                self.round_weight[b] = self.lift_rounds

    def observe(self, k: int, accepted: list[int]) -> None:
        for count in accepted:
            self.accepted += count
            self.trials += count + (count < k)

    def observe_step(self, b: int, k: int, seconds: float, forward_seconds: float) -> None:
        """A whole step's wall time and its model forwards' share, for pricing steps; a price
        gone stale is replaced, a fresh one averaged."""
        key = (b, k)
        stale = self._stale(key)
        self.measured_at[key] = self.clock
        if stale:
            self.step_seconds[key], self.forward_seconds[key] = seconds, forward_seconds
            return
        self.step_seconds[key] += 0.25 * (seconds - self.step_seconds[key])
        self.forward_seconds[key] += 0.25 * (forward_seconds - self.forward_seconds[key])

    def observe_round_payoff(self, b: int, seconds: float, tokens_per_row: float) -> None:
        """A speculative round's wall time and the tokens it gave each live row; older rounds
        fade by `payoff_decay` a round (a ratio of sums, so a burst counts at its weight)."""
        self.rounds_at[b] = self.rounds_at.get(b, 0) + 1
        for fade, spent, gained in (
            (self.payoff_decay, self.round_seconds, self.round_row_tokens),
            (self.long_payoff_decay, self.long_seconds, self.long_row_tokens),
        ):
            spent[b] = spent.get(b, 0.0) * fade + seconds
            gained[b] = gained.get(b, 0.0) * fade + tokens_per_row
        self.round_weight[b] = self.round_weight.get(b, 0.0) * self.payoff_decay + 1

    def _stale(self, key: tuple[int, int]) -> bool:
        """Never measured, or last measured more than `stale_steps` steps ago."""
        return key not in self.measured_at or self.clock - self.measured_at[key] > self.stale_steps

    def realized_speedup(self, b: int, plain_seconds: float) -> float | None:
        """Tokens per second the rounds at batch bucket b gave, over a plain step's (one
        token per row in `plain_seconds`); None until `payoff_rounds` rounds ran there."""
        if self.rounds_at.get(b, 0) < self.payoff_rounds:
            return None
        return self.round_row_tokens[b] * plain_seconds / self.round_seconds[b]

    def step_cost(self, b: int, k: int, forwards_seconds: float) -> float:
        """Measured whole-step time, or the forwards' time x the measured overhead ratio."""
        if (b, k) in self.step_seconds:
            return self.step_seconds[(b, k)]
        ratios = [
            self.step_seconds[key] / self.forward_seconds[key]
            for key in self.step_seconds
            if key[0] == b and self.forward_seconds[key] > 0
        ]
        return forwards_seconds * (max(ratios) if ratios else 1.0)

    def wants_draft(
        self, b: int, target_seconds, draft_seconds, prefill_seconds: float, horizon: float
    ) -> bool:
        """Whether rows being admitted should get draft state (its prefill) now."""
        return self._best(b, target_seconds, draft_seconds, prefill_seconds, horizon)[0] > 0

    def _round(self, b: int, k: int, target_seconds, draft_seconds, horizon: float):
        """A K round's expected tokens per row (at most `horizon`) and its whole-step cost."""
        alpha = self.alpha
        tokens = min((1 - alpha ** (k + 1)) / (1 - alpha), max(horizon, 1.0))
        return tokens, self.step_cost(b, k, draft_seconds(k) + target_seconds(k + 1))

    def _best(self, b: int, target_seconds, draft_seconds, switch_seconds: float, horizon: float):
        horizon = max(horizon, 1.0)
        plain = self.step_cost(b, 0, target_seconds(1))
        best_k, best_rate = 0, 1.0 / plain
        for k in self.grid_ks:
            tokens, cost = self._round(b, k, target_seconds, draft_seconds, horizon)
            rate = tokens / (cost + switch_seconds * tokens / horizon)
            if rate > best_rate:
                best_k, best_rate = k, rate
        realized = self.realized_speedup(b, plain)
        if best_k and realized is not None and realized < 1.0:  # measured: it does not pay
            return 0, plain, 1.0 / plain
        return best_k, plain, best_rate

    def choose(
        self, b: int, target_seconds, draft_seconds, switch_seconds: float, horizon: float
    ) -> int:
        """target_seconds(t), draft_seconds(k): measured forward times at batch bucket b;
        switch_seconds: the extra a K round costs now because the draft lags the context;
        horizon: tokens the batch's rows have left, over which that extra is paid back."""
        self.accepted *= self.decay
        self.trials *= self.decay
        self.clock += 1
        best_k, plain, rate = self._best(b, target_seconds, draft_seconds, switch_seconds, horizon)
        self.row_token_seconds = 1.0 / rate
        if (best_k == 0) != (self.last_best == 0):  # the choice flipped: explore eagerly again
            self.interval = self.base_interval
        self.last_best = best_k
        self.since_explore += 1
        chosen = best_k
        if self.since_explore >= self.interval:
            self.since_explore = 0
            self.interval = min(2 * self.interval, self.max_interval)
            try_k = self.grid_ks[0]
            tokens, cost = self._round(b, try_k, target_seconds, draft_seconds, horizon)
            realized = self.realized_speedup(b, plain)
            if realized is not None:  # rounds ran here: a try earns at most what they earned
                tokens = min(tokens, realized * cost / plain)
            loss = switch_seconds + cost - tokens * plain  # what the try costs over plain steps
            affordable = loss <= self.try_credit
            chosen = 0 if best_k else (try_k if affordable else 0)
            self._try_prices = (plain, loss)
        if chosen and self.rounds_at.get(b, 0) >= self.payoff_rounds and self._stale((b, 0)):
            chosen = 0  # the payoff check's plain price is stale: measure a plain step first
        self.trying = bool(chosen) and not best_k
        if not chosen:
            self.try_credit += self.explore_budget * plain
        elif self.trying:
            self.try_credit -= self._try_prices[1]  # until settle_try charges what it lost
        else:
            self.try_credit = min(self.try_credit, 0.0)  # speculating: tries start afresh
        return chosen

    def settle_try(self, seconds: float, tokens_per_row: float) -> None:
        """The try just run took `seconds` (its catch-up included) for `tokens_per_row`: charge
        what it lost against plain steps instead of what it was priced to lose."""
        plain, priced_loss = self._try_prices
        self.try_credit += priced_loss - (seconds - tokens_per_row * plain)


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
