"""RunConfig: one error listing every bad field, overrides, secrets kept out, stable run ids."""

from __future__ import annotations

import json

import pytest

from schemas import ConfigError, RunConfig, parse_run_config

VALID = {
    "input": {"uri": "data/*.jsonl", "prompt_field": "text"},
    "generation": {"engine": {"target": {"path": "packaged:smollm2-135m-instruct"}}},
    "output": "out/run",
}


def test_valid_config_from_yaml_file_with_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "input: {uri: 'data/*.jsonl', prompt_field: text}\n"
        "generation:\n  engine: {target: {path: 'packaged:smollm2-135m-instruct'}}\n"
        "output: out/run\n"
    )
    config = parse_run_config(
        path, ["generation.sampling.max_new_tokens=12", "sharding.rows_per_shard=7", "seed=3",
               "generation.engine.bucket_grid.batch_sizes=[1, 2]"]
    )
    assert config.generation.sampling.max_new_tokens == 12
    assert config.sharding.rows_per_shard == 7
    assert config.seed == 3
    assert config.generation.engine.bucket_grid.batch_sizes == [1, 2]


def test_json_file_loads_like_yaml(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(VALID))
    assert parse_run_config(path) == RunConfig.model_validate(VALID)


def test_every_bad_field_is_listed_in_one_error():
    bad = {
        "input": {"uri": "x.jsonl", "prompt_field": "text", "template": "{a}"},
        "generation": {
            "engine": {"target": {"path": "packaged:nope"}},
            "sampling": {"max_new_tokens": 0},
        },
        "output": "out",
        "accelerator_slots": 0,
        "cost_cap_usd": -1,
        "storage": {"secret": "hunter2"},
        "pricing": {"device_type": "tpu-v9"},
    }
    with pytest.raises(ConfigError) as error:
        parse_run_config(bad)
    message = str(error.value)
    for where in (
        "input: set exactly one of input.prompt_field",
        "generation.engine.target.path: unknown packaged model",
        "generation.sampling.max_new_tokens",
        "accelerator_slots",
        "cost_cap_usd",
        "storage.secret: unknown field",
        "pricing: no price for device type 'tpu-v9'; known device types: cpu",
    ):
        assert where in message, f"{where!r} missing from:\n{message}"
    assert "hunter2" not in message
    assert message.startswith("invalid run config (7 problem(s))")


def test_price_comes_from_the_table_unless_overridden():
    from schemas.pricing import load_prices

    assert parse_run_config(VALID).pricing.usd_per_hour() == load_prices()["cpu"].usd_per_hour
    overridden = parse_run_config(VALID, ["pricing.usd_per_device_hour=2.5"])
    assert overridden.pricing.usd_per_hour() == 2.5


def test_missing_required_sections_are_named():
    with pytest.raises(ConfigError, match=r"input: Field required[\s\S]*output: Field required"):
        parse_run_config({"generation": VALID["generation"]})


def test_template_placeholders_must_be_plain_fields():
    with pytest.raises(ConfigError, match="plain field name"):
        parse_run_config({**VALID, "input": {"uri": "x", "template": "Q: {q!r}"}})
    with pytest.raises(ConfigError, match="at least one"):
        parse_run_config({**VALID, "input": {"uri": "x", "template": "no fields"}})


def test_bad_override_and_missing_file_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_run_config(VALID, ["seed"])
    with pytest.raises(ConfigError, match="not found"):
        parse_run_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="'output' is not a section"):
        parse_run_config(VALID, ["output.x=1"])


def test_run_id_is_stable_and_ignores_operational_settings():
    base = parse_run_config(VALID)
    same = parse_run_config(VALID, ["cost_cap_usd=5", "accelerator_slots=4"])
    other = parse_run_config(VALID, ["seed=1"])
    assert base.resolved_run_id() == same.resolved_run_id() != other.resolved_run_id()
    assert base.config_hash() != same.config_hash()
    assert parse_run_config(VALID, ["run_id=nightly-1"]).resolved_run_id() == "nightly-1"
    with pytest.raises(ConfigError, match="run_id"):
        parse_run_config(VALID, ["run_id=a.b"])


def test_config_cannot_carry_credentials(monkeypatch):
    """Secrets come from the environment, so the hashed/recorded config never contains them."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2")
    config = parse_run_config(VALID, ["storage.endpoint_url=http://127.0.0.1:9"])
    assert "hunter2" not in config.model_dump_json()


def test_prices_file_prices_the_run_and_a_missing_one_is_a_config_error(tmp_path):
    prices = tmp_path / "contract-prices.yaml"
    prices.write_text("gaudi2: {usd_per_hour: 0.85, as_of: 2026-11-01, source: our contract}\n")
    pricing = {"device_type": "gaudi2", "prices_file": str(prices)}
    assert parse_run_config({**VALID, "pricing": pricing}).pricing.usd_per_hour() == 0.85
    with pytest.raises(ConfigError, match=r"pricing: .*'cpu'.*known"):
        parse_run_config({**VALID, "pricing": {**pricing, "device_type": "cpu"}})
    missing = {**pricing, "prices_file": str(tmp_path / "nope.yaml")}
    with pytest.raises(ConfigError, match=r"pricing\.prices_file: .*nope\.yaml"):
        parse_run_config({**VALID, "pricing": missing})


def test_draft_dtype_and_compile_are_refused_where_they_mean_nothing():
    from schemas import DraftSpec, ModelSpec

    model = ModelSpec(path="packaged:qwen2.5-coder-0.5b-instruct")
    assert DraftSpec(kind="model", model=model, dtype="int8").dtype == "int8"
    assert DraftSpec(kind="quantized").dtype is None  # built as int8, the default
    with pytest.raises(ValueError, match=r"draft\.model\.dtype: bfloat16"):
        DraftSpec(kind="model", model=model, dtype="bfloat16")
    with pytest.raises(ValueError, match="not prompt_lookup"):
        DraftSpec(kind="prompt_lookup", dtype="int8")
    with pytest.raises(ValueError, match=r"draft\.compile is for kind 'model' or 'quantized'"):
        DraftSpec(kind="prompt_lookup", compile=True)
