"""What `corpusgen run` prints: a progress bar over committed manifests, the run's summary, and
one line (not a traceback) for each error a user can fix, as the run's last line."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from schemas.run import RunConfig

console = Console()


def watch_progress(config: RunConfig, stop: threading.Event) -> None:
    """Count committed manifests (works whatever process commits them) into a progress bar."""
    from tasks.commit import committed_shard_ids
    from tasks.planning import Plan
    from tasks.shard import run_layout

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
    from tasks.run_summary import summary_figures

    table = Table(title=f"run {summary['run_id']}", show_header=False)
    for name, value in summary_figures(summary):
        table.add_row(name, value)
    console.print(table)
    if summary["stopped_on_budget"]:
        console.print(f"[yellow]Stopped on budget: {summary['shards_not_scheduled']} shard(s) "
                      "not scheduled; committed shards are kept.[/yellow]")
    console.print(
        f"Generated records: {summary['data']}\nError rows:        {summary['errors']}\n"
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
    """(one line, exit status) for the errors a user can fix; None for anything else (a bug)."""
    from tasks.failures import RunFailed
    from tasks.planning import InputError
    from tasks.storage import credentials_problem

    if isinstance(error, InputError):
        return str(error), 2
    if isinstance(error, RunFailed):  # it names the shards and their causes (or bad quality)
        return str(error), 1
    uris = (config.input.uri, config.output)
    if (problem := credentials_problem(error, config.storage, uris)) is not None:
        return problem, 2
    if "ephemeral Prefect API server" in str(error):
        return (
            "Prefect's local server did not start within "
            f"{os.environ['PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS']} s ("
            f"{str(error).splitlines()[0][:200]}); raise "
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS or set PREFECT_API_URL to a "
            "running server (`prefect server start`)", 1
        )
    return None
