"""Prefect flows: `generate_corpus` plans a run and gets every shard committed once;
`generate_shards` is what a worker (or pod) runs for a batch of planned shards.

Both take the config as a dict or a path to a YAML/JSON file (deployment parameters are JSON).
"""

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import flow, get_client, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.sync import concurrency
from prefect.deployments import run_deployment
from prefect.futures import PrefectFuture, as_completed
from prefect.logging import get_run_logger
from prefect.tasks import exponential_backoff

from schemas.run import RunConfig, parse_run_config
from tasks.commit import (
    committed_shard_ids,
    finish_publishes,
    read_manifest,
    sweep_losing_attempts,
    verify_committed,
)
from tasks.failures import RunFailed, run_failure_message, state_failure
from tasks.layout import RunLayout
from tasks.planning import Plan, Shard, new_plan, plan_shards, write_plan
from tasks.quality import enforce_quality
from tasks.run_summary import publish_summary_artifacts, summarize_run
from tasks.scheduling import CostBudget, run_bounded
from tasks.shard import generate_shard, run_layout, shard_spend
from tasks.storage import filesystem

# No postponed annotations in this module: Prefect builds the flows' parameter models from these
# types when a worker loads the flows by entrypoint.
ConfigSource = dict[str, Any] | str
SLOT_LEASE_SECONDS = 60  # renewed while the worker lives


@task(name="plan-run", cache_policy=NO_CACHE)
def plan_run(config: RunConfig) -> Plan:
    """Plan the shards and record the plan in the output before any generation."""
    layout = run_layout(config)
    input_fs, input_path = filesystem(config.input.uri, config.storage)
    shards = plan_shards(input_fs, config, input_path)
    return write_plan(layout, new_plan(layout, config, shards))


def ensure_accelerator_limit(config: RunConfig) -> None:
    """Create (or resize) the global concurrency limit that caps shards on accelerators."""
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(
            config.concurrency_limit, config.accelerator_slots
        )


def accelerator_slot(config: RunConfig):
    """One slot of the global limit per deployment worker, held while it generates a batch.

    The engine stays on its device between shards, so the slot is held per batch, not
    re-acquired per shard (an API round trip, and one right after a release waited ~2 s here).
    A killed worker's slot comes back when its lease expires (the server's repossessor)."""
    return concurrency(
        config.concurrency_limit, occupy=1, strict=True, lease_duration=SLOT_LEASE_SECONDS
    )


def shard_task(config: RunConfig):
    return generate_shard.with_options(
        retries=config.shard_retries,
        retry_delay_seconds=exponential_backoff(backoff_factor=2)(config.shard_retries),
        timeout_seconds=config.shard_timeout_seconds,
    )


class _Progress:
    """A Prefect progress artifact plus the budget, updated as shards finish."""

    def __init__(self, layout: RunLayout, plan: Plan, budget: CostBudget):
        self.layout, self.total, self.budget = layout, len(plan.shards), budget
        self.failed: dict[str, str] = {}  # shard id -> why
        self.done = len(committed_shard_ids(layout))
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


def _dispatch_local(config: RunConfig, pending: list[Shard], progress: _Progress) -> list[Shard]:
    task_with_options, run_date = shard_task(config), progress.layout.run_date

    def wait_first(futures: list[PrefectFuture]) -> PrefectFuture:
        return next(as_completed(futures))

    def on_done(future: PrefectFuture, shard: Shard) -> None:
        future.wait()
        progress.shards_finished([shard], None if future.state.is_completed()
                                 else state_failure(future.state))

    return run_bounded(
        pending,
        submit=lambda shard: task_with_options.submit(config, run_date, shard),
        wait_first=wait_first,
        on_done=on_done,
        slots=config.accelerator_slots,
        budget=progress.budget,
    )


def _dispatch_deployments(
    config: RunConfig, pending: list[Shard], progress: _Progress
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
    )
    return [shard for batch in left for shard in batch]


@flow(name="generate-corpus")
def generate_corpus(config: ConfigSource) -> dict[str, Any]:
    """Plan -> one task per shard (bounded by accelerator slots and the cost cap) -> summary."""
    run = load_config(config)
    logger = get_run_logger()
    plan = plan_run(run)
    layout = run_layout(run)
    for shard_id, outcome in finish_publishes(layout).items():  # commits cut short earlier
        logger.warning("shard %s: %s", shard_id, outcome)
    committed = committed_shard_ids(layout)
    pending = [shard for shard in plan.shards if shard.shard_id not in committed]
    logger.info(
        "run %s: %d shards planned, %d already committed", layout.run_id, len(plan.shards),
        len(plan.shards) - len(pending),
    )
    progress = _Progress(layout, plan, CostBudget(run.cost_cap_usd))
    for shard_id in sorted(committed):
        progress.budget.record(shard_spend(read_manifest(layout, shard_id)))
    if run.dispatch.mode == "local":
        # One process, one engine: accelerator_slots bounds shards in flight here. No global
        # slot: ephemeral servers run no lease repossessor, so a SIGKILLed local run would
        # hold it forever and block its own resume.
        unscheduled = _dispatch_local(run, pending, progress)
    else:
        ensure_accelerator_limit(run)
        unscheduled = _dispatch_deployments(run, pending, progress)
    finish_publishes(layout)
    sweep_losing_attempts(layout)
    broken = verify_committed(layout)
    summary = summarize_run(layout, run.output, plan, len(unscheduled), list(progress.failed))
    publish_summary_artifacts(summary, run.pricing.usd_per_hour(), run.pricing.device_type)
    if unscheduled:
        logger.warning("stopped on budget: %d shards not scheduled", len(unscheduled))
    if broken:
        raise RunFailed(run_failure_message(layout.run_id, broken, "committed but not intact"))
    if progress.failed:
        raise RunFailed(run_failure_message(layout.run_id, progress.failed, "failed"))
    enforce_quality(summary, run)
    return summary


@flow(name="generate-shards")
def generate_shards(config: ConfigSource, shard_ids: list[str]) -> list[dict[str, Any]]:
    """Generate a batch of shards that `generate_corpus` planned (one worker process/pod)."""
    run = load_config(config)
    layout = run_layout(run)
    try:
        plan = Plan.from_json(layout.fs.cat_file(layout.plan_path).decode())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no plan for run {layout.run_id} under {run.output}; start the run with "
            "generate_corpus (it plans before dispatching shards)"
        ) from None
    task_with_options = shard_task(run)
    ensure_accelerator_limit(run)  # idempotent; lets a batch run without its parent too
    with accelerator_slot(run):
        states = [
            task_with_options(run, layout.run_date, shard, return_state=True)
            for shard in plan.select(shard_ids)
        ]
    failed = {shard_id: state_failure(state)
              for shard_id, state in zip(shard_ids, states, strict=True)
              if not state.is_completed()}
    if failed:
        raise RunFailed(run_failure_message(layout.run_id, failed, "failed"))
    return [asdict(state.result()) for state in states]


def load_config(config: ConfigSource | RunConfig) -> RunConfig:
    return parse_run_config(Path(config) if isinstance(config, str) else config)
