"""What the engine returns: one `Completion` per prompt, in input order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "error"]


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    error: str | None = None
    # Speculation counters for this completion (zero with draft=None).
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
