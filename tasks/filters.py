"""Keep rules (`filters: [{kind: keep, field, op, value}]`), as the run's filter step
(filtering.py) applies them: a record whose comparison fails goes to `filtered/` with the rule
and the reason (the value it saw), never away.

A rule's field is looked up in this run's parsed structured record first (the completion, a
JSON object), then in the upstream record (a chain step: its columns and structured fields,
tasks/chains.py upstream_fields). A record without the field, or with a value the rule cannot
compare (text against a number), is dropped with that reason: a rule never passes a record it
could not judge.
"""

from __future__ import annotations

import json
import operator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from schemas.run import KeepFilter, RunConfig

MISSING = object()
OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt,
       "==": operator.eq, "!=": operator.ne}


def _value(field: str, parsed: Any, upstream: dict[str, Any] | None) -> Any:
    if isinstance(parsed, dict) and field in parsed:
        return parsed[field]
    if upstream is not None and field in upstream:
        return upstream[field]
    return MISSING


def _comparable(found: Any, wanted: Any) -> bool:
    number = (int, float)
    if isinstance(found, bool) or isinstance(wanted, bool):
        return isinstance(found, bool) and isinstance(wanted, bool)
    return (isinstance(found, number) and isinstance(wanted, number)) or (
        isinstance(found, str) and isinstance(wanted, str))


def drop_reason(rule: KeepFilter, parsed: Any, upstream: dict[str, Any] | None) -> str | None:
    """Why the rule drops this record (`parsed`: its completion as JSON, else None), or None
    when it keeps it."""
    found = _value(rule.field, parsed, upstream)
    if found is MISSING:
        return f"missing: the record has no field {rule.field!r}"
    if not _comparable(found, rule.value):
        return (f"type: {rule.field} is {type(found).__name__} {found!r}, the rule "
                f"compares with {type(rule.value).__name__}")
    if not OPS[rule.op](found, rule.value):
        return f"{rule.field} is {json.dumps(found)}, not {rule.op} {json.dumps(rule.value)}"
    return None


def parse(completion: str | None) -> Any:
    try:
        return json.loads(completion or "")
    except json.JSONDecodeError:
        return None


def upstream_of(config: RunConfig, records: pa.Table) -> list[dict[str, Any] | None]:
    """Each record's upstream fields (a chain step, by parent_id and the upstream
    sample_index its id carries); None for all when the run is no chain step."""
    from tasks.chains import is_chained, upstream_fields, upstream_root, upstream_runs
    from tasks.storage import filesystem

    if not is_chained(config) or "parent_id" not in records.column_names:
        return [None] * records.num_rows
    fs, path = filesystem(config.input.uri, config.storage)
    root = upstream_root(path)
    upstream = next(run for run in upstream_runs(fs, root) if run.run_id == config.input.run_id)
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for file_path in upstream.data_files:
        with fs.open(file_path, "rb") as file:
            for row in pq.read_table(file).to_pylist():
                rows[(str(row["id"]), row.get("sample_index") or 0)] = row
    found = []
    for record_id, parent_id in zip(records["id"].to_pylist(), records["parent_id"].to_pylist(),
                                    strict=True):
        if parent_id is None:
            found.append(None)
            continue
        sample = int(record_id[len(parent_id) + 1 :]) if record_id != parent_id else 0
        row = rows.get((parent_id, sample))
        found.append(upstream_fields(row) if row is not None else None)
    return found


def rule_json(rule) -> str:
    """A rule as filtered/'s filter_rule holds it."""
    return json.dumps(rule.model_dump(mode="json"), sort_keys=True)
