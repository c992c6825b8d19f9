"""Speculation accounting and the choice of K. Definitions follow vLLM:
acceptance rate = accepted / proposed; mean accepted length = 1 + accepted / rounds, where a
round is one row's proposal-and-verification (so a batch-8 round counts 8).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class EngineStats:
    tokens_generated: int = 0
    prompt_tokens: int = 0
    padding_waste: float | None = None  # padded / computed slots, all forwards; None: none ran
    batch_bucket_max: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    distinct_shapes: int = 0
    target_shapes: int = 0
    draft_shapes: int = 0
    compiles: int = 0
    graph_captures: int = 0  # CUDA graphs captured (one per grid shape a runner met)
    prefill_seconds: float = 0.0
    draft_prefill_seconds: float = 0.0  # the part of prefill_seconds the draft took
    decode_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    host_seconds: float = 0.0
    wall_seconds: float = 0.0
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)
    steps_per_k: dict[int, int] = field(default_factory=dict)  # batch steps by K (0 = plain)
    # With a draft: the batch steps plain decoding would have run for the same rows (the
    # engine's schedule replayed on their lengths) and their [b, 1] forward time at this load;
    # None once a call ran without warm-up times to price them.
    plain_decode_steps: int = 0
    plain_decode_seconds: float | None = 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """None when nothing was proposed: undefined, not zero acceptance."""
        return self.accepted / self.proposed if self.proposed else None

    @property
    def mean_accepted_length(self) -> float | None:
        return 1.0 + self.accepted / self.rounds if self.rounds else None

    @property
    def seconds_saved_by_speculation(self) -> float | None:
        """Estimated plain decoding time minus the measured decoding time with the draft (its
        steps, rounds and prefill). Nothing drafted: plain decoding ran, nothing saved."""
        if self.rounds == 0 and self.draft_prefill_seconds == 0:
            return 0.0
        if self.plain_decode_seconds is None:
            return None
        spent = self.decode_seconds + self.draft_seconds + self.verify_seconds
        return self.plain_decode_seconds - spent - self.draft_prefill_seconds

    def record_plain_estimate(self, seconds: float | None) -> None:
        """Add a call's plain-decoding estimate; one unpriced call leaves the total unknown."""
        if seconds is None or self.plain_decode_seconds is None:
            self.plain_decode_seconds = None
        else:
            self.plain_decode_seconds += seconds

    def record_step(self, k: int) -> None:
        self.steps_per_k[k] = self.steps_per_k.get(k, 0) + 1

    def record_round(self, k: int, accepted: list[int]) -> None:
        if len(self.accepted_per_position) < k:
            grow = k - len(self.accepted_per_position)
            self.accepted_per_position += [0] * grow
            self.proposed_per_position += [0] * grow
        for count in accepted:
            self.rounds += 1
            self.proposed += k
            self.accepted += count
            for position in range(k):
                self.proposed_per_position[position] += 1
                self.accepted_per_position[position] += position < count

    def as_dict(self) -> dict:
        return asdict(self) | {
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "seconds_saved_by_speculation": self.seconds_saved_by_speculation,
        }


class DraftLengthChooser:
    """Picks K (0 = plain decoding) maximising expected tokens per second for the batch.

    Expected tokens per row per round with acceptance alpha: (1 - alpha^(K+1)) / (1 - alpha).
    A step's cost is its whole measured wall time at this batch bucket (draft, verify,
    sampling, host bookkeeping), a moving average per (b, K). A K not yet measured is priced
    from its model forwards times the overhead ratio measured for other K, so host work is
    never assumed free. Leaving plain decoding costs the draft's catch-up, and admitting rows
    with a draft costs its prefill (`switch_seconds`): a one-off paid back only over the
    tokens the rows have left (`horizon`), so short completions at a batch where a round
    barely beats a plain step stay plain. alpha is a geometric MLE over recent rounds whose
    evidence ages every step, so a change of text shows quickly. A new call's prompts are
    other text: what earlier calls measured carries over as a prior worth `carried_trials`
    draft tokens (`new_prompts`), not as hundreds of trials that a batch of 8 piles up and a
    batch-1 text at low acceptance would need ten rounds to outweigh.
    Now and then the losing side is tried once (a K round while plain wins, keeping alpha
    fresh; a plain step while speculation wins, keeping its timing fresh); each try that
    confirms the choice doubles the interval, up to `max_explore_every`. A try of speculation
    waits until its catch-up is at most `explore_budget` of the plain time spent since the
    last one: exploring may never make plain-winning runs noticeably slower, yet a draft that
    would pay is found within a bounded amount of plain decoding.
    With a DraftStopper (model drafts, K auto) a chosen K > 0 only says "speculate": the round
    drafts up to the largest grid K and the stopper picks where it ends; the rounds it ran
    are what alpha and the step costs learn from.
    """

    def __init__(
        self,
        grid_ks: list[int],
        fixed: int | None,
        explore_every: int = 12,
        max_explore_every: int = 48,
        decay: float = 0.9,
        prior_alpha: float = 0.7,
        explore_budget: float = 0.05,
        carried_trials: float = 4.0,
    ):
        self.grid_ks, self.fixed, self.decay = grid_ks, fixed, decay
        self.base_interval, self.max_interval = explore_every, max_explore_every
        self.interval, self.since_explore = explore_every, 0
        self.plain_since_try = 0.0  # plain seconds since speculation last ran: the try budget
        self.prior_alpha, self.explore_budget = prior_alpha, explore_budget
        self.carried_trials = carried_trials
        self.accepted, self.trials = 0.0, 0.0
        self.last_best: int | None = None
        self.row_token_seconds = 0.0  # a batch step's cost per token of one row, at the best K
        self.step_seconds: dict[tuple[int, int], float] = {}  # (b, K) -> whole step, averaged
        self.forward_seconds: dict[tuple[int, int], float] = {}  # (b, K) -> its forwards then

    @property
    def alpha(self) -> float:
        """Ageing scales both counts alike, so it reweighs old evidence without moving alpha.
        With no evidence yet, a prior typical of a same-family draft invites a first try."""
        if self.trials < 1e-3:
            return self.prior_alpha
        return min(self.accepted / self.trials, 0.999)

    def new_prompts(self) -> None:
        """Keep alpha, but only as a prior: the next prompts' own rounds soon outweigh it."""
        if self.trials > self.carried_trials:
            scale = self.carried_trials / self.trials
            self.accepted, self.trials = self.accepted * scale, self.trials * scale

    def observe(self, k: int, accepted: list[int]) -> None:
        for count in accepted:
            self.accepted += count
            self.trials += count + (count < k)

    def observe_step(self, b: int, k: int, seconds: float, forward_seconds: float) -> None:
        """A whole step's wall time and its model forwards' share, for pricing steps."""
        key = (b, k)
        if key not in self.step_seconds:
            self.step_seconds[key], self.forward_seconds[key] = seconds, forward_seconds
            return
        self.step_seconds[key] += 0.25 * (seconds - self.step_seconds[key])
        self.forward_seconds[key] += 0.25 * (forward_seconds - self.forward_seconds[key])

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
        if self.fixed is not None:
            return True
        return self._best(b, target_seconds, draft_seconds, prefill_seconds, horizon)[0] > 0

    def _best(self, b: int, target_seconds, draft_seconds, switch_seconds: float, horizon: float):
        alpha, horizon = self.alpha, max(horizon, 1.0)
        plain = self.step_cost(b, 0, target_seconds(1))
        best_k, best_rate = 0, 1.0 / plain
        for k in self.grid_ks:
            tokens = min((1 - alpha ** (k + 1)) / (1 - alpha), horizon)
            cost = self.step_cost(b, k, draft_seconds(k) + target_seconds(k + 1))
            rate = tokens / (cost + switch_seconds * tokens / horizon)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, plain, best_rate

    def choose(
        self, b: int, target_seconds, draft_seconds, switch_seconds: float, horizon: float
    ) -> int:
        """target_seconds(t), draft_seconds(k): measured forward times at batch bucket b;
        switch_seconds: the extra a K round costs now because the draft lags the context;
        horizon: tokens the batch's rows have left, over which that extra is paid back."""
        if self.fixed is not None:
            return self.fixed
        self.accepted *= self.decay
        self.trials *= self.decay
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
            affordable = switch_seconds <= self.explore_budget * self.plain_since_try
            chosen = 0 if best_k else (self.grid_ks[0] if affordable else 0)
        self.plain_since_try = 0.0 if chosen else self.plain_since_try + plain
        return chosen
