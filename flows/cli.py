"""The `corpusgen` command line."""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)


@app.callback()
def _commands() -> None:
    """Keeps `corpusgen <command>` a command group even while only one command is registered."""

from flows.report import report  # noqa: E402

app.command()(report)
