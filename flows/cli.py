"""The `corpusgen` command line."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from schemas.run import ConfigError, RunConfig, parse_run_config

# corpusgen runs offline: Prefect's telemetry has nowhere to go and would log an error per run.
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Prefect's 20 s default for its local server's start-up fails on a loaded 2-core host.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console()
DEMO_DIR = Path(__file__).resolve().parent / "demo"

ConfigArg = Annotated[Path, typer.Argument(help="run config, YAML or JSON")]
SetOption = Annotated[
    list[str], typer.Option("--set", help="override a field: a.b=value (repeatable)")
]


@app.callback()
def _commands() -> None:
    """Keeps `corpusgen <command>` a command group even while only one command is registered."""


def _fail(error: Exception | str, status: int = 2) -> typer.Exit:
    """Print an error the user can fix as one unwrapped line (paths stay greppable) and exit
    with `status` (2: bad config or input, 1: the run failed)."""
    console.print(str(error), style="red", soft_wrap=True, markup=False)
    return typer.Exit(status)


def _load(source: Path | dict[str, Any], overrides: list[str]) -> RunConfig:
    try:
        return parse_run_config(source, overrides)
    except ConfigError as error:
        raise _fail(error) from None


def _watch_progress(config: RunConfig, stop: threading.Event) -> None:
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


def _run_with_progress(config: RunConfig, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_progress, args=(config, stop), daemon=True)
    watcher.start()
    try:
        return run()
    finally:
        stop.set()
        watcher.join()


def _print_summary(summary: dict[str, Any]) -> None:
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
        from tasks.quality import QualityError

        handled = EngineLoadError | RunFailed | QualityError
        if record.exc_info and isinstance(record.exc_info[1], handled):
            record.exc_info, record.exc_text = None, None
        return True


def _quiet_prefect_logs() -> None:
    logging.getLogger("prefect.task_runs").addFilter(_DropThreadTimeoutNotice())
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logging.getLogger(name).addFilter(_OneLineForHandledErrors())


def _stop_info_logs() -> None:
    """After the run, Prefect's exit notices ("Stopping temporary server") would come after our
    verdict: the verdict stays the last line."""
    logging.getLogger("prefect").setLevel(logging.WARNING)


def _explain(error: Exception, config: RunConfig) -> tuple[str, int] | None:
    """(one line, exit status) for the errors a user can fix; None for anything else (a bug)."""
    from tasks.failures import RunFailed
    from tasks.planning import InputError
    from tasks.quality import QualityError
    from tasks.storage import credentials_problem

    if isinstance(error, InputError):
        return str(error), 2
    if (problem := credentials_problem(error, config.storage)) is not None:
        return problem, 2
    if isinstance(error, RunFailed | QualityError):  # QualityError: committed, but a bad corpus
        return str(error), 1
    if "ephemeral Prefect API server" in str(error):
        return (
            "Prefect's local server did not start within "
            f"{os.environ['PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS']} s ("
            f"{str(error).splitlines()[0][:200]}); raise "
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS or set PREFECT_API_URL to a "
            "running server (`prefect server start`)", 1
        )
    return None


def _generate(config: RunConfig) -> None:
    from flows.generate import generate_corpus
    from tasks.planning import list_input_files
    from tasks.storage import filesystem

    _quiet_prefect_logs()
    try:
        list_input_files(*filesystem(config.input.uri, config.storage))  # before Prefect starts
        summary = _run_with_progress(
            config, lambda: generate_corpus(config.model_dump(mode="json"))
        )
    except Exception as error:
        _stop_info_logs()
        explained = _explain(error, config)
        if explained is None:
            raise
        raise _fail(*explained) from None
    _stop_info_logs()
    _print_summary(summary)


@app.command()
def run(config: ConfigArg, set_: SetOption = None) -> None:
    """Generate a corpus: plan, run every shard once, summarise."""
    _generate(_load(config, set_ or []))


@app.command()
def plan(config: ConfigArg, set_: SetOption = None) -> None:
    """Print the shard plan (shards, estimated rows, buckets) without generating or writing."""
    from tasks.planning import InputError, plan_shards
    from tasks.storage import filesystem

    run_config = _load(config, set_ or [])
    input_fs, input_path = filesystem(run_config.input.uri, run_config.storage)
    try:
        shards = plan_shards(input_fs, run_config, input_path)
    except InputError as error:
        raise _fail(error) from None
    grid = run_config.generation.engine.bucket_grid
    table = Table(title=f"run {run_config.resolved_run_id()}: {len(shards)} shards")
    for column in ("shard_id", "source", "format", "range", "est. rows", "batches"):
        table.add_column(column)
    for shard in shards:
        batches = -(-shard.estimated_rows // grid.max_batch)
        table.add_row(shard.shard_id, shard.source, shard.format, f"{shard.start}-{shard.end}",
                      str(shard.estimated_rows), str(batches))
    console.print(table)
    console.print(
        f"estimated rows: {sum(s.estimated_rows for s in shards)}; buckets: batch "
        f"{grid.batch_sizes}, prompt {grid.prompt_lengths}, cache {grid.cache_lengths}, "
        f"draft K {grid.draft_lengths}; output: {run_config.output}"
    )
    _print_estimate(run_config, shards)


def _print_estimate(config: RunConfig, shards: list) -> None:
    """Rows, prompt tokens and expected cost from the tokenizer and earlier runs' metrics."""
    from generation.loading import load_spec_tokenizer
    from tasks.estimate import estimate_lines, estimate_run

    try:
        tokenizer = load_spec_tokenizer(config.generation.engine.target)
    except (OSError, ValueError) as error:
        console.print(f"no estimates: cannot load the target's tokenizer ({error})",
                      style="yellow", soft_wrap=True, markup=False)
        return
    for line in estimate_lines(estimate_run(config, shards, tokenizer)):
        console.print(line, soft_wrap=True, markup=False)


@app.command()
def demo(
    output: Annotated[Path, typer.Option(help="where outputs go")] = Path("out/demo"),
    set_: SetOption = None,
) -> None:
    """Generate from the shipped demo prompts with the packaged SmolLM2 on this machine."""
    raw = yaml.safe_load((DEMO_DIR / "config.yaml").read_text())
    raw["input"]["uri"] = str(DEMO_DIR / raw["input"]["uri"])
    raw["output"] = str(output.resolve())
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    _generate(_load(raw, set_ or []))

from flows.report import report  # noqa: E402

app.command()(report)
