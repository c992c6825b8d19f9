"""Chain steps: a run whose input is another run's committed output (`<output>/data`).

The step is pinned to one upstream run: `input.run_id`, else the newest complete run of that
output, chosen when the step is planned and written into its config, so it is part of the
step's run id. A new upstream run in the same output is a new step run (a new run id) that
reads only that upstream run's records; a committed step run never changes.

Shards are the upstream run's committed data files (their Parquet row groups), so a shard
re-read after a crash reads the same rows. A record's id is its upstream record's id
(`parent_id`) when every upstream record has sample_index 0, else `parent_id#sample_index`:
unique either way, and the same on every rerun.

What a template, prompt_field or filter may name: the upstream data columns (id, completion,
finish_reason, sample_index, ...), `prompt` (the upstream prompt before its chat template: the
text its input record made, a chat's last user message; upstream runs written before
`input_prompt` existed give the text sent), and the keys of an upstream structured completion
(a JSON object) where no column has that name. The upstream input record's own fields are
not carried by data rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import pyarrow.parquet as pq
from fsspec import AbstractFileSystem
from pydantic import ValidationError

from schemas.arrow import DATA_SCHEMA
from schemas.run import (
    RUN_OUTPUT,
    KeepFilter,
    RunConfig,
    format_validation_error,
    template_fields,
)
from tasks.planning import InputError, Shard, _fingerprint, _plan_parquet, display_uri
from tasks.records import BadRecord, Record, build_prompt, raw_items, record_seed, truncate

SAMPLE_ROWS = 64  # upstream rows read at plan time to find the keys of structured completions


@dataclass(frozen=True)
class UpstreamRun:
    run_id: str
    run_date: str
    planned: int  # shards in its plan
    data_files: tuple[str, ...]  # committed data files (full paths)
    rows: int  # committed data rows
    finished_at: str  # its last commit

    @property
    def complete(self) -> bool:
        return len(self.data_files) == self.planned


def upstream_root(uri: str) -> str:
    return uri.rstrip("/").removesuffix("/data")


def is_chained(config: RunConfig, fs: AbstractFileSystem | None = None) -> bool:
    """input.format run, or auto on a path `<output>/data` beside corpusgen's manifests/."""
    if config.input.format == RUN_OUTPUT:
        return True
    if config.input.format != "auto" or not config.input.uri.rstrip("/").endswith("/data"):
        return False
    from tasks.storage import filesystem

    fs, path = (fs, config.input.uri) if fs else filesystem(config.input.uri, config.storage)
    root = upstream_root(path)
    return fs.isdir(f"{root}/manifests") or fs.isdir(f"{root}/plan")


def upstream_runs(fs: AbstractFileSystem, root: str) -> list[UpstreamRun]:
    """Every run planned under `root`, oldest first (by its last commit)."""
    runs = []
    for plan_path in fs.glob(f"{root}/plan/run_date=*/run_id=*/plan.json"):
        run_date = plan_path.split("run_date=")[-1].split("/")[0]
        run_id = plan_path.split("run_id=")[-1].split("/")[0]
        planned = len(json.loads(fs.cat_file(plan_path))["shards"])
        manifests = fs.glob(f"{root}/manifests/{run_id}.*.json")
        contents = [json.loads(text) for text in fs.cat(manifests).values()] if manifests else []
        files = tuple(f"{root}/{m['files']['data'][0]}" for m in contents)
        rows = sum(m["rows"]["data"] for m in contents)
        finished = max((m["committed_at"] for m in contents), default="")
        runs.append(UpstreamRun(run_id, run_date, planned, tuple(sorted(files)), rows, finished))
    return sorted(runs, key=lambda run: (run.finished_at, run.run_id))


def resolve_upstream(config: RunConfig) -> tuple[UpstreamRun, list[UpstreamRun]]:
    """The upstream run this step reads, and every run of that output; InputError (exit 2)
    when there is none to read."""
    from tasks.storage import filesystem

    fs, path = filesystem(config.input.uri, config.storage)
    root = upstream_root(path)
    runs = upstream_runs(fs, root)
    where = display_uri(fs, path)
    complete = [run for run in runs if run.complete and run.rows]
    if config.input.run_id is not None:
        chosen = [run for run in runs if run.run_id == config.input.run_id]
        if not chosen:
            known = ", ".join(run.run_id for run in runs) or "none"
            raise InputError(f"input.run_id {config.input.run_id!r} is no run of {where} "
                             f"(runs there: {known})")
        if not chosen[0].complete:
            raise InputError(
                f"input.run_id {config.input.run_id!r} of {where} is not complete "
                f"({len(chosen[0].data_files)} of {chosen[0].planned} shards committed); "
                "finish that run first: a chain step reads a finished run"
            )
        return chosen[0], runs
    if not complete:
        raise InputError(
            f"input.uri {where!r} has no complete run with data rows to chain from "
            f"({len(runs)} run(s) there, none with every shard committed); run the upstream "
            "step first, or point input.uri at a run's <output>/data"
        )
    return complete[-1], runs


def pin_upstream(config: RunConfig) -> RunConfig:
    """A chain step's config with its upstream run fixed (input.format run, input.run_id):
    what the step's run id and every shard task see. Other configs are returned as they are."""
    if not is_chained(config):
        return config
    if config.input.format == RUN_OUTPUT and config.input.run_id is not None:
        return config
    upstream, _ = resolve_upstream(config)
    data = config.model_dump(mode="json")
    data["input"].update(format=RUN_OUTPUT, run_id=upstream.run_id)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise InputError(format_validation_error(error).replace("\n", " ")) from None


def plan_upstream(fs: AbstractFileSystem, config: RunConfig, root: str) -> list[Shard]:
    """The pinned upstream run's committed data files as shards (whole row groups)."""
    config = pin_upstream(config)
    upstream = next(run for run in upstream_runs(fs, root) if run.run_id == config.input.run_id)
    sample_ids = any(_multi_sample(fs, path) for path in upstream.data_files)
    shards = []
    for path in upstream.data_files:
        source = path[len(root) :].lstrip("/")
        planned = _plan_parquet(fs, path, source, _fingerprint(fs.info(path)),
                                config.sharding.rows_per_shard)
        shards += [replace(shard, format=RUN_OUTPUT, sample_ids=sample_ids)
                   for shard in planned if shard.estimated_rows]
    if not shards:
        raise InputError(f"upstream run {upstream.run_id} of {display_uri(fs, root)} has no "
                         "data rows; nothing to chain from")
    return shards


def _multi_sample(fs: AbstractFileSystem, path: str) -> bool:
    with fs.open(path, "rb") as file:
        column = pq.read_table(file, columns=["sample_index"]).column(0)
    return any(value for value in column.to_pylist())


def upstream_fields(row: dict[str, Any]) -> dict[str, Any]:
    """What a template, prompt_field or filter can name in an upstream data row."""
    fields: dict[str, Any] = {}
    try:
        parsed = json.loads(row.get("completion") or "")
    except (json.JSONDecodeError, TypeError):
        parsed = None
    if isinstance(parsed, dict):
        fields.update(parsed)
    fields.update(row)
    fields["prompt"] = _question(row.get("input_prompt")) or row.get("prompt")
    return fields


def _question(input_prompt: str | None) -> str | None:
    """A prompt as its input made it; a chat's (JSON messages): its last user message."""
    if not input_prompt or not input_prompt.startswith("[{"):
        return input_prompt
    try:
        chat = json.loads(input_prompt)
    except json.JSONDecodeError:
        return input_prompt
    users = [m.get("content") for m in chat if isinstance(m, dict) and m.get("role") == "user"]
    return users[-1] if users and isinstance(users[-1], str) else input_prompt


def read_upstream(
    fs: AbstractFileSystem, shard: Shard, config: RunConfig
) -> tuple[list[Record], list[BadRecord]]:
    """A shard of upstream data rows as records (prompt from input.template etc.)."""
    good: list[Record] = []
    bad: list[BadRecord] = []
    for row, (offset, raw, value) in enumerate(raw_items(fs, shard, config.input)):
        parent_id = str(value["id"])
        sample = value.get("sample_index") or 0
        record_id = f"{parent_id}#{sample}" if shard.sample_ids else parent_id
        fields = upstream_fields(value)
        try:
            prompt, text = build_prompt(fields, config.input)
        except ValueError as error:
            bad.append(BadRecord(row, offset, record_id, str(error), truncate(raw)))
            continue
        good.append(Record(row, offset, record_id, prompt, text,
                           record_seed(config.seed, record_id), parent_id=parent_id))
    return good, bad


def available_fields(fs: AbstractFileSystem, upstream: UpstreamRun) -> set[str]:
    """Upstream columns, and the keys of the structured completions among its first rows."""
    names = set(DATA_SCHEMA.names) | {"prompt"}
    if upstream.data_files:
        with fs.open(upstream.data_files[0], "rb") as file:
            table = pq.read_table(file, columns=["completion"]).slice(0, SAMPLE_ROWS)
        for row in table.to_pylist():
            names |= set(upstream_fields({"completion": row["completion"]})) - {"completion"}
    return names


def schema_properties(config: RunConfig) -> set[str] | None:
    """The keys this run's structured records have; None when it cannot tell (json_object)."""
    response_format = config.generation.response_format
    if response_format is None or response_format.type in ("regex", "choice"):
        return set()
    if response_format.type == "json_object":
        return None
    return set(response_format.json_schema.schema_.get("properties") or {})


def check_fields(config: RunConfig) -> list[str]:
    """Before a chain step (or a filtered run) runs: every name its template, prompt_field and
    filters use exists somewhere; InputError names the first that does not (exit 2). Returns
    the plan's lines about the upstream run (tasks/filtering.py describes the filters)."""
    from tasks.storage import filesystem

    lines: list[str] = []
    upstream_names: set[str] = set()
    if is_chained(config):
        chosen = "input.run_id" if config.input.run_id else "the newest complete run"
        config = pin_upstream(config)
        upstream, runs = resolve_upstream(config)
        fs, path = filesystem(config.input.uri, config.storage)
        upstream_names = available_fields(fs, upstream)
        lines.append(
            f"upstream: run {upstream.run_id} ({upstream.run_date}) of "
            f"{display_uri(fs, upstream_root(path))}, {upstream.rows} data rows in "
            f"{len(upstream.data_files)} file(s) ({chosen} of {len(runs)}; pinned: a newer "
            "upstream run means a new run id for this step, which reads only that run's "
            "records)"
        )
        spec = config.input
        used = template_fields(spec.template) if spec.template else [
            name for name in (spec.prompt_field, spec.messages_field) if name]
        for name in used:
            if name not in upstream_names:
                raise InputError(
                    f"input: {name!r} is no column of upstream run {upstream.run_id} (it has "
                    f"{', '.join(sorted(upstream_names))}); fix the template or field name"
                )
    structured = schema_properties(config)
    for index, rule in enumerate(config.filters):  # the filter step applies them (filtering.py)
        if not isinstance(rule, KeepFilter) or structured is None or (
                rule.field in structured or rule.field in upstream_names):
            continue
        raise InputError(
            f"filters[{index}].field {rule.field!r} exists nowhere: not in "
            f"generation.response_format's properties ({', '.join(sorted(structured)) or 'none'})"
            + (f" nor the upstream columns ({', '.join(sorted(upstream_names))})"
               if upstream_names else "") + "; fix the field name"
        )
    return lines
