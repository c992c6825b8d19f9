"""The batch schedule as slot arithmetic: which slots waiting prompts take, when live rows move
to a smaller bucket, how wide a step runs. The engine runs it on its rows; `plain_decode_steps`
replays it on row lengths alone, to count the steps plain decoding would have taken. One copy of
the rules, so the replay cannot drift from what the engine does.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from generation.runner import bucket


def batch_capacity(batch_sizes: list[int], prompts: int) -> int:
    """Slots for a call: the bucket that holds its prompts, at most the largest bucket."""
    return bucket(batch_sizes, max(1, min(prompts, batch_sizes[-1])))


def slots_to_fill(slots: Sequence[Any], waiting: int) -> list[int]:
    """Free slots, lowest first, that the next `waiting` prompts take."""
    return [i for i, row in enumerate(slots) if row is None][:waiting]


def step_width(slots: Sequence[Any], batch_sizes: list[int]) -> int:
    """The batch bucket a step runs at: it covers the highest live slot."""
    return bucket(batch_sizes, max(i for i, row in enumerate(slots) if row) + 1)


def rows_to_compact(slots: Sequence[Any], batch_sizes: list[int]) -> list[int]:
    """Live slots, in order, when moving them to the front fits a smaller bucket; else []."""
    live = [i for i, row in enumerate(slots) if row]
    if bucket(batch_sizes, len(live)) == step_width(slots, batch_sizes):
        return []
    return live


@dataclass
class _Replayed:
    context: int  # prompt + generated tokens
    left: int  # tokens still to generate


def plain_decode_steps(
    rows: Sequence[tuple[int, int]], batch_sizes: list[int], cache_lengths: list[int]
) -> Counter[tuple[int, int]]:
    """Plain decode steps by (batch bucket, cache bucket) for rows given as (prompt tokens,
    generated tokens) in admission order: the engine's schedule with one token per live row
    per step, the first from the prefill. Speculation keeps the target's output, so a drafted
    call's rows replay into the steps the same call decoded plain would have run."""
    waiting = deque(rows)
    slots: list[_Replayed | None] = [None] * batch_capacity(batch_sizes, len(rows))
    steps: Counter[tuple[int, int]] = Counter()

    def collect() -> None:
        for i, row in enumerate(slots):
            if row and row.left <= 0:
                slots[i] = None

    while waiting or any(slots):
        for slot in slots_to_fill(slots, len(waiting)):
            prompt, generated = waiting.popleft()
            slots[slot] = _Replayed(prompt + 1, generated - 1)
        collect()
        if not any(slots):
            continue
        if not waiting and (live := rows_to_compact(slots, batch_sizes)):
            slots = [slots[i] for i in live] + [None] * (len(slots) - len(live))
        width = step_width(slots, batch_sizes)
        batch = [row for row in slots[:width] if row]
        steps[(width, bucket(cache_lengths, max(row.context for row in batch)))] += 1
        for row in batch:
            row.context, row.left = row.context + 1, row.left - 1
        collect()
    return steps
