"""Structured output (generation.response_format) under speculation: the grammar's masks keep
greedy and seeded records exactly what plain decoding gives, whatever draft, K or batch; the
sampled distribution is the target's renormalised masked distribution; log-probs are what a
plain forward of the target gives; the pipeline commits only whole, valid records."""

from __future__ import annotations

import json
import random

import fsspec
import jsonschema
import pyarrow.dataset as ds
import pytest
import torch
from engine_helpers import DRAFT_NAMES, SMALL_GRID, drafts, engine_for, varied_prompts
from pipeline_fixtures import good_rows, run_config, tiny_engine, write_jsonl
from test_speculative import FALSE_ALARM, chi_square_p_value
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from flows.cli import app
from flows.generate import generate_corpus
from generation.draft_length import FixedDraftLength
from generation.grammar import masked
from schemas import SamplingParams
from schemas.engine import ResponseFormat
from tasks.quality import QualityError

LABEL_SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["yes", "no", "maybe"]},
        "score": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["label", "score"],
    "additionalProperties": False,
}
LABELS = ResponseFormat.model_validate(
    {"type": "json_schema", "json_schema": {"name": "label", "schema": LABEL_SCHEMA}}
)
PROMPTS = varied_prompts(6)
SEEDS = [300 + 7 * i for i in range(len(PROMPTS))]


def constrained(**overrides) -> SamplingParams:
    return SamplingParams(max_new_tokens=24, response_format=LABELS, **overrides)


def shuffled(engine, params: SamplingParams, order_seed: int) -> list[list[int]]:
    order = list(range(len(PROMPTS)))
    random.Random(order_seed).shuffle(order)
    done = engine.generate([PROMPTS[i] for i in order], params, seeds=[SEEDS[i] for i in order])
    tokens: list = [None] * len(PROMPTS)
    for position, index in enumerate(order):
        tokens[index] = done[position].token_ids
    return tokens


@pytest.fixture(scope="module")
def plain_reference(tiny_llama_dir) -> dict[str, list]:
    """Plain decoding, each prompt alone: greedy and seeded completions under the schema."""
    engine = engine_for(tiny_llama_dir)
    reference = {}
    for name, params in {"greedy": constrained(), "seeded": constrained(temperature=0.9,
                                                                        top_p=0.95)}.items():
        reference[name] = [engine.generate([p], params, seeds=[s])[0]
                           for p, s in zip(PROMPTS, SEEDS, strict=True)]
    return reference


def test_every_closed_record_validates_and_the_mask_is_what_made_it(tiny_llama_dir,
                                                                   plain_reference):
    """A random model writes JSON only because of the mask: unconstrained it does not."""
    for completion in plain_reference["greedy"] + plain_reference["seeded"]:
        assert completion.structured_complete and completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), LABEL_SCHEMA)
    free = engine_for(tiny_llama_dir).generate(PROMPTS, SamplingParams(max_new_tokens=24))
    assert not any(c.text.startswith('{"label": ') for c in free)


@pytest.mark.parametrize("draft", DRAFT_NAMES)
def test_constrained_speculation_is_plain_decoding_token_for_token(
    draft, tiny_llama_dir, tiny_llama_other_dir, plain_reference
):
    """Greedy and seeded, K 2, 4 and auto, prompts in shuffled batches: plain's tokens."""
    spec = drafts(tiny_llama_dir, tiny_llama_other_dir)[draft]
    engine = engine_for(tiny_llama_dir, draft=spec, num_draft_tokens="auto")
    greedy = engine.generate(PROMPTS, constrained())
    assert [c.token_ids for c in greedy] == [c.token_ids for c in plain_reference["greedy"]]
    seeded_reference = [c.token_ids for c in plain_reference["seeded"]]
    auto = engine.draft_length
    for order_seed, k in enumerate([2, 4, None]):
        engine.draft_length = auto if k is None else FixedDraftLength(k)
        seeded = shuffled(engine, constrained(temperature=0.9, top_p=0.95), order_seed)
        assert seeded == seeded_reference, (draft, k)
    stats = engine.stats
    assert sum(stats.accepted_per_position) == stats.accepted  # counted per position
    if draft != "prompt-lookup":  # a model draft proposes under the grammar: kept often
        assert stats.acceptance_rate > 0.3, stats.acceptance_rate


def test_no_new_shape_appears_for_the_mask(tiny_llama_dir, tiny_llama_other_dir):
    """Masks apply to logits of the bucket's shape: a constrained call runs warmed shapes."""
    spec = drafts(tiny_llama_dir, tiny_llama_other_dir)["independent-model"]
    engine = engine_for(tiny_llama_dir, draft=spec, num_draft_tokens="auto")
    engine.warmup()
    target_shapes, draft_shapes = set(engine.target.shapes), set(engine.proposer.runner.shapes)
    engine.generate(PROMPTS, constrained(temperature=0.9))
    assert set(engine.target.shapes) == target_shapes
    assert set(engine.proposer.runner.shapes) == draft_shapes


COLOURS = ResponseFormat(type="choice", choices=["red", "green", "blue", "grey"])


def exact_choice_distribution(model_dir, engine, prompt_ids, temperature: float) -> dict:
    """P(completion text) under the masked, renormalised target, by walking every token path
    the grammar allows."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    grammar = engine.grammars.matcher(COLOURS)
    result: dict[str, float] = {}

    def walk(ids: list[int], generated: list[int], probability: float) -> None:
        if grammar.stopped:
            text = engine.tokenizer.decode(generated)
            result[text] = result.get(text, 0.0) + probability
            return
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        probs = torch.softmax(masked(logits, grammar.allowed()) / temperature, -1)
        for token in probs.nonzero().flatten().tolist():
            assert grammar.consume([token]) == 1
            walk([*ids, token], [*generated, token], probability * float(probs[token]))
            grammar.rollback(1)

    walk(list(prompt_ids), [], 1.0)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("verification", ["coupled", "rejection"])
def test_sampling_under_a_mask_keeps_the_renormalised_target_distribution(
    verification, tiny_llama_dir, tiny_llama_other_dir
):
    grid = SMALL_GRID.model_copy(update={"batch_sizes": [64]})
    spec = drafts(tiny_llama_dir, tiny_llama_other_dir)["independent-model"]
    engine = engine_for(tiny_llama_dir, bucket_grid=grid, draft=spec, num_draft_tokens=2)
    prompt = engine.encode("pick a colour:")
    exact = exact_choice_distribution(tiny_llama_dir, engine, prompt, temperature=1.0)
    assert abs(sum(exact.values()) - 1) < 1e-9 and set(exact) == set(COLOURS.choices)
    samples = 3000
    params = SamplingParams(max_new_tokens=8, temperature=1.0, response_format=COLOURS,
                            verification=verification)
    done = engine.generate([prompt] * samples, params, seeds=list(range(samples)))
    texts = [c.text for c in done]
    names = sorted(exact)
    counts = torch.tensor([texts.count(name) for name in names], dtype=torch.float64)
    assert counts.sum() == samples  # every completion is one of the choices
    probs = torch.tensor([exact[name] for name in names], dtype=torch.float64)
    assert chi_square_p_value(counts, probs) > FALSE_ALARM
    uniform = torch.full_like(probs, 1 / len(names))
    assert chi_square_p_value(counts, uniform) < 1e-6  # the test can tell distributions apart
    assert engine.stats.proposed > 0 and 0 < engine.stats.acceptance_rate < 1


def reference_logprobs(model_dir, engine, prompt_ids, completion, params) -> list[float]:
    """Each completion token's log-probability from one plain forward of the target over prompt
    + completion: logits masked by the grammar replayed along the completion, over T."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([[*prompt_ids, *completion.token_ids]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].double()
    grammar = engine.grammars.matcher(params.response_format)
    result = []
    for position, token in enumerate(completion.token_ids):
        scores = masked(logits[position], grammar.allowed()) / (params.temperature or 1.0)
        result.append(float(torch.log_softmax(scores, -1)[token]))
        grammar.consume([token])
    return result


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_token_logprobs_are_a_plain_forwards_under_the_mask(
    temperature, tiny_llama_dir, tiny_llama_other_dir
):
    spec = drafts(tiny_llama_dir, tiny_llama_other_dir)["independent-model"]
    engine = engine_for(tiny_llama_dir, draft=spec, num_draft_tokens=4)
    params = constrained(temperature=temperature, logprobs=True)
    done = engine.generate(PROMPTS[:3], params, seeds=SEEDS[:3])
    assert engine.stats.accepted > 0  # some tokens were kept from drafts, scored in verify
    for prompt, completion in zip(PROMPTS[:3], done, strict=True):
        expected = reference_logprobs(tiny_llama_dir, engine, engine.encode(prompt),
                                      completion, params)
        assert len(completion.token_logprobs) == len(completion.token_ids)
        assert completion.token_logprobs == pytest.approx(expected, abs=2e-4)
        assert max(completion.token_logprobs) <= 0
    unasked = engine.generate(PROMPTS[:1], constrained())[0]
    assert unasked.token_logprobs is None


def test_a_bad_schema_or_regex_is_one_line_and_exit_2(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", good_rows(3))
    for response_format, named in [
        ({"type": "regex", "pattern": "(["}, "unclosed character class"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}, "objekt"),
        ({"type": "choice", "choices": []}, "choices must be non-empty"),
    ]:
        config = run_config(str(tmp_path / "in.jsonl"), str(tmp_path / "out"),
                            {"target": {"path": "unused"}})
        config["generation"]["response_format"] = response_format
        (tmp_path / "run.json").write_text(json.dumps(config))
        result = CliRunner().invoke(app, ["plan", str(tmp_path / "run.json")])
        assert result.exit_code == 2, result.output
        problem = [line for line in result.output.splitlines() if "response_format" in line]
        assert len(problem) == 1 and named in problem[0], result.output
        assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.usefixtures("prefect_server")
def test_the_pipeline_commits_whole_valid_records_and_counts_the_cut_ones(
    tmp_path, tiny_llama_dir
):
    rows = good_rows(12)
    write_jsonl(tmp_path / "in.jsonl", rows)
    config = run_config(str(tmp_path / "in.jsonl"), str(tmp_path / "out"),
                        tiny_engine(tiny_llama_dir))
    config["generation"]["response_format"] = LABELS.model_dump(mode="json")
    config["generation"]["sampling"] = {"max_new_tokens": 24, "temperature": 0.9,
                                        "logprobs": True}
    summary = generate_corpus(config)
    out = str(tmp_path / "out")
    data = ds.dataset(f"{out}/data", partitioning="hive").to_table().to_pylist()
    assert summary["ok_rows"] == len(data) == len(rows)
    for record in data:
        jsonschema.validate(json.loads(record["completion"]), LABEL_SCHEMA)
        assert len(record["token_logprobs"]) == record["completion_tokens"]
        assert record["mean_logprob"] == pytest.approx(
            sum(record["token_logprobs"]) / len(record["token_logprobs"]), rel=1e-5)
    metrics = ds.dataset(f"{out}/metrics", partitioning="hive").to_table().to_pylist()
    assert sum(m["structured_rows"] for m in metrics) == len(rows)
    assert sum(m["structured_incomplete"] for m in metrics) == 0

    # Too few tokens for any value to close: every row is an error row, the run fails.
    config["output"] = str(tmp_path / "cut")
    config["generation"]["sampling"]["max_new_tokens"] = 4
    with pytest.raises(QualityError):
        generate_corpus(config)
    cut = str(tmp_path / "cut")
    assert not fsspec.filesystem("file").glob(f"{cut}/data/**/*.parquet") or (
        ds.dataset(f"{cut}/data", partitioning="hive").count_rows() == 0
    )
    errors = ds.dataset(f"{cut}/errors", partitioning="hive").to_table().to_pylist()
    assert len(errors) == len(rows)
    assert all(e["reason"].startswith("incomplete_structured_output: cut by length after 4 "
                                      "tokens") for e in errors)
    assert all(e["raw"].startswith('{"') for e in errors)  # what was generated is kept
    metrics = ds.dataset(f"{cut}/metrics", partitioning="hive").to_table().to_pylist()
    assert sum(m["structured_incomplete"] for m in metrics) == len(rows)


def test_the_qa_records_demo_config_is_valid_and_structured():
    import yaml

    from flows.cli import DEMO_DIR, DEMO_EXAMPLES
    from schemas import parse_run_config

    raw = yaml.safe_load((DEMO_DIR / DEMO_EXAMPLES["qa-records"]).read_text())
    config = parse_run_config(raw)
    assert config.generation.response_format.type == "json_schema"
    assert config.generation.engine_sampling.response_format == config.generation.response_format
    assert (DEMO_DIR / raw["input"]["uri"]).exists()
