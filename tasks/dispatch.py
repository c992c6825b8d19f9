"""How a run's pending shards reach accelerators: as Prefect tasks in this process, or as
`generate_shards` flow runs of a deployment (workers / pods), bounded by slots and the cost cap,
with a progress artifact updated as shards commit.
"""

from __future__ import annotations

import time
from uuid import UUID

from prefect import get_client
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.deployments import run_deployment
from prefect.futures import PrefectFuture, as_completed
from prefect.tasks import exponential_backoff

from schemas.run import RunConfig
from tasks.commit import read_manifest
from tasks.failures import state_failure
from tasks.layout import RunLayout
from tasks.planning import Plan, Shard
from tasks.scheduling import CostBudget, run_bounded, shard_spend
from tasks.shard import generate_shard
from tasks.stopping import stop_requested


def shard_task(config: RunConfig):
    return generate_shard.with_options(
        retries=config.shard_retries,
        retry_delay_seconds=exponential_backoff(backoff_factor=2)(config.shard_retries),
        timeout_seconds=config.shard_timeout_seconds,
    )


class RunProgress:
    """A Prefect progress artifact plus the budget, updated as shards finish."""

    def __init__(
        self, layout: RunLayout, plan: Plan, budget: CostBudget, committed: dict[str, dict]
    ):
        """`committed`: shard id -> manifest of what was committed before dispatching."""
        self.layout, self.total, self.budget = layout, len(plan.shards), budget
        self.failed: dict[str, str] = {}  # shard id -> why
        self.done = len(committed)
        for manifest in committed.values():
            budget.record(shard_spend(manifest))
        self.artifact = create_progress_artifact(
            self._percent(), key=f"corpusgen-progress-{layout.run_id.lower().replace('_', '-')}",
            description=f"shards committed in run {layout.run_id}",
        )

    def _percent(self) -> float:
        return 100.0 * self.done / self.total if self.total else 100.0

    def shards_finished(self, shards: list[Shard], failure: str | None) -> None:
        for shard in shards:
            manifest = read_manifest(self.layout, shard.shard_id)
            if manifest is None:
                self.failed[shard.shard_id] = failure or "finished without a commit"
            else:
                self.budget.record(shard_spend(manifest))
                self.done += 1
        update_progress_artifact(self.artifact, self._percent())


def dispatch_local(config: RunConfig, pending: list[Shard], progress: RunProgress) -> list[Shard]:
    """Shards as tasks in this process. A shard another live run of the config is generating
    (its lease is held) is passed over, and waited for once everything else is done."""
    task_with_options, run_date = shard_task(config), progress.layout.run_date
    leased: list[Shard] = []

    def wait_first(futures: list[PrefectFuture]) -> PrefectFuture:
        return next(as_completed(futures))

    def on_done(future: PrefectFuture, shard: Shard) -> None:
        future.wait()
        if future.state.is_completed() and future.result().status == "leased":
            leased.append(shard)
            return
        progress.shards_finished([shard], None if future.state.is_completed()
                                 else state_failure(future.state))

    def run(shards: list[Shard], wait_for_lease: bool) -> list[Shard]:
        return run_bounded(
            shards,
            submit=lambda shard: task_with_options.submit(config, run_date, shard, wait_for_lease),
            wait_first=wait_first,
            on_done=on_done,
            slots=config.accelerator_slots,
            budget=progress.budget,
            stopping=stop_requested,
        )

    unscheduled = run(pending, wait_for_lease=False)
    waited, leased[:] = list(leased), []
    return unscheduled + run(waited, wait_for_lease=True)


def dispatch_deployments(
    config: RunConfig, pending: list[Shard], progress: RunProgress
) -> list[Shard]:
    """One `generate_shards` flow run per batch; the parent waits for all of them."""
    size = config.dispatch.shards_per_run
    batches = [pending[i : i + size] for i in range(0, len(pending), size)]
    parameters = config.model_dump(mode="json")

    def submit(batch: list[Shard]) -> UUID:
        flow_run = run_deployment(
            config.dispatch.deployment,
            parameters={"config": parameters, "shard_ids": [s.shard_id for s in batch]},
            timeout=0,
        )
        return flow_run.id

    def wait_first(flow_run_ids: list[UUID]) -> UUID:
        with get_client(sync_client=True) as client:
            while True:
                for flow_run_id in flow_run_ids:
                    if client.read_flow_run(flow_run_id).state.is_final():
                        return flow_run_id
                time.sleep(2)

    def on_done(flow_run_id: UUID, batch: list[Shard]) -> None:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run_id).state
        progress.shards_finished(batch, None if state.is_completed() else state.message)

    left = run_bounded(
        batches, submit, wait_first, on_done,
        slots=config.accelerator_slots, budget=progress.budget, size=len,
        stopping=stop_requested,
    )
    return [shard for batch in left for shard in batch]
