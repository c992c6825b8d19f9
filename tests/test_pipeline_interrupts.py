"""An operator's Ctrl-C or a SIGTERM: the CLI stops scheduling shards at once, lets in-flight
shards abandon their attempt, exits 130 / 143 within seconds with one line saying what was
kept, and a rerun finishes the run with every record exactly once. The CLI runs as an operator
runs it: its own local Prefect server, the signal sent to its whole process group the way a
terminal sends Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest
import yaml
from pipeline_fixtures import good_rows, run_config, tiny_engine, write_jsonl

SHARDS = 8
CORPUSGEN = str(Path(sys.executable).with_name("corpusgen"))


def manifests(root: Path) -> dict[str, str]:
    return {p.name: json.loads(p.read_text())["attempt_id"] for p in root.glob("manifests/*.json")}


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    """The CLI in a session of its own (as a shell runs a foreground job), without a
    PREFECT_API_URL: it starts its own Prefect server, as on an operator's machine."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return subprocess.Popen([CORPUSGEN, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_commit(process: subprocess.Popen, root: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not manifests(root):
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, "no shard committed in time"
        time.sleep(0.05)


def slow_config(tmp_path: Path, model_dir: Path) -> Path:
    """Shards that each take a while on the tiny model: 6 rows x 48 tokens, batch 1."""
    write_jsonl(tmp_path / "in.jsonl", good_rows(SHARDS * 6))
    engine = tiny_engine(model_dir)
    engine["bucket_grid"]["batch_sizes"] = [1]
    config = run_config(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), engine,
                        sharding={"rows_per_shard": 6})
    config["generation"]["sampling"]["max_new_tokens"] = 48
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def assert_exactly_once(root: Path, rows: int) -> None:
    ids = ds.dataset(root / "data", partitioning="hive").to_table().column("id").to_pylist()
    assert len(ids) == len(set(ids)) == rows


@pytest.mark.slow
def test_ctrl_c_stops_a_run_in_seconds_and_a_rerun_finishes_it(tmp_path, tiny_llama_dir):
    config = slow_config(tmp_path, tiny_llama_dir)
    root = tmp_path / "out"
    process = start(["run", str(config)], tmp_path)
    wait_for_commit(process, root)
    os.killpg(process.pid, signal.SIGINT)  # the whole foreground group, as a terminal does
    signalled = time.monotonic()
    output = process.communicate(timeout=60)[0]
    took = time.monotonic() - signalled
    assert process.returncode == 130, output
    assert took < 20, f"exit took {took:.1f} s after the signal:\n{output}"
    assert "Traceback" not in output and "ConnectError" not in output, output
    last = output.strip().splitlines()[-1]
    committed = manifests(root)
    assert f"stopped on SIGINT: {len(committed)} of {SHARDS} shards" in last, output
    assert "Rerun the same config to resume" in last
    assert 0 < len(committed) < SHARDS, output
    time.sleep(1)
    assert manifests(root) == committed  # nothing commits after the exit

    rerun = start(["run", str(config)], tmp_path)
    output = rerun.communicate(timeout=300)[0]
    assert rerun.returncode == 0, output
    after = manifests(root)
    assert len(after) == SHARDS and {k: after[k] for k in committed} == committed
    assert_exactly_once(root, SHARDS * 6)


@pytest.mark.slow
def test_the_demo_stops_on_sigterm_the_same_way(tmp_path, smollm2_spec):
    """The demo (packaged SmolLM2) mid-shard gets SIGTERM: exit 143 within seconds, one line
    saying what is kept, nothing committed after the exit."""
    process = start(["demo", "--output", str(tmp_path / "demo")], tmp_path)
    wait_for_commit(process, tmp_path / "demo", timeout=400)
    os.killpg(process.pid, signal.SIGTERM)
    signalled = time.monotonic()
    output = process.communicate(timeout=60)[0]
    assert process.returncode == 143, output
    assert time.monotonic() - signalled < 20, output
    assert "Traceback" not in output, output
    at_exit = manifests(tmp_path / "demo")
    assert f"stopped on SIGTERM: {len(at_exit)} of 3 shards" in output.strip().splitlines()[-1]
    time.sleep(1)
    assert manifests(tmp_path / "demo") == at_exit  # nothing commits after the exit


def test_a_second_stop_signal_quits_at_once_with_the_first_ones_status(monkeypatch):
    """The first signal only asks for an orderly stop; the second stops the local Prefect
    server and leaves at once, with 128 + the first signal's number."""
    from flows.console import StopOnSignals
    from tasks import stopping

    stopped, exits = [], []
    monkeypatch.setattr(os, "_exit", exits.append)
    stopping.reset()
    try:
        with StopOnSignals() as signals:
            signals.server = type("Server", (), {"stop": lambda self: stopped.append(True)})()
            signals._handle(signal.SIGTERM, None)
            assert stopping.stop_requested() and not exits and not stopped
            signals._handle(signal.SIGINT, None)
        assert exits == [128 + signal.SIGTERM] and stopped == [True]
    finally:
        stopping.reset()
