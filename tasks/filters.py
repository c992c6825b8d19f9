"""`filters:` rules, applied to each generated record before its shard commits. A record a
rule drops goes to `filtered/` with the rule and the reason (the value it saw), never away.

A rule's field is looked up in this run's parsed structured record first (the completion, a
JSON object), then in the upstream record (a chain step: its columns and structured fields).
A record without the field, or with a value the rule cannot compare (text against a number),
is dropped with that reason: a rule never passes a record it could not judge.
"""

from __future__ import annotations

import json
import operator
from typing import Any

from schemas.run import KeepFilter

MISSING = object()
OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt,
       "==": operator.eq, "!=": operator.ne}


def _value(field: str, completion: str, upstream: dict[str, Any] | None) -> Any:
    try:
        parsed = json.loads(completion)
    except json.JSONDecodeError:
        parsed = None
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


def dropped_by(
    rules: list[KeepFilter], completion: str, upstream: dict[str, Any] | None
) -> tuple[KeepFilter, str] | None:
    """The first rule that drops this record and why, or None when every rule keeps it."""
    for rule in rules:
        found = _value(rule.field, completion, upstream)
        if found is MISSING:
            return rule, f"missing: the record has no field {rule.field!r}"
        if not _comparable(found, rule.value):
            return rule, (f"type: {rule.field} is {type(found).__name__} {found!r}, the rule "
                          f"compares with {type(rule.value).__name__}")
        if not OPS[rule.op](found, rule.value):
            return rule, f"{rule.field} is {json.dumps(found)}, not {rule.op} " \
                         f"{json.dumps(rule.value)}"
    return None


def rule_json(rule: KeepFilter) -> str:
    return json.dumps(rule.model_dump(mode="json"), sort_keys=True)
