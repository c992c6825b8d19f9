"""What the docs say is what the code does: the README's config reference and docs/metrics.md
are the schemas' own output, descriptions quote no machine's measurements, and the SQL views
price a device-second with the same formula as the pipeline."""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import pytest

from reporting.metrics import VIEWS_PATH, _section
from schemas.pricing import device_cost
from schemas.reference import (
    CONFIG_END,
    CONFIG_START,
    config_reference,
    metrics_reference,
    with_config_reference,
)
from schemas.run import RunConfig

ROOT = Path(__file__).resolve().parent.parent
MEASUREMENT = re.compile(r"\d\s*(ms|s|tok/s|x|GB/s)\b|bench v\d|measured", re.I)


def test_the_readme_config_reference_is_the_schemas_own():
    readme = (ROOT / "README.md").read_text()
    assert CONFIG_START in readme and CONFIG_END in readme
    assert with_config_reference(readme) == readme, "run `make docs`"
    for name in ("input.on_invalid_utf8", "shard_lease_seconds", "generation.engine.draft.kind"):
        assert f"| `{name}` |" in config_reference()


def test_docs_metrics_md_lists_every_column_as_the_schemas_do():
    assert (ROOT / "docs" / "metrics.md").read_text() == metrics_reference(), "run `make docs`"


def _descriptions(model) -> list[tuple[str, str]]:
    found = []
    for name, field in model.model_fields.items():
        if field.description:
            found.append((f"{model.__name__}.{name}", field.description))
        for arg in [field.annotation, *getattr(field.annotation, "__args__", ())]:
            if isinstance(arg, type) and hasattr(arg, "model_fields"):
                found += _descriptions(arg)
    return found


def test_field_descriptions_quote_no_measurements():
    quoting = [(name, doc) for name, doc in _descriptions(RunConfig) if MEASUREMENT.search(doc)]
    assert quoting == [], "measurements belong in bench/README.md, not in a field's description"


@pytest.mark.parametrize(
    ("seconds", "devices", "price"), [(3600, 1, 2.5), (12.5, 8, 1.1), (0, 2, 3)]
)
def test_the_sql_views_cost_formula_is_the_pipelines(seconds, devices, price):
    con = duckdb.connect()
    macro = _section(VIEWS_PATH.read_text(), "derived").split(";")[0]
    con.execute(macro)
    (sql_cost,) = con.execute("SELECT device_cost(?, ?, ?)", [seconds, devices, price]).fetchone()
    assert sql_cost == pytest.approx(device_cost(seconds, devices, price))
