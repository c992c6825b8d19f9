"""An OpenAI Batch API file, end to end: `corpusgen plan` says what it will do, a run on the tiny
random Llama honours each request's parameters, and `corpusgen export` writes lines that the
`openai` package's own pydantic types parse, one per request, in input order."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from openai import BaseModel
from openai.types import BatchError, BatchRequestCounts
from openai.types.chat import ChatCompletion
from openai.types.shared import ErrorObject
from pipeline_fixtures import run_config, tiny_engine
from typer.testing import CliRunner

from flows.cli import app
from flows.generate import generate_corpus
from schemas import ConfigError, EngineConfig, SamplingParams, parse_run_config
from tasks.batch_requests import parse_request

runner = CliRunner()


class Response(BaseModel):
    status_code: int
    request_id: str
    body: dict


class OutputLine(BaseModel):
    """A line of a Batch API output or error file (the openai package has no type for it)."""

    id: str
    custom_id: str
    response: Response | None
    error: BatchError | None


def request(custom_id: str, content, **body) -> dict:
    messages = content if isinstance(content, list) else [{"role": "user", "content": content}]
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": messages, **body}}


# (line, None for a request that runs, else (error code, param its error names))
LINES = [
    (request("plain-1", "Name a river."), None),
    (request("hot", "Name a comet.", temperature=0.8, seed=11, max_tokens=3), None),
    (request("bias", "Hi", logit_bias={"50256": -100}), ("unsupported_field", "logit_bias")),
    (request("hot-twin", "Name a comet.", temperature=0.8, seed=11, max_completion_tokens=3),
     None),
    ({**request("embed", "Hi"), "url": "/v1/embeddings"}, ("unsupported_endpoint", "url")),
    (request("n3", "Name a bee.", n=3, temperature=0.7, top_p=0.9), None),
    (request("tools", "Hi", tools=[{"type": "function", "function": {"name": "f"}}]),
     ("unsupported_field", "tools")),
    (request("other-model", "Hi", model="gpt-4o"), ("unknown_model", "model")),
    (request("plain-1", "A second plain-1."), ("duplicate_id", None)),
    ('{"custom_id": "broken", ', ("malformed_json", None)),
    (request("long", "word " * 300), ("prompt_too_long", None)),
    (request("format", "Say yes.", response_format={"type": "json_schema", "json_schema": {
        "name": "answer", "schema": {"type": "string", "enum": ["yes"]}}}),
     None),
    (request("plain-2", [{"role": "developer", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Name a lake."}]}],
             stop=["\n\n"], temperature=0), None),
]


@pytest.fixture
def batch_run(tmp_path, tiny_llama_dir):
    """The batch file and the YAML config of a run over it (max_error_fraction 1: most lines
    are planted errors)."""
    path = tmp_path / "batch.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                            for line, _ in LINES))
    config = run_config(str(path), str(tmp_path / "out"), tiny_engine(tiny_llama_dir),
                        max_error_fraction=1.0)
    config["input"] = {"uri": str(path), "format": "openai_batch", "model_name": "gpt-4o-mini"}
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(config))
    return config, config_path


def test_plan_says_what_a_batch_file_run_will_do(batch_run):
    _, config_path = batch_run
    result = runner.invoke(app, ["plan", str(config_path)])
    assert result.exit_code == 0, result.output
    failing = 6  # planted errors the plan finds (not prompt_too_long)
    assert f"openai_batch: 13 requests: {13 - failing} to generate, {failing} error rows" \
        in result.output
    assert "unsupported_field: body.logit_bias" in result.output
    assert "duplicate_id" in result.output and "unknown_model" in result.output
    assert "parameter groups: 5" in result.output
    assert "max_new_tokens 3, temperature 0.8" in result.output
    assert "1 prompts too long for the grid" in result.output


def test_a_batch_file_runs_and_exports_as_the_batch_api_output(
    batch_run, tmp_path, tiny_llama_dir, prefect_server
):
    config, _ = batch_run
    batch_bytes = (tmp_path / "batch.jsonl").read_bytes()
    generate_corpus(config)
    errors_path = tmp_path / "errors.jsonl"
    exported = runner.invoke(app, ["export", config["output"], "--format", "openai-batch",
                                   "--errors", str(errors_path)])
    assert exported.exit_code == 0, exported.output
    results = [OutputLine.model_validate_json(line) for line in exported.stdout.splitlines()]
    errors = [OutputLine.model_validate_json(line) for line in errors_path.read_text().splitlines()]
    counts = BatchRequestCounts(completed=len(results), failed=len(errors), total=len(LINES))
    assert counts.completed + counts.failed == counts.total

    assert [r.custom_id for r in results] == [
        line["custom_id"] for line, outcome in LINES if outcome is None]
    completions = {}
    for line in results:
        assert line.response.status_code == 200 and line.error is None
        completion = ChatCompletion.model_validate(line.response.body)
        assert completion.object == "chat.completion" and completion.usage.prompt_tokens > 0
        completions[line.custom_id] = completion

    expected_errors = [(line, outcome) for line, outcome in LINES if outcome is not None]
    assert len(errors) == len(expected_errors)
    for error, (line, (code, param)) in zip(errors, expected_errors, strict=True):
        assert error.response.status_code == 400
        body = ErrorObject.model_validate(error.response.body["error"])
        assert (body.code, body.param) == (code, param), body.message
        where = f"batch.jsonl:{batch_bytes.index(line.encode())}" if isinstance(line, str) else ""
        assert error.custom_id == (where or line["custom_id"])  # no custom_id: file:byte

    assert [c.index for c in completions["n3"].choices] == [0, 1, 2]
    assert json.loads(completions["format"].choices[0].message.content) == "yes"  # its schema
    hot, twin = completions["hot"], completions["hot-twin"]
    assert hot.choices[0].message.content == twin.choices[0].message.content  # seed 11 twice
    assert hot.usage.completion_tokens <= 3 and twin.usage.completion_tokens <= 3

    # The request's temperature, max_tokens and seed are what the engine sampled with.
    from generation import Engine
    from generation.prompts import chat_text_and_ids

    engine = Engine.from_config(EngineConfig.model_validate(tiny_engine(tiny_llama_dir)))
    _, ids = chat_text_and_ids(engine.tokenizer, [{"role": "user", "content": "Name a comet."}])
    alone = engine.generate([ids], SamplingParams(max_new_tokens=3, temperature=0.8), [11])[0]
    assert hot.choices[0].message.content == alone.text
    assert hot.choices[0].finish_reason == ("length" if alone.finish_reason == "length"
                                            else "stop")

    again = runner.invoke(app, ["export", config["output"], "--format", "openai-batch",
                                "--errors", str(tmp_path / "again.jsonl")])
    assert again.stdout == exported.stdout  # ids and order are stable
    assert (tmp_path / "again.jsonl").read_text() == errors_path.read_text()

    next((tmp_path / "out" / "manifests").iterdir()).unlink()  # a shard not committed
    unfinished = runner.invoke(app, ["export", config["output"], "--format", "openai-batch"])
    assert unfinished.exit_code == 2 and "shards are not committed" in unfinished.output


def test_a_batch_file_config_and_input_are_checked_in_one_line(batch_run, tmp_path):
    config, config_path = batch_run
    with pytest.raises(ConfigError, match=re.escape("openai_batch takes the id from custom_id "
                       "and the chat from body.messages; remove input.prompt_field")):
        parse_run_config(config, ["input.prompt_field=text"])
    gz = tmp_path / "batch.jsonl.gz"
    gz.write_bytes(b"x")
    result = runner.invoke(app, ["plan", str(config_path), "--set", f"input.uri={gz}"])
    assert result.exit_code == 2
    assert "input.format openai_batch reads uncompressed JSONL" in result.output


def test_export_refuses_what_it_cannot_answer_in_one_line(tmp_path):
    result = runner.invoke(app, ["export", str(tmp_path), "--format", "openai-batch"])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: {tmp_path} holds 0 runs (none); pick one with --run"


@pytest.mark.parametrize(("body", "reason"), [
    ({"logit_bias": {"1": 1}, "tools": []}, "unsupported_field: body.logit_bias, body.tools:"),
    ({"temperature": -1}, "invalid_value: body.temperature:"),
    ({"max_tokens": 0}, "invalid_value: body.max_tokens:"),
    ({"n": 0}, "invalid_value: body.n must be an integer >= 1"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "wrong_type: body.messages[0] must be"),
    ({"messages": [{"role": "user", "content": "x", "name": "a"}]},
     "unsupported_field: body.messages[0].name"),
    ({"model": None}, "missing_field: body.model"),
    ({"presence_penalty": 0.5}, "unsupported_field: body.presence_penalty"),
])
def test_a_field_the_engine_cannot_honour_is_an_error_naming_it(tiny_llama_dir, body, reason):
    config = parse_run_config({
        "input": {"uri": "x.jsonl", "format": "openai_batch"},
        "generation": {"engine": tiny_engine(tiny_llama_dir)}, "output": "out",
    })
    line = request("r", "Hi", model=tiny_llama_dir.name)
    with pytest.raises(ValueError, match="^" + re.escape(reason)):
        parse_request({**line, "body": {**line["body"], **body}}, config)


def test_neutral_values_and_the_target_name_are_accepted(tiny_llama_dir):
    config = parse_run_config({
        "input": {"uri": "x.jsonl", "format": "openai_batch"},
        "generation": {"engine": tiny_engine(tiny_llama_dir), "samples_per_prompt": 2},
        "output": "out",
    })
    line = request("r", "Hi", model=str(tiny_llama_dir), stream=False, presence_penalty=0,
                   user="u-1", stop="END", seed=-5)
    parsed = parse_request(line, config)
    assert parsed.custom_id == "r" and parsed.seed == -5 and parsed.samples is None
    assert json.loads(parsed.group)["stop"] == ["END"]
