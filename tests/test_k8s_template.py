"""The work-pool base job templates in deployments/pools/, rendered the way a worker renders them
and checked against the default templates the installed Prefect server ships."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import prefect
import pytest
from prefect.utilities.templating import find_placeholders

from tasks.job_templates import (
    KUBERNETES_GAUDI_TEMPLATE,
    PROCESS_TEMPLATE,
    JobVariablesError,
    gaudi_job_configuration,
    load_template,
    render_job_configuration,
)

# What `prefect work-pool create --type kubernetes|process` starts from on this Prefect version.
PREFECT_DEFAULTS = json.loads(
    (
        Path(prefect.__file__).parent
        / "server/api/collections_data/views/aggregate-worker-metadata.json"
    ).read_text()
)


def prefect_default(collection: str, worker_type: str) -> dict[str, Any]:
    return PREFECT_DEFAULTS[collection][worker_type]["default_base_job_configuration"]


def leaf_paths(value: Any, prefix: tuple = ()) -> dict[tuple, Any]:
    """Every leaf of a JSON document keyed by its path (list items by index)."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return {prefix: value}
    return {path: leaf for k, v in items for path, leaf in leaf_paths(v, (*prefix, k)).items()}


def pod_spec(config: dict[str, Any]) -> dict[str, Any]:
    return config["job_manifest"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("cards", [1, 4, 8])
def test_gaudi_job_requests_the_card_count_with_host_ipc(cards: int) -> None:
    config = gaudi_job_configuration(cards, name="corpusgen", image="corpusgen:test")
    assert json.loads(json.dumps(config)) == config, "rendered configuration is not plain JSON"
    pod = pod_spec(config)
    container = pod["containers"][0]
    assert container["resources"]["limits"] == {"habana.ai/gaudi": cards}
    assert container["resources"]["requests"] == {"habana.ai/gaudi": cards}
    assert container["image"] == "corpusgen:test"
    assert pod["hostIPC"] is True
    assert "SYS_NICE" in container["securityContext"]["capabilities"]["add"]
    assert pod["nodeSelector"] and all(isinstance(v, str) for v in pod["nodeSelector"].values())
    assert {"key": "habana.ai/gaudi", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    # No placeholder may survive rendering: the worker would send it to the API server verbatim.
    assert not find_placeholders(config)


def test_gaudi_job_waits_longer_for_a_pending_pod_than_prefects_default() -> None:
    default = prefect_default("prefect-kubernetes", "kubernetes")
    default_timeout = default["variables"]["properties"]["pod_watch_timeout_seconds"]["default"]
    config = gaudi_job_configuration(2)
    assert config["pod_watch_timeout_seconds"] >= 10 * default_timeout
    overridden = gaudi_job_configuration(2, pod_watch_timeout_seconds=30)
    assert overridden["pod_watch_timeout_seconds"] == 30


def test_node_selector_and_tolerations_are_job_variables() -> None:
    config = gaudi_job_configuration(
        1, node_selector={"pool": "gaudi3"}, tolerations=[{"key": "x", "operator": "Exists"}]
    )
    assert pod_spec(config)["nodeSelector"] == {"pool": "gaudi3"}
    assert pod_spec(config)["tolerations"] == [{"key": "x", "operator": "Exists"}]


@pytest.mark.parametrize("cards", [0, 9, "two"])
def test_bad_card_count_names_the_variable(cards: Any) -> None:
    with pytest.raises(JobVariablesError, match="gaudi_cards"):
        gaudi_job_configuration(cards)


def test_cli_prints_the_manifest(capsys: pytest.CaptureFixture[str]) -> None:
    from tasks.job_templates import main

    assert main(["--cards", "3", "--image", "corpusgen:1"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["kind"] == "Job"
    assert manifest["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        "habana.ai/gaudi": 3
    }
    assert main(["--cards", "0"]) == 2
    assert "gaudi_cards" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("path", "collection", "worker_type"),
    [
        (KUBERNETES_GAUDI_TEMPLATE, "prefect-kubernetes", "kubernetes"),
        (PROCESS_TEMPLATE, "prefect", "process"),
    ],
)
def test_template_extends_prefects_default(path: Path, collection: str, worker_type: str) -> None:
    """Everything Prefect's worker expects is still there, with the same placeholders; we only
    add keys, variables and new defaults, so workers of this Prefect version accept the pool."""
    ours, default = load_template(path), prefect_default(collection, worker_type)
    our_leaves = leaf_paths(ours["job_configuration"])
    for leaf_path, value in leaf_paths(default["job_configuration"]).items():
        if leaf_path == ("env",) and isinstance(ours["job_configuration"]["env"], dict):
            continue  # process pool: a literal mapping that Prefect merges the `env` variable into
        assert our_leaves.get(leaf_path) == value, f"{path.name}: {leaf_path} changed"
    our_vars = ours["variables"]["properties"]
    for name, spec in default["variables"]["properties"].items():
        assert name in our_vars, f"{path.name}: variable {name} dropped"
        assert our_vars[name].get("type") == spec.get("type"), f"{path.name}: {name} retyped"
    assert ours["variables"].get("definitions") == default["variables"].get("definitions")


@pytest.mark.parametrize("path", [KUBERNETES_GAUDI_TEMPLATE, PROCESS_TEMPLATE])
def test_every_placeholder_is_a_declared_variable(path: Path) -> None:
    """The rule the Prefect server enforces when a pool is created or updated."""
    template = load_template(path)
    declared = set(template["variables"]["properties"])
    used = {p.name for p in find_placeholders(template["job_configuration"])}
    assert used <= declared, f"undeclared: {used - declared}"


def test_process_pool_inherits_the_workers_card_unless_pinned() -> None:
    template = load_template(PROCESS_TEMPLATE)
    assert render_job_configuration(template, {})["env"] == {}
    pinned = render_job_configuration(
        template, {"habana_visible_modules": "0,1", "env": {"CORPUSGEN_X": "1"}}
    )
    assert pinned["env"] == {"HABANA_VISIBLE_MODULES": "0,1", "CORPUSGEN_X": "1"}
    with pytest.raises(JobVariablesError, match="habana_visible_modules"):
        render_job_configuration(template, {"habana_visible_modules": "all"})
