"""The `corpusgen` command line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.table import Table

from schemas.run import ConfigError, RunConfig, parse_run_config
from tasks import console_output

# corpusgen runs offline: Prefect's telemetry has nowhere to go and would log an error per run.
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Prefect's 20 s default for its local server's start-up fails on a loaded 2-core host.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = console_output.console
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


def _generate(config: RunConfig) -> None:
    from flows.generate import generate_corpus
    from tasks.planning import list_input_files
    from tasks.storage import filesystem

    console_output.quiet_prefect_logs()
    try:
        list_input_files(*filesystem(config.input.uri, config.storage))  # before Prefect starts
        summary = console_output.run_with_progress(
            config, lambda: generate_corpus(config.model_dump(mode="json"))
        )
    except Exception as error:
        console_output.stop_info_logs()
        explained = console_output.explain(error, config)
        if explained is None:
            raise
        raise _fail(*explained) from None
    console_output.stop_info_logs()
    console_output.print_summary(summary)


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
