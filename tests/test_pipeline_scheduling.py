"""The scheduler: never more than `slots` in flight, and no new work once the projected cost
would pass the cap."""

from __future__ import annotations

from tasks.scheduling import CostBudget, run_bounded


def simulate(work, slots, budget, cost_of=lambda item: 1.0):
    """Run `run_bounded` with instant work finishing in submission order; track concurrency."""
    in_flight, peak, order = [], [0], []

    def submit(item):
        in_flight.append(item)
        peak[0] = max(peak[0], len(in_flight))
        return item

    def on_done(handle, item):
        in_flight.remove(item)
        order.append(item)
        budget.record(cost_of(item))

    left = run_bounded(work, submit, lambda handles: handles[0], on_done, slots, budget)
    return left, peak[0], order


def test_slots_bound_the_work_in_flight_and_everything_runs():
    left, peak, order = simulate(list(range(10)), slots=3, budget=CostBudget(None))
    assert left == [] and peak == 3 and order == list(range(10))


def test_cap_stops_scheduling_when_the_projection_passes_it():
    # each shard costs $1; cap $4.5: after 4 shards, a 5th would project to $5
    left, _, order = simulate(list(range(10)), slots=1, budget=CostBudget(4.5))
    assert order == [0, 1, 2, 3] and left == [4, 5, 6, 7, 8, 9]


def test_cap_counts_shards_still_running():
    # 2 slots: with 2 done ($2) and 1 running (~$1), a 4th would project to $4 > $3.5
    left, _, order = simulate(list(range(6)), slots=2, budget=CostBudget(3.5))
    assert len(order) == 3 and left == [3, 4, 5]


def test_money_already_spent_counts():
    budget = CostBudget(2.0)
    budget.record(2.5)  # committed by an earlier attempt of this run
    left, _, order = simulate([1, 2], slots=1, budget=budget)
    assert order == [] and left == [1, 2]


def test_batches_count_as_their_size():
    budget = CostBudget(5.0)
    budget.record(1.0)
    left = run_bounded(
        [[1, 2, 3], [4, 5, 6]], submit=lambda b: tuple(b), wait_first=lambda h: h[0],
        on_done=lambda h, b: [budget.record(1.0) for _ in b], slots=1, budget=budget, size=len,
    )
    assert left == [[4, 5, 6]]  # $1 + 3 x $1 = $4 done; 3 more would make $7


def test_shard_tasks_retry_io_errors_with_backoff_and_nothing_else():
    from prefect.states import Failed

    from flows.generate import shard_task
    from schemas import parse_run_config
    from tasks.failures import EngineLoadError
    from tasks.shard import is_io_error

    config = parse_run_config({
        "input": {"uri": "x.jsonl", "prompt_field": "p"},
        "generation": {"engine": {"target": {"path": "x"}}},
        "output": "out", "shard_retries": 3, "shard_timeout_seconds": 60,
    })
    task = shard_task(config)
    assert (task.retries, task.retry_delay_seconds, task.timeout_seconds) == (3, [2, 4, 8], 60)
    assert is_io_error(None, None, Failed(data=ConnectionResetError("s3 went away")))
    assert not is_io_error(None, None, Failed(data=ValueError("bad data")))
    assert is_io_error(None, None, Failed(data=OSError(5, "503 SlowDown, retries exhausted")))
    assert is_io_error(None, None, Failed(data=TimeoutError("read timed out")))
    for permanent in (FileNotFoundError("no such model dir"), PermissionError("AccessDenied"),
                      EngineLoadError("cannot load the engine"), MemoryError(),
                      RuntimeError("CUDA out of memory")):
        assert not is_io_error(None, None, Failed(data=permanent)), permanent
