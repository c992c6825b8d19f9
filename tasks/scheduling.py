"""Keep the accelerators busy without overspending: at most `slots` units of work in flight,
and no new unit once the projected cost would pass the cap."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

Work = TypeVar("Work")


def shard_spend(summary: dict[str, Any]) -> float:
    """What a committed shard cost, its engine load included (what the cost cap counts)."""
    return summary["cost"] + (summary.get("engine_load_cost") or 0.0)


@dataclass
class CostBudget:
    cap_usd: float | None
    spent_usd: float = 0.0
    shards_done: int = 0

    def record(self, cost: float) -> None:
        self.spent_usd += cost
        self.shards_done += 1

    def allows(self, shards_in_flight: int, shards_next: int = 1) -> bool:
        """Would starting `shards_next` more shards stay within the cap? Shards already running
        are assumed to cost the mean of the finished ones."""
        if self.cap_usd is None:
            return True
        if not self.shards_done:
            return self.spent_usd < self.cap_usd
        mean = self.spent_usd / self.shards_done
        return self.spent_usd + mean * (shards_in_flight + shards_next) <= self.cap_usd


def run_bounded(
    work: Sequence[Work],
    submit: Callable[[Work], Hashable],
    wait_first: Callable[[list[Hashable]], Hashable],
    on_done: Callable[[Hashable, Work], None],
    slots: int,
    budget: CostBudget,
    size: Callable[[Work], int] = lambda _: 1,
    stopping: Callable[[], bool] = lambda: False,
) -> list[Work]:
    """Submit work with at most `slots` in flight, while `budget` allows (`on_done` must record
    finished costs into it) and nobody asked to stop. Returns the work left unscheduled."""
    queue, in_flight = deque(work), {}
    while queue or in_flight:
        while queue and len(in_flight) < slots and not stopping():
            running = sum(size(item) for item in in_flight.values())
            if not budget.allows(running, size(queue[0])):
                break
            item = queue.popleft()
            in_flight[submit(item)] = item
        if not in_flight:
            break
        handle = wait_first(list(in_flight))
        on_done(handle, in_flight.pop(handle))
    return list(queue)
