"""The `corpusgen` command line."""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
