"""The `corpusgen` command line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.table import Table

from flows import console as cli_console
from schemas.run import OPENAI_BATCH, ConfigError, RunConfig, parse_run_config

# corpusgen runs offline: Prefect's telemetry has nowhere to go and would log an error per run.
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Prefect's default start-up wait for its local server is too short for a busy small host.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = cli_console.console
DEMO_DIR = Path(__file__).resolve().parent / "demo"

ConfigArg = Annotated[Path, typer.Argument(help="run config, YAML or JSON")]
SetOption = Annotated[
    list[str], typer.Option("--set", help="override a field: a.b=value (repeatable)")
]


@app.callback()
def _commands(
    debug: Annotated[
        bool, typer.Option("--debug", help="print full tracebacks instead of one-line errors")
    ] = False,
) -> None:
    """Generate synthetic corpora with a static-shape speculative-decoding engine."""
    cli_console.DEBUG[0] = debug


def _fail(error: Exception | str, status: int = 2) -> typer.Exit:
    """Print an error the user can fix as one unwrapped line (paths stay greppable) and exit
    with `status` (2: bad config or input, 1: the run failed, 128 + n: stopped by signal n)."""
    console.print(str(error), style="red", soft_wrap=True, markup=False)
    return typer.Exit(status)


def _load(source: Path | dict[str, Any], overrides: list[str], pin: bool = True) -> RunConfig:
    """The config, a chain step's pinned to its upstream run; exit 2 saying what is wrong."""
    from tasks.chains import pin_upstream
    from tasks.planning import InputError

    try:
        config = parse_run_config(source, overrides)
        return pin_upstream(config) if pin else config
    except (ConfigError, InputError) as error:
        raise _fail(error) from None


def _generate(config: RunConfig) -> None:
    """Run the generate-corpus flow in a thread: the main thread stays free for the signal
    handlers that turn Ctrl-C / SIGTERM into an orderly stop (Prefect installs its own only
    on the main thread)."""
    from flows.generate import generate_corpus
    from flows.local_server import ServerFailed, prefect_api
    from tasks import stopping
    from tasks.planning import check_paths

    cli_console.quiet_prefect_logs()
    stopping.reset()
    try:
        check_paths(config)  # a path the operator must fix: one line, before Prefect starts
        with cli_console.StopOnSignals() as signals, prefect_api() as server:
            signals.server = server
            summary = cli_console.run_with_progress(
                config,
                lambda: cli_console.in_thread(generate_corpus, config.model_dump(mode="json")),
            )
    except Exception as error:
        cli_console.stop_info_logs()
        explained = (str(error), 1) if isinstance(error, ServerFailed) else (
            cli_console.explain(error, config)
        )
        if explained is None or cli_console.DEBUG[0]:
            raise
        raise _fail(*explained) from None
    cli_console.stop_info_logs()
    cli_console.print_summary(summary)


@app.command()
def run(config: ConfigArg, set_: SetOption = None) -> None:
    """Generate a corpus: plan, run every shard once, summarise."""
    _generate(_load(config, set_ or []))


@app.command()
def plan(config: ConfigArg, set_: SetOption = None) -> None:
    """Print the shard plan (shards, estimated rows, buckets) and what is left to generate,
    without generating or writing."""
    from tasks.batch_requests import group_labels, plan_lines
    from tasks.chains import check_fields, pin_upstream
    from tasks.commit import committed_shard_ids
    from tasks.duplicates import with_duplicates
    from tasks.filtering import describe_filters
    from tasks.layout import run_layout
    from tasks.planning import InputError, plan_shards
    from tasks.storage import filesystem

    run_config = _load(config, set_ or [], pin=False)
    input_fs, input_path = filesystem(run_config.input.uri, run_config.storage)
    try:
        chain_lines = check_fields(run_config)  # says how the upstream run was chosen
        run_config = pin_upstream(run_config)
        shards = with_duplicates(input_fs, plan_shards(input_fs, run_config, input_path),
                                 run_config.input)
    except InputError as error:
        raise _fail(error) from None
    grid = run_config.generation.engine.bucket_grid
    layout = run_layout(run_config)
    committed = committed_shard_ids(layout)
    run_id = run_config.resolved_run_id()
    table = Table(title=f"run {run_id}: {len(shards)} shards")
    batch_file = run_config.input.format == OPENAI_BATCH
    labels = group_labels(shards) if batch_file else {}
    for column in ("shard_id", "source", "format", "range", "est. rows", "batches", "state",
                   *(["group"] if batch_file else [])):
        table.add_column(column)
    for shard in shards:
        batches = -(-shard.estimated_rows // grid.max_batch)
        state = "committed" if shard.shard_id in committed else "to generate"
        table.add_row(shard.shard_id, shard.source, shard.format, f"{shard.start}-{shard.end}",
                      str(shard.estimated_rows), str(batches), state,
                      *([labels[shard.group]] if batch_file else []))
    console.print(table)
    console.print(
        f"estimated rows: {sum(s.estimated_rows for s in shards)}; buckets: batch "
        f"{grid.batch_sizes}, prompt {grid.prompt_lengths}, cache {grid.cache_lengths}, "
        f"draft K {grid.draft_lengths}; output: {run_config.output}"
    )
    for line in chain_lines:  # the upstream run
        console.print(line, soft_wrap=True, markup=False)
    duplicates = sum(len(shard.duplicates) for shard in shards)
    if batch_file:  # duplicates included
        for line in plan_lines(input_fs, shards, run_config):
            console.print(line, soft_wrap=True, markup=False)
    elif duplicates:
        console.print(f"duplicate ids: {duplicates} later copies will be error rows "
                      "(duplicate_id), each naming where its id was first used")
    for line in describe_filters(run_config, layout) if run_config.filters else ():
        console.print(line, soft_wrap=True, markup=False)
    left = [shard for shard in shards if shard.shard_id not in committed]
    if not left:
        console.print(f"run {run_id} is complete: all {len(shards)} shards are committed; "
                      "0 rows left to generate, $0")
        return
    if committed:
        console.print(f"{len(shards) - len(left)} of {len(shards)} shards already committed; "
                      f"the estimates below cover the {len(left)} left")
    _print_estimate(run_config, left)


def _print_estimate(config: RunConfig, shards: list) -> None:
    """Rows, prompt tokens and expected cost from the tokenizer and earlier runs' metrics."""
    from generation.loading import load_spec_tokenizer
    from reporting.estimate import estimate_lines, estimate_run, history
    from reporting.metrics import NoMetricsError, open_committed_metrics
    from tasks.prompting import count_prompts
    from tasks.storage import filesystem

    try:
        tokenizer = load_spec_tokenizer(config.generation.engine.target)
    except (OSError, ValueError) as error:
        console.print(f"no estimates: cannot load the target's tokenizer ({error})",
                      style="yellow", soft_wrap=True, markup=False)
        return
    try:
        output_fs, _ = filesystem(config.output, config.storage)
        past = history(open_committed_metrics(config.output, output_fs), config)
    except NoMetricsError:
        past = None
    prompts = count_prompts(config, shards, tokenizer)
    for line in estimate_lines(estimate_run(config, len(shards), prompts, past), config):
        console.print(line, soft_wrap=True, markup=False)


DEMO_EXAMPLES = {"chat": "config.yaml", "qa-records": "qa-records.yaml", "judge": "judge.yaml"}
CHAINS = {"judge": "chat"}  # a chain step's demo runs the upstream example first


@app.command()
def demo(
    output: Annotated[Path, typer.Option(help="where outputs go")] = Path("out/demo"),
    example: Annotated[
        str, typer.Option(help="chat: free-text answers; qa-records: JSON records under a "
                          "schema; judge: chat's answers, then SmolLM2 scores them, keeps >= 3")
    ] = "chat",
    set_: SetOption = None,
) -> None:
    """Generate from the shipped demo prompts with the packaged SmolLM2 on this machine."""
    if example not in DEMO_EXAMPLES:
        raise typer.BadParameter(f"--example must be one of {', '.join(DEMO_EXAMPLES)}")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    raw = yaml.safe_load((DEMO_DIR / DEMO_EXAMPLES[example]).read_text())
    if example in CHAINS:  # step 1 into OUTPUT/generate, this step into OUTPUT/<example>
        upstream = output / "generate"
        demo(upstream, CHAINS[example], [])
        raw["input"]["uri"] = str(upstream.resolve() / "data")
        output = output / example
    else:
        raw["input"]["uri"] = str(DEMO_DIR / raw["input"]["uri"])
    raw["output"] = str(output.resolve())
    _generate(_load(raw, set_ or []))

from flows.export import export  # noqa: E402
from flows.report import report  # noqa: E402

app.command()(report)
app.command()(export)
