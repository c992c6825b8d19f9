"""Render the work-pool base job templates in `deployments/pools/` the way a Prefect worker does.

A worker fills a pool's `job_configuration` from the variable defaults overlaid with the
deployment's and flow run's job variables. Doing the same here lets us check (in tests, or by
hand before `kubectl apply --dry-run`) what a Gaudi pod will really ask the cluster for, without
a cluster or the prefect-kubernetes worker installed.

    python -m tasks.job_templates --cards 8 > job.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

from prefect.utilities.schema_tools import validate
from prefect.utilities.templating import apply_values

POOLS_DIR = Path(__file__).resolve().parent.parent / "deployments" / "pools"
KUBERNETES_GAUDI_TEMPLATE = POOLS_DIR / "kubernetes-gaudi.json"
PROCESS_TEMPLATE = POOLS_DIR / "process.json"


class JobVariablesError(ValueError):
    """Job variables that the pool's variables schema rejects."""


def load_template(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def render_job_configuration(template: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """Validate `values` against the pool's variables schema, then fill `job_configuration`.

    Mirrors `BaseJobConfiguration.from_template_and_values`: defaults that are not None, then the
    given values; an `env` job variable is merged into a literal `env` mapping; then
    `apply_values` (placeholders of unset variables are dropped).
    """
    schema = template["variables"]
    errors = validate(values, schema, raise_on_error=False, ignore_required=True)
    if errors:
        problems = "; ".join(
            f"{'.'.join(map(str, e.path)) or 'variables'}: {e.message}" for e in errors
        )
        raise JobVariablesError(f"invalid job variables: {problems}")
    defaults = {
        name: spec["default"]
        for name, spec in schema.get("properties", {}).items()
        if spec.get("default") is not None
    }
    variables = defaults | values
    config = copy.deepcopy(template["job_configuration"])
    if isinstance(config.get("env"), dict) and isinstance(variables.get("env"), dict):
        config["env"] |= variables["env"]
    return apply_values(config, variables)


def gaudi_job_configuration(cards: int, **values: Any) -> dict[str, Any]:
    """The Kubernetes job configuration a flow-run pod with `cards` Gaudi cards gets."""
    template = load_template(KUBERNETES_GAUDI_TEMPLATE)
    return render_job_configuration(template, {**values, "gaudi_cards": cards})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print the Kubernetes Job a Gaudi flow run gets.")
    parser.add_argument("--cards", type=int, default=1, help="Gaudi cards per pod")
    parser.add_argument("--name", default="corpusgen", help="job name prefix (the worker sets it)")
    parser.add_argument("--image", help="container image (job variable `image`)")
    parser.add_argument("--namespace", help="Kubernetes namespace")
    args = parser.parse_args(argv)
    given = {"name": args.name, "image": args.image, "namespace": args.namespace}
    extra = {name: value for name, value in given.items() if value}
    try:
        config = gaudi_job_configuration(args.cards, **extra)
    except JobVariablesError as error:
        print(error, file=sys.stderr)
        return 2
    json.dump(config["job_manifest"], sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
