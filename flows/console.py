"""What `corpusgen run` prints: a progress bar over committed manifests, the run's summary, and
one line (not a traceback) for each error a user can fix, as the run's last line."""

from __future__ import annotations

import contextvars
import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from schemas.run import RunConfig

console = Console()
DEBUG = [False]  # `corpusgen --debug`: tracebacks instead of one-line errors


def in_thread(function: Callable[..., Any], *args: Any) -> Any:
    """function(*args) in a thread with this context (Prefect's settings), while the main
    thread waits in short joins, so signal handlers run at once."""
    outcome: dict[str, Any] = {}
    context = contextvars.copy_context()

    def target() -> None:
        try:
            outcome["value"] = context.run(function, *args)
        except BaseException as error:  # handed to the caller, raised there
            outcome["error"] = error

    thread = threading.Thread(target=target, name="corpusgen-run", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class StopOnSignals:
    """First SIGINT / SIGTERM: no new shard starts, in-flight shards abandon their attempt at
    their next step, and the run ends Cancelled. A second one quits at once, stopping the local
    Prefect server first (it runs in its own session). Installed around the server's whole
    life, its shutdown included, so a second signal never meets Python's default handler."""

    def __init__(self) -> None:
        self.server: Any = None  # the local Prefect server, once started
        self._previous: dict = {}

    def _handle(self, signum: int, _frame: Any) -> None:
        from tasks import stopping

        name = signal.Signals(signum).name
        if stopping.stop_requested():
            console.print(f"{name}, a second stop signal: quitting now; shards in flight commit "
                          "nothing, and a rerun of the same config resumes", style="red",
                          markup=False)
            if self.server is not None:
                self.server.stop()
            os._exit(128 + (stopping.stop_signal() or signum))
        stopping.request_stop(signum)
        console.print(f"{name}: stopping; no new shard starts and shards in flight stop at their "
                      "next step (send it again to quit at once)", style="yellow", markup=False)

    def __enter__(self) -> StopOnSignals:
        self._previous = {sig: signal.signal(sig, self._handle)
                          for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def watch_progress(config: RunConfig, stop: threading.Event) -> None:
    """Count committed manifests (works whatever process commits them) into a progress bar."""
    from tasks.commit import committed_shard_ids
    from tasks.layout import run_layout
    from tasks.planning import Plan

    columns = (TextColumn("shards"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("shards", total=None)
        while not stop.wait(0.5):
            layout = run_layout(config)
            if layout.fs.exists(layout.plan_path):
                total = len(Plan.from_json(layout.fs.cat_file(layout.plan_path).decode()).shards)
                bar.update(task, total=total, completed=len(committed_shard_ids(layout)))
        layout = run_layout(config)
        bar.update(task, completed=len(committed_shard_ids(layout)))


def run_with_progress(config: RunConfig, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    stop = threading.Event()
    watcher = threading.Thread(target=watch_progress, args=(config, stop), daemon=True)
    watcher.start()
    try:
        return run()
    finally:
        stop.set()
        watcher.join()


def print_summary(summary: dict[str, Any]) -> None:
    from reporting.summary import summary_figures

    table = Table(title=f"run {summary['run_id']}", show_header=False)
    for name, value in summary_figures(summary):
        table.add_row(name, value)
    console.print(table)
    if summary["stopped_on_budget"]:
        console.print(f"[yellow]Stopped on budget: {summary['shards_not_scheduled']} shard(s) "
                      "not scheduled; committed shards are kept.[/yellow]")
    records = (f"Kept records:      {summary['data']} ({summary['kept_rows']:,} kept)\n"
               f"Filtered records:  {summary['filtered']} ({summary['filtered_rows']:,} dropped "
               "by filters)" if "filtered" in summary else f"Generated records: {summary['data']}")
    console.print(
        f"{records}\nError rows:        {summary['errors']}\n"
        f"Metrics:           {summary['metrics']}\n"
        f"Cost report:       corpusgen report {summary['output']}",
        soft_wrap=True,
    )


class _DropThreadTimeoutNotice(logging.Filter):
    """Prefect warns on every shard that a timeout can't interrupt a task in a worker thread
    (it applies once the blocking call returns, as documented); the notice would bury the bar."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout of ")


class _OneLineForHandledErrors(logging.Filter):
    """Errors we explain ourselves (a shard's cause, the run's verdict) log their message, not a
    traceback: the CLI's last line says what failed and what to do."""

    def filter(self, record: logging.LogRecord) -> bool:
        from tasks.failures import EngineLoadError, RunFailed

        if record.exc_info and isinstance(record.exc_info[1], EngineLoadError | RunFailed):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_prefect_logs() -> None:
    logging.getLogger("prefect.task_runs").addFilter(_DropThreadTimeoutNotice())
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logging.getLogger(name).addFilter(_OneLineForHandledErrors())


def stop_info_logs() -> None:
    """After the run, Prefect's exit notices ("Stopping temporary server") would come after our
    verdict: the verdict stays the last line."""
    logging.getLogger("prefect").setLevel(logging.WARNING)


def explain(error: Exception, config: RunConfig) -> tuple[str, int] | None:
    """(one line, exit status) for the errors a user can fix; None for anything else (a bug).
    A run stopped by a signal exits 128 + its number (130 for Ctrl-C, 143 for SIGTERM)."""
    from prefect.exceptions import CancelledRun

    from tasks import stopping
    from tasks.failures import RunFailed
    from tasks.planning import InputError
    from tasks.storage import credentials_problem

    if isinstance(error, CancelledRun) and stopping.stop_signal() is not None:
        return str(error), 128 + stopping.stop_signal()
    if isinstance(error, InputError):
        return str(error), 2
    if isinstance(error, RunFailed):  # it names the shards and their causes (or bad quality)
        return str(error), 1
    uris = (config.input.uri, config.output)
    if (problem := credentials_problem(error, config.storage, uris)) is not None:
        return problem, 2
    return None
