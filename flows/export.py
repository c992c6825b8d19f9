"""`corpusgen export`: a finished run's committed rows in another tool's format."""

from __future__ import annotations

import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from schemas.run import StorageSpec
from tasks.batch_results import ExportError, batch_output, find_run, write_lines
from tasks.storage import filesystem


class ExportFormat(StrEnum):
    openai_batch = "openai-batch"


def export(
    output_uri: Annotated[
        str, typer.Argument(help="output root of the pipeline: a local path or s3://bucket/prefix")
    ],
    export_format: Annotated[ExportFormat, typer.Option("--format", help="what to write")],
    run: Annotated[
        str | None, typer.Option("--run", help="the run id; default: the output's only run")
    ] = None,
    errors: Annotated[
        Path, typer.Option("--errors", help="where the error file goes")
    ] = Path("errors.jsonl"),
    endpoint_url: Annotated[
        str | None,
        typer.Option(help="S3-compatible endpoint; keys from AWS_ACCESS_KEY_ID/_SECRET_ACCESS_KEY"),
    ] = None,
) -> None:
    """Write a finished openai_batch run as the Batch API's output file (stdout) and error file
    (--errors): one line per request, in input order."""
    fs, root = filesystem(output_uri, StorageSpec(endpoint_url=endpoint_url))
    try:
        output = batch_output(*find_run(fs, root, run))
        errors.parent.mkdir(parents=True, exist_ok=True)
        with errors.open("w") as error_file:
            write_lines(output.errors, error_file)
    except (ExportError, OSError) as error:
        typer.secho(f"error: {error}", err=True, fg="red")
        raise typer.Exit(2) from None
    write_lines(output.results, sys.stdout)
    completed, failed = len(output.results), len(output.errors)
    typer.echo(f"run {output.run_id}: {completed + failed} requests, {completed} completed "
               f"(stdout), {failed} failed ({errors})", err=True)
