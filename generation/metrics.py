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
    prefill_seconds: float = 0.0
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
    # What plain decoding would have spent on the tokens the speculative rounds produced
    # (measured [b, 1] step time x the plain steps needed); None once a round's b is unmeasured.
    plain_seconds_for_rounds: float | None = 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """None when nothing was proposed: undefined, not zero acceptance."""
        return self.accepted / self.proposed if self.proposed else None

    @property
    def mean_accepted_length(self) -> float | None:
        return 1.0 + self.accepted / self.rounds if self.rounds else None

    @property
    def seconds_saved_by_speculation(self) -> float | None:
        """Estimated plain decoding time of the speculative rounds minus their measured time."""
        if self.plain_seconds_for_rounds is None:
            return None
        return self.plain_seconds_for_rounds - self.draft_seconds - self.verify_seconds

    def record_plain_estimate(self, tokens: int, rows: int, plain_step_seconds: float | None):
        """A round gave `rows` live rows `tokens` tokens: plain needs tokens / rows steps."""
        if plain_step_seconds is None or self.plain_seconds_for_rounds is None:
            self.plain_seconds_for_rounds = None
        else:
            self.plain_seconds_for_rounds += tokens / rows * plain_step_seconds

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
    Round time = measured draft time for K + measured target time for a [b, K+1] forward, so
    the cost of verifying at larger batch is measured, not assumed free. alpha is a geometric
    MLE over recent rounds whose evidence ages every step, so a change of text shows quickly.
    Now and then the losing side is tried once (a K round while plain wins, keeping alpha
    fresh; a plain step while speculation wins, keeping its timing fresh); each try that
    confirms the choice doubles the interval, up to `max_explore_every`.
    """

    def __init__(
        self,
        grid_ks: list[int],
        fixed: int | None,
        explore_every: int = 12,
        max_explore_every: int = 48,
        decay: float = 0.9,
    ):
        self.grid_ks, self.fixed, self.decay = grid_ks, fixed, decay
        self.base_interval, self.max_interval = explore_every, max_explore_every
        self.interval, self.since_explore = explore_every, 0
        self.accepted, self.trials = 0.0, 0.0
        self.last_best: int | None = None

    @property
    def alpha(self) -> float:
        """Ageing scales both counts alike, so it reweighs old evidence without moving alpha."""
        if self.trials < 1e-3:
            return 0.5  # no evidence yet: a neutral prior that invites a first measurement
        return min(self.accepted / self.trials, 0.999)

    def observe(self, k: int, accepted: list[int]) -> None:
        for count in accepted:
            self.accepted += count
            self.trials += count + (count < k)

    def choose(self, target_seconds, draft_seconds) -> int:
        """target_seconds(t) and draft_seconds(k): measured times at the current batch bucket."""
        if self.fixed is not None:
            return self.fixed
        self.accepted *= self.decay
        self.trials *= self.decay
        alpha = self.alpha
        best_k, best_rate = 0, 1.0 / target_seconds(1)
        for k in self.grid_ks:
            tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
            rate = tokens / (draft_seconds(k) + target_seconds(k + 1))
            if rate > best_rate:
                best_k, best_rate = k, rate
        if (best_k == 0) != (self.last_best == 0):  # the choice flipped: explore eagerly again
            self.interval = self.base_interval
        self.last_best = best_k
        self.since_explore += 1
        if self.since_explore < self.interval:
            return best_k
        self.since_explore = 0
        self.interval = min(2 * self.interval, self.max_interval)
        return self.grid_ks[0] if best_k == 0 else 0
