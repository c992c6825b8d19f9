"""Prefect flows: `generate_corpus` plans a run and gets every shard committed once;
`generate_shards` is what a worker (or pod) runs for a batch of planned shards.

Both take the config as a dict or a path to a YAML/JSON file (deployment parameters are JSON).
"""

import signal
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import flow, get_client, task
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.sync import concurrency
from prefect.exceptions import TerminationSignal
from prefect.logging import get_run_logger
from prefect.states import Cancelled, State

from schemas.run import RunConfig, parse_run_config
from tasks.chains import check_fields, pin_upstream
from tasks.commit import finalize, recover
from tasks.dispatch import RunProgress, dispatch_deployments, dispatch_local, shard_task
from tasks.duplicates import with_duplicates
from tasks.failures import RunFailed, run_failure_message, state_failure
from tasks.filtering import filter_run
from tasks.layout import run_layout
from tasks.planning import Plan, check_unchanged, new_plan, plan_shards, write_plan
from tasks.quality import enforce_quality
from tasks.run_summary import publish_summary_artifacts, summarize_run
from tasks.scheduling import CostBudget
from tasks.stopping import request_stop, stop_requested, stop_signal
from tasks.storage import filesystem

# No postponed annotations in this module: Prefect builds the flows' parameter models from these
# types when a worker loads the flows by entrypoint.
ConfigSource = dict[str, Any] | str
SLOT_LEASE_SECONDS = 60  # renewed while the worker lives


@task(name="plan-run", cache_policy=NO_CACHE)
def plan_run(config: RunConfig) -> Plan:
    """Plan the shards and record the plan in the output before any generation."""
    check_fields(config)
    layout = run_layout(config)
    input_fs, input_path = filesystem(config.input.uri, config.storage)
    shards = with_duplicates(input_fs, plan_shards(input_fs, config, input_path), config.input)
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


def stopped_message(layout, planned: int, committed: int) -> str:
    """What an interrupted run kept, and how to finish it."""
    signum = stop_signal()
    cause = signal.Signals(signum).name if signum else "a stop request"
    return (
        f"run {layout.run_id} stopped on {cause}: {committed} of "
        f"{planned} shards committed and kept; shards in flight were abandoned before their "
        "commit. Rerun the same config to resume"
    )


@flow(name="generate-corpus")
def generate_corpus(config: ConfigSource) -> dict[str, Any] | State:
    """Plan -> one task per shard (bounded by accelerator slots and the cost cap) -> the
    run's filters, once all its shards are committed -> summary. A stop request (Ctrl-C in the
    CLI, a cancel from Prefect) ends it Cancelled."""
    run = load_config(config)
    logger = get_run_logger()
    plan = plan_run(run)
    layout = run_layout(run)
    recovered = recover(layout)
    for shard_id, outcome in recovered.repairs.items():  # commits cut short earlier
        logger.warning("shard %s: %s", shard_id, outcome)
    pending = [shard for shard in plan.shards if shard.shard_id not in recovered.manifests]
    logger.info(
        "run %s: %d shards planned, %d already committed", layout.run_id, len(plan.shards),
        len(plan.shards) - len(pending),
    )
    progress = RunProgress(layout, plan, CostBudget(run.cost_cap_usd), recovered.manifests)
    try:
        if run.dispatch.mode == "local":
            # One process, one engine: accelerator_slots bounds shards in flight here. No
            # global slot: ephemeral servers run no lease repossessor, so a SIGKILLed local
            # run would hold it forever and block its own resume.
            unscheduled = dispatch_local(run, pending, progress)
        else:
            ensure_accelerator_limit(run)
            unscheduled = dispatch_deployments(run, pending, progress)
    except TerminationSignal:  # Prefect cancels this flow run: shards in threads stop too
        request_stop(signal.SIGTERM)
        raise
    if stop_requested():
        return Cancelled(message=stopped_message(layout, len(plan.shards), progress.done))
    broken = finalize(layout)
    check_unchanged(filesystem(run.input.uri, run.storage)[0], plan.shards, layout.run_id)
    complete = not (broken or progress.failed or unscheduled)  # filters judge the whole run
    filtered = (filter_run.with_options(retries=run.shard_retries)(run, layout, plan)
                if run.filters and complete else None)
    summary = summarize_run(layout, run.output, plan, len(unscheduled), list(progress.failed),
                            filtered)
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
    shards = plan.select(shard_ids)
    with accelerator_slot(run):
        states = [task_with_options(run, layout.run_date, shard, return_state=True)
                  for shard in shards]
        for i, shard in enumerate(shards):  # another live run had these: wait for them
            if states[i].is_completed() and states[i].result().status == "leased":
                states[i] = task_with_options(run, layout.run_date, shard, True, return_state=True)
    failed = {shard_id: state_failure(state)
              for shard_id, state in zip(shard_ids, states, strict=True)
              if not state.is_completed()}
    if failed:
        raise RunFailed(run_failure_message(layout.run_id, failed, "failed"))
    return [asdict(state.result()) for state in states]


def load_config(config: ConfigSource | RunConfig) -> RunConfig:
    """The run's config; a chain step's pinned to its upstream run (tasks/chains.py)."""
    return pin_upstream(parse_run_config(Path(config) if isinstance(config, str) else config))
