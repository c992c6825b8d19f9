"""What the engine returns: one `Completion` per prompt, in input order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# stop: EOS / a stop string or id; length: max_new_tokens reached; cache_full: the row reached
# the largest cache bucket first; error: the prompt was refused (see `error`).
FinishReason = Literal["stop", "length", "cache_full", "error"]


class GenerationStopped(RuntimeError):
    """generate() was asked to stop between steps; its rows are dropped unfinished."""


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    error: str | None = None
    # The text's incomplete last character (a row cut mid multi-byte character) was dropped;
    # token_ids keep every token.
    trimmed_partial_character: bool = False
    # Speculation counters for this completion (zero with draft=None).
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # With a response format: whether the text is a whole value (False: cut by a limit).
    structured_complete: bool | None = None
    # With SamplingParams.logprobs: each token's log-probability under the distribution sampled.
    token_logprobs: list[float] | None = None
