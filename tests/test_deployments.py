"""Deployments end to end with real components: a `prefect server` (SQLite, loopback, free port),
the pools and limit from deployments/setup-pools.sh, `prefect deploy` from deployments/prefect.yaml,
a control worker plus two card workers from deployments/start-workers.sh, then
`prefect deployment run 'generate-corpus/ci' --watch` reading from and writing to a moto S3
server with the real engine on a tiny model. Every process started here is stopped at the end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pyarrow.dataset as ds
import pytest
import s3fs
import yaml
from conftest import free_port
from pipeline_fixtures import good_rows, run_config, tiny_engine, write_jsonl
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterName,
)

from schemas import parse_run_config
from tasks.job_templates import PROCESS_TEMPLATE, load_template, render_job_configuration

REPO = Path(__file__).resolve().parent.parent
PREFECT_YAML = REPO / "deployments" / "prefect.yaml"
TRIGGER = REPO / "deployments" / "ci" / "trigger.sh"
CARD_WORKERS = 2
# Distinctive credentials the workers get from their environment; moto accepts any.
ACCESS_KEY, SECRET_KEY = "AKIDDEPLOYE2E", "deploy-e2e-secret-never-written"


@dataclass
class PrefectStack:
    """A Prefect server and workers in their own process groups, with one log file each."""

    api_url: str
    env: dict[str, str]
    logs: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, name: str, *command: str) -> subprocess.Popen:
        with (self.logs / f"{name}.log").open("w") as log:  # the child keeps its own copy
            process = subprocess.Popen(
                command,
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes[name] = process
        return process

    def check(self, *args: str, timeout: float = 120) -> str:
        result = subprocess.run(
            args, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
        return result.stdout

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.processes["server"].poll() is None, self.log("server")
            try:
                if httpx.get(f"{self.api_url}/health", timeout=2).json() is True:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"prefect server not healthy after {timeout}s:\n{self.log('server')}")

    def wait_for_log(self, name: str, pattern: str, count: int = 1, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while len(re.findall(pattern, self.log(name))) < count:
            assert time.monotonic() < deadline, f"{name}: no {pattern!r} x{count}\n{self.log(name)}"
            assert self.processes[name].poll() is None, f"{name} exited:\n{self.log(name)}"
            time.sleep(0.5)

    def stop_all(self) -> list[int]:
        """SIGTERM every process group (workers stop cleanly on it), SIGKILL what is left after
        a grace period; returns the pids still alive afterwards (should be none)."""
        family = []
        for process in self.processes.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                root = psutil.Process(process.pid)
                family += [root, *root.children(recursive=True)]
        for name in reversed(list(self.processes)):  # workers before the server
            _signal_group(self.processes[name], signal.SIGTERM)
        _, alive = psutil.wait_procs(family, timeout=30)
        for process in self.processes.values():
            _signal_group(process, signal.SIGKILL)
        for straggler in alive:  # start-workers.sh runs each worker in its own process group
            with contextlib.suppress(psutil.NoSuchProcess):
                straggler.kill()
        _, alive = psutil.wait_procs(alive, timeout=10)
        return [p.pid for p in alive if _running(p)]


def _running(process: psutil.Process) -> bool:
    """Exited-but-unreaped (zombie) processes have stopped: orphans wait for PID 1 to reap them."""
    with contextlib.suppress(psutil.NoSuchProcess):
        return process.status() != psutil.STATUS_ZOMBIE
    return False


def _signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, s3_endpoint) -> Iterator[PrefectStack]:
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api_url,
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/prefect.db",
        "PREFECT_UI_ENABLED": "false",
        # No cron runs during the test: the nightly deployment must not fire mid-test.
        "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_WORKER_HEARTBEAT_SECONDS": "5",
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "PWD": str(REPO),  # what the local pull step resolves `{{ $PWD }}` to at deploy time
        "CORPUSGEN_GIT_REPOSITORY": str(REPO),
        "CORPUSGEN_WORKER_PREFIX": "e2e",
    }
    stack = PrefectStack(api_url, env, tmp_path_factory.mktemp("prefect-logs"))
    try:
        stack.start(
            "server", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)
        )
        stack.wait_healthy()
        stack.check(str(REPO / "deployments" / "setup-pools.sh"), str(CARD_WORKERS))
        stack.check(
            "prefect", "--no-prompt", "deploy", "--all", "--prefect-file", str(PREFECT_YAML)
        )
        stack.start(
            "control",
            "prefect",
            "worker",
            "start",
            "--pool",
            "corpusgen-control",
            "--name",
            "e2e-control",
        )
        stack.start("cards", str(REPO / "deployments" / "start-workers.sh"), str(CARD_WORKERS))
        stack.wait_for_log("control", r"Worker '.*' started")
        stack.wait_for_log("cards", r"Worker '.*' started", count=CARD_WORKERS)
        yield stack
    finally:
        survivors = stack.stop_all()
        assert not survivors, f"processes left running: {survivors}"


def client(stack: PrefectStack) -> SyncPrefectClient:
    return SyncPrefectClient(api=stack.api_url)


def deployment_run(
    stack: PrefectStack, config: dict, tmp_path: Path, watch_seconds: int = 240
) -> tuple[subprocess.CompletedProcess, str]:
    """Start `generate-corpus/ci` the way a CI job does (deployments/ci/trigger.sh, which runs
    `prefect deployment run ... --watch`); returns (result, flow run id)."""
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(config))
    result = subprocess.run(
        [str(TRIGGER), str(config_file)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**stack.env, "CORPUSGEN_WATCH_TIMEOUT": str(watch_seconds)},
    )
    match = re.search(r"UUID: ([0-9a-f-]{36})", result.stdout)
    assert match, f"no flow run id in:\n{result.stdout}\n{result.stderr}"
    return result, match.group(1)


def wait_for_submitting_workers(
    stack: PrefectStack, flow_run_ids: set[str], timeout: float = 60
) -> dict[str, str]:
    """flow run id -> name of the worker that started it, from the `submitted-flow-run` events a
    worker emits only after it won the run (events reach the database a few seconds late)."""
    body = {"filter": {"event": {"name": ["prefect.worker.submitted-flow-run"]}}, "limit": 50}
    deadline = time.monotonic() + timeout
    while True:
        response = httpx.post(f"{stack.api_url}/events/filter", json=body, timeout=10)
        events = response.raise_for_status().json()
        workers = {
            related["prefect.resource.id"].removeprefix("prefect.flow-run."): event["resource"][
                "prefect.resource.name"
            ]
            for event in events["events"]
            for related in event["related"]
            if related.get("prefect.resource.role") == "flow-run"
        }
        if flow_run_ids <= workers.keys() or time.monotonic() > deadline:
            return {run_id: workers.get(run_id) for run_id in flow_run_ids}
        time.sleep(1)


def flow_run_log_text(stack: PrefectStack, flow_run_id: str) -> str:
    return stack.check("prefect", "flow-run", "logs", flow_run_id)


def s3_config(s3_endpoint, tiny_llama_dir, input_uri: str, output: str) -> dict:
    return run_config(
        input_uri,
        output,
        tiny_engine(tiny_llama_dir),
        storage={"endpoint_url": s3_endpoint["endpoint_url"]},
        accelerator_slots=CARD_WORKERS,
        dispatch={
            "mode": "deployment",
            "deployment": "generate-shards/default",
            "shards_per_run": 1,
        },
    )


@pytest.mark.slow
def test_deploy_creates_what_the_yaml_declares(stack: PrefectStack) -> None:
    declared = yaml.safe_load(PREFECT_YAML.read_text())["deployments"]
    with client(stack) as api:
        deployments = {
            f"{api.read_flow(d.flow_id).name}/{d.name}": d for d in api.read_deployments()
        }
        pools = {pool.name: pool for pool in api.read_work_pools()}
        limit = api.read_global_concurrency_limit_by_name("corpusgen-accelerators")
    assert {d["name"] for d in declared} == {name.split("/")[1] for name in deployments}
    nightly, ci = deployments["generate-corpus/nightly"], deployments["generate-corpus/ci"]
    assert [s.schedule.cron for s in nightly.schedules] == ["0 2 * * *"]
    assert "git_clone" in json.dumps(nightly.pull_steps) and not ci.schedules
    assert ci.pull_steps == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}
    ]
    assert deployments["generate-shards/default"].work_pool_name == "gaudi"
    assert deployments["generate-shards/k8s"].job_variables["gaudi_cards"] == 1
    assert pools["gaudi"].concurrency_limit == CARD_WORKERS and pools["gaudi-k8s"].type == (
        "kubernetes"
    )
    assert "gaudi_cards" in pools["gaudi-k8s"].base_job_template["variables"]["properties"]
    assert limit.limit == CARD_WORKERS
    # One worker per card, each pinned with the HABANA_VISIBLE_MODULES its flow runs inherit.
    card_workers = psutil.Process(stack.processes["cards"].pid).children()
    assert sorted(w.environ()["HABANA_VISIBLE_MODULES"] for w in card_workers) == ["0", "1"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "job_variables", [{}, {"habana_visible_modules": "0,1", "env": {"CORPUSGEN_X": "1"}}]
)
def test_process_template_renders_as_prefects_process_worker_does(
    stack: PrefectStack, job_variables: dict
) -> None:
    """tasks/job_templates.py mirrors Prefect; check it against the worker's own code path."""
    from prefect.client.orchestration import PrefectClient
    from prefect.workers.process import ProcessJobConfiguration

    template = load_template(PROCESS_TEMPLATE)

    async def prefects_rendering() -> ProcessJobConfiguration:
        async with PrefectClient(api=stack.api_url) as api:
            return await ProcessJobConfiguration.from_template_and_values(
                template, job_variables, client=api
            )

    ours = render_job_configuration(template, job_variables)
    assert asyncio.run(prefects_rendering()).env == ours["env"]


def test_trigger_rejects_a_bad_config_before_queueing_anything(tmp_path) -> None:
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps({"input": {"uri": "in.jsonl"}, "seed": "x"}))
    result = subprocess.run(
        [str(TRIGGER), str(config_file)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"},  # nothing listens
    )
    assert result.returncode != 0
    for field_name in ("input", "generation", "output", "seed"):
        assert f"- {field_name}" in result.stderr, result.stderr
    assert "prefect" not in result.stdout.lower()


def race_two_runs(stack: PrefectStack, config: dict, shard_ids: list[str]) -> list:
    """Two generate-shards runs for the same shards, created at once; their final flow runs."""
    with client(stack) as api:
        deployment = api.read_deployment_by_name("generate-shards/default")
        runs = [
            api.create_flow_run_from_deployment(
                deployment.id, parameters={"config": config, "shard_ids": shard_ids}
            )
            for _ in range(2)
        ]
        deadline = time.monotonic() + 180
        while not all(run.state.is_final() for run in runs):
            assert time.monotonic() < deadline, [run.state for run in runs]
            time.sleep(1)
            runs = [api.read_flow_run(run.id) for run in runs]
    assert all(run.state.is_completed() for run in runs), [run.state for run in runs]
    return runs


@pytest.mark.slow
def test_two_workers_racing_on_the_same_shards_commit_each_once(
    stack: PrefectStack, s3_bucket, s3_endpoint, tiny_llama_dir, tmp_path
) -> None:
    """Two generate-shards runs for the same planned shards, one per card worker, at once: each
    shard ends with one manifest, its rows published once and no staged attempt left over.
    Whether the two flow runs overlap depends on when each worker polls and how fast its
    subprocess starts, so a pair that did not overlap (no race happened) is tried again on a
    fresh output, at most three times."""
    from flows.generate import plan_run

    rows = good_rows(16)
    write_jsonl(tmp_path / "in.jsonl", rows)
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint["endpoint_url"])
    fs.put(str(tmp_path / "in.jsonl"), "corpus-test/race/in.jsonl")
    for attempt in range(3):
        root = f"corpus-test/race/out{attempt}"
        config = s3_config(
            s3_endpoint, tiny_llama_dir, "s3://corpus-test/race/in.jsonl", f"s3://{root}"
        )
        plan = plan_run.fn(parse_run_config(config))  # what the parent does before dispatching
        shard_ids = [shard.shard_id for shard in plan.shards]
        first, second = race_two_runs(stack, config, shard_ids)
        if first.start_time < second.end_time and second.start_time < first.end_time:
            break
    else:
        pytest.fail("the two flow runs never overlapped in three tries: no race was tested")
    workers = wait_for_submitting_workers(stack, {str(first.id), str(second.id)})
    assert set(workers.values()) == {"e2e-card0", "e2e-card1"}

    assert len(fs.glob(f"{root}/manifests/*.json")) == len(shard_ids) == 2
    data = ds.dataset(f"{root}/data", filesystem=fs, partitioning="hive").to_table()
    assert sorted(data.column("id").to_pylist()) == sorted(row["id"] for row in rows)
    metrics = ds.dataset(f"{root}/metrics", filesystem=fs, partitioning="hive").to_table()
    assert sorted(metrics.column("shard_id").to_pylist()) == sorted(shard_ids)
    assert not fs.glob(f"{root}/_attempts/**/*.parquet")


@pytest.mark.slow
def test_nightly_runs_from_a_git_checkout(
    stack: PrefectStack, s3_bucket, s3_endpoint, tiny_llama_dir, tmp_path
) -> None:
    """The git pull variant: the flow run clones the repository and runs the flow from there."""
    write_jsonl(tmp_path / "in.jsonl", good_rows(8))
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint["endpoint_url"])
    fs.put(str(tmp_path / "in.jsonl"), "corpus-test/git/in.jsonl")
    config = run_config(
        "s3://corpus-test/git/in.jsonl",
        "s3://corpus-test/git/out",
        tiny_engine(tiny_llama_dir),
        storage={"endpoint_url": s3_endpoint["endpoint_url"]},
    )
    with client(stack) as api:
        deployment = api.read_deployment_by_name("generate-corpus/nightly")
        run = api.create_flow_run_from_deployment(deployment.id, parameters={"config": config})
        deadline = time.monotonic() + 180
        while not run.state.is_final():
            assert time.monotonic() < deadline, run.state
            time.sleep(1)
            run = api.read_flow_run(run.id)
    logs = flow_run_log_text(stack, str(run.id))
    assert run.state.is_completed(), logs
    assert "git_clone" in logs and "generate-corpus" in logs
    assert len(fs.glob("corpus-test/git/out/manifests/*.json")) == 1


@pytest.mark.slow
def test_broken_input_uri_fails_the_watch_and_the_logs_say_why(
    stack: PrefectStack, s3_bucket, s3_endpoint, tiny_llama_dir, tmp_path
) -> None:
    config = s3_config(
        s3_endpoint,
        tiny_llama_dir,
        "s3://corpus-test/nowhere/*.jsonl",
        "s3://corpus-test/e2e-broken/out",
    )
    result, flow_run_id = deployment_run(stack, config, tmp_path)
    assert result.returncode != 0, result.stdout
    logs = flow_run_log_text(stack, flow_run_id)
    assert "InputError" in logs and "nowhere/*.jsonl' matches no input files" in logs, logs


def test_yaml_entrypoints_pools_and_configs_fit_together() -> None:
    """Fast consistency checks of what `prefect deploy` and the workers will need."""
    from prefect.flows import load_flow_from_entrypoint

    declared = yaml.safe_load(PREFECT_YAML.read_text())["deployments"]
    created_pools = set(
        re.findall(r"work-pool create (\S+)", (REPO / "deployments/setup-pools.sh").read_text())
    )
    flows = {d["name"]: load_flow_from_entrypoint(str(REPO / d["entrypoint"])) for d in declared}
    names = {f"{flows[d['name']].name}/{d['name']}" for d in declared}
    assert {"generate-corpus/ci", "generate-corpus/nightly", "generate-shards/default"} <= names
    for deployment in declared:
        assert deployment["work_pool"]["name"] in created_pools, deployment["name"]
        if config := deployment.get("parameters", {}).get("config"):
            dispatch = parse_run_config(REPO / config).dispatch
            assert dispatch.mode == "deployment" and dispatch.deployment in names


@pytest.mark.slow
def test_a_ci_run_cancelled_after_its_watch_times_out_ends_cancelled_and_a_rerun_completes(
    stack: PrefectStack, s3_bucket, s3_endpoint, tiny_llama_dir, tmp_path
) -> None:
    """The CI job (trigger.sh) stops watching after its timeout with one line saying how to
    cancel the run; cancelling it from the API ends it Cancelled (not Crashed) without
    scheduling more shards. The same config triggered again completes: every record once,
    every shard committed once, shards spread over both card workers, credentials (from the
    workers' environment) written nowhere."""
    rows = good_rows(24)
    write_jsonl(tmp_path / "in.jsonl", rows)
    fs = s3fs.S3FileSystem(
        endpoint_url=s3_endpoint["endpoint_url"], key=ACCESS_KEY, secret=SECRET_KEY
    )
    fs.put(str(tmp_path / "in.jsonl"), "corpus-test/e2e/in.jsonl")
    config = s3_config(
        s3_endpoint, tiny_llama_dir, "s3://corpus-test/e2e/in.jsonl", "s3://corpus-test/e2e/out"
    )
    config["sharding"]["rows_per_shard"] = 4
    config["generation"]["sampling"]["max_new_tokens"] = 64
    result, flow_run_id = deployment_run(stack, config, tmp_path, watch_seconds=15)
    assert result.returncode == 124, result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("corpusgen: stopped watching after 15 s; flow run " + flow_run_id)
    assert f"`prefect flow-run cancel {flow_run_id}`" in last, last
    stack.check("prefect", "flow-run", "cancel", flow_run_id)
    with client(stack) as api:
        deadline = time.monotonic() + 120
        while not (cancelled := api.read_flow_run(flow_run_id)).state.is_final():
            assert time.monotonic() < deadline, cancelled.state
            time.sleep(1)
    assert cancelled.state.is_cancelled(), cancelled.state  # not Crashed
    root = "corpus-test/e2e/out"
    fs.invalidate_cache()
    planned = len(json.loads(fs.cat_file(fs.glob(f"{root}/plan/*/*/plan.json")[0]))["shards"])
    assert len(fs.glob(f"{root}/manifests/*.json")) < planned  # it stopped before the end

    result, rerun_id = deployment_run(stack, config, tmp_path)
    assert result.returncode == 0, flow_run_log_text(stack, rerun_id)
    fs.invalidate_cache()
    data = ds.dataset(f"{root}/data", filesystem=fs, partitioning="hive").to_table()
    assert sorted(data.column("id").to_pylist()) == sorted(row["id"] for row in rows)
    metrics = ds.dataset(f"{root}/metrics", filesystem=fs, partitioning="hive").to_table()
    shard_ids = metrics.column("shard_id").to_pylist()
    assert len(shard_ids) == len(set(shard_ids)) == planned
    assert len(fs.glob(f"{root}/manifests/*")) == planned  # each shard committed once
    assert set(data.column("shard_id").to_pylist()) == set(shard_ids)
    with client(stack) as api:
        shard_runs = [
            run
            for run in api.read_flow_runs(
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["default"]))
            )
            if run.parameters["config"]["output"] == config["output"]
        ]
        parent = api.read_flow_run(rerun_id)
    assert parent.state.is_completed()
    worker_of_run = wait_for_submitting_workers(stack, {str(run.id) for run in shard_runs})
    assert {worker_of_run[str(run.id)] for run in shard_runs} == {"e2e-card0", "e2e-card1"}
    for path in fs.find(root):
        content = fs.cat_file(path)
        assert ACCESS_KEY.encode() not in content and SECRET_KEY.encode() not in content
    assert SECRET_KEY not in json.dumps(parent.parameters)
    assert parse_run_config(parent.parameters["config"]).storage.endpoint_url
