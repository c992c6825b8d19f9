"""Speculation accounting. Definitions follow vLLM:
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
    prefill_padding_waste: float | None = None  # the same, prefill forwards only
    decode_padding_waste: float | None = None  # the same, decode and verify forwards only
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
