"""The configuration and metrics references, written from the schemas themselves: the README's
config table and docs/metrics.md are this module's output (`make docs` rewrites them, and a
test fails when they drift), so a field is documented once, where it is defined."""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from schemas.arrow import DATA_SCHEMA, ERRORS_SCHEMA, FILTERED_SCHEMA, METRICS_SCHEMA
from schemas.run import RunConfig

CONFIG_START, CONFIG_END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (`X | None`, `list[X]`, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found = []
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def _type_name(annotation) -> str:
    if typing.get_origin(annotation) is typing.Annotated:  # a discriminated union of sections
        return _type_name(typing.get_args(annotation)[0])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(json.dumps(value) for value in typing.get_args(annotation))
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return " \\| ".join(dict.fromkeys(_type_name(arg) for arg in typing.get_args(annotation)))
    if typing.get_origin(annotation) is list:
        return f"list[{', '.join(_type_name(a) for a in typing.get_args(annotation))}]"
    return getattr(annotation, "__name__", str(annotation)).replace("NoneType", "null")


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "see below" if value.model_dump() else ""
    return f"`{json.dumps(value)}`"


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows, nested = [], []
    for name, field in model.model_fields.items():
        if name == "kind" and prefix.endswith("]."):  # the path names it: filters[kind=keep].
            continue
        path = f"{prefix}{name}"
        doc = field.description or next(
            (sub.__doc__.strip().split("\n\n")[0] for sub in _models_in(field.annotation)
             if sub.__doc__), ""
        )
        doc = " ".join(doc.split())
        rows.append(f"| `{path}` | {_type_name(field.annotation)} | {_default(field)} | {doc} |")
        subs = _models_in(field.annotation)
        nested += [(path if len(subs) == 1 else  # one of several kinds: say which
                    f"{path}[kind={sub.model_fields['kind'].annotation.__args__[0]}]", sub)
                   for sub in subs]
    for path, sub in nested:
        rows += _rows(sub, f"{path}.")
    return rows


def config_reference() -> str:
    """Every RunConfig field, nested sections dotted as `--set` spells them."""
    header = ["| field | type | default | meaning |", "|---|---|---|---|"]
    return "\n".join(header + _rows(RunConfig, ""))


def metrics_reference() -> str:
    """docs/metrics.md: every column of the datasets a run writes, with its doc."""
    parts = ["# Datasets and their columns",
             "",
             "Generated from `schemas/arrow.py` by `make docs`; a test fails when this file "
             "drifts from the schemas. Columns are only ever added at the end.",
             ""]
    for title, schema in (("data/ (and generated/, in a run with filters)", DATA_SCHEMA),
                          ("filtered/ (records a run's filters dropped)", FILTERED_SCHEMA),
                          ("errors/", ERRORS_SCHEMA),
                          ("metrics/ (one row per committed shard)", METRICS_SCHEMA)):
        parts += [f"## {title}", "", "| column | type | meaning |", "|---|---|---|"]
        if schema is FILTERED_SCHEMA:  # data/'s columns, then its own: each column listed once
            parts.append("| every data/ column | | the record as generated |")
        for field in schema:
            if schema is FILTERED_SCHEMA and field.name in DATA_SCHEMA.names:
                continue
            doc = (field.metadata or {}).get(b"doc", b"").decode()
            parts.append(f"| `{field.name}` | {field.type} | {doc} |")
        parts.append("")
    return "\n".join(parts)


def with_config_reference(readme: str) -> str:
    """The README with its config table replaced by the current one."""
    before, rest = readme.split(CONFIG_START, 1)
    _, after = rest.split(CONFIG_END, 1)
    return f"{before}{CONFIG_START}\n{config_reference()}\n{CONFIG_END}{after}"


if __name__ == "__main__":  # make docs: python -m schemas.reference README.md docs/metrics.md
    readme, metrics = (Path(arg) for arg in sys.argv[1:3])
    readme.write_text(with_config_reference(readme.read_text()))
    metrics.write_text(metrics_reference())
