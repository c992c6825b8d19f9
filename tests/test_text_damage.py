"""Text is never damaged silently: invalid UTF-8 in the input is an error row naming its byte
offset (or, on request, read as U+FFFD), a completion cut inside a multi-byte character drops
that character instead of ending in U+FFFD, and a row stopped by the cache says so."""

from __future__ import annotations

import fsspec
import pytest
from engine_helpers import engine_for
from pipeline_fixtures import run_config

from generation import Engine
from reporting.estimate import cache_warning, estimate_run
from schemas import EngineConfig, SamplingParams, parse_run_config
from tasks.planning import plan_shards
from tasks.prompting import count_prompts
from tasks.records import read_shard

FS = fsspec.filesystem("file")
GOOD = b'{"id": "a", "prompt": "caf\\u00e9 au lait"}\n'
BAD_BYTES = b'{"id": "b", "prompt": "caf\xe9 au lait"}\n'  # latin-1 bytes in a UTF-8 file
SURROGATE = b'{"id": "c", "prompt": "half a pair: \\ud83d"}\n'


def read_rows(tmp_path, on_invalid_utf8: str = "error"):
    path = tmp_path / "in.jsonl"
    path.write_bytes(GOOD + BAD_BYTES + SURROGATE)
    raw = run_config(str(path), str(tmp_path / "out"), {"target": {"path": "unused"}})
    raw["input"]["on_invalid_utf8"] = on_invalid_utf8
    config = parse_run_config(raw)
    (shard,) = plan_shards(FS, config, str(path))
    return read_shard(FS, shard, config.input, 0)


def test_invalid_utf8_is_an_error_row_naming_its_byte_offset(tmp_path):
    good, bad = read_rows(tmp_path)
    assert [r.record_id for r in good] == ["a"]
    by_id = {b.record_id: b.reason for b in bad}
    offset = len(GOOD) + BAD_BYTES.index(b"\xe9")
    assert by_id["b"].startswith(f"invalid_utf8: byte {offset} of in.jsonl is not UTF-8")
    assert "input.on_invalid_utf8: replace" in by_id["b"]
    assert by_id["c"].startswith("invalid_utf8: the prompt holds '\\ud83d'")


def test_replace_keeps_todays_reading_on_request(tmp_path):
    good, bad = read_rows(tmp_path, "replace")
    assert [r.record_id for r in good] == ["a", "b"]
    assert good[1].prompt == "caf\ufffd au lait"
    assert [b.record_id for b in bad] == ["c"]  # a lone surrogate has no replacement reading


@pytest.fixture(scope="module")
def smollm2(smollm2_spec):
    return Engine.from_config(EngineConfig(target=smollm2_spec, device="cpu"))


def test_a_completion_cut_mid_character_drops_it_and_keeps_every_token(smollm2):
    """SmolLM2 answers emoji with byte-level tokens: cut after each token, some cuts fall
    inside a character. None of them may end in U+FFFD; their token ids stay whole."""
    prompt = [{"role": "user", "content": "Repeat exactly: 😀🎉🎈🥳✨"}]
    full = smollm2.generate([prompt], SamplingParams(max_new_tokens=8))[0]
    tokenizer = smollm2.tokenizer
    cut_inside = 0
    for n in range(1, len(full.token_ids) + 1):  # 3 tokens an emoji: cuts in and between
        done = smollm2.generate([prompt], SamplingParams(max_new_tokens=n))[0]
        assert done.token_ids == full.token_ids[:n]
        assert not done.text.endswith("\ufffd"), (n, done.text)
        partial = tokenizer.decode(done.token_ids, skip_special_tokens=True).endswith("\ufffd")
        assert done.trimmed_partial_character == (partial and done.finish_reason == "length")
        cut_inside += done.trimmed_partial_character
    assert cut_inside > 0, "no cut fell inside a character: the prompt no longer tests this"


def test_a_row_the_cache_stops_says_cache_full_and_plan_warns(tmp_path, tiny_llama_dir):
    engine = engine_for(tiny_llama_dir)  # largest cache bucket 96, draft K up to 4
    grid = engine.grid
    prompt = list(range(10, 40))
    done = engine.generate([prompt], SamplingParams(max_new_tokens=200))[0]
    assert done.finish_reason == "cache_full"
    assert len(prompt) + len(done.token_ids) == grid.max_context
    short = engine.generate([prompt], SamplingParams(max_new_tokens=8))[0]
    assert short.finish_reason == "length"

    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "1", "prompt": "hi"}\n{"id": "2", "prompt": "' + "word " * 20
                    + '"}\n')
    plan_grid = {**grid.model_dump(), "prompt_lengths": [32, 64]}  # both prompts fit
    raw = run_config(str(path), str(tmp_path / "out"), {"target": {"path": str(tiny_llama_dir)},
                     "bucket_grid": plan_grid})
    raw["generation"]["sampling"]["max_new_tokens"] = 60
    config = parse_run_config(raw)
    shards = plan_shards(FS, config, str(path))
    estimate = estimate_run(config, len(shards), count_prompts(config, shards, engine.tokenizer),
                            None)
    assert estimate.cache_full == 1
    warning = cache_warning(estimate, config)
    assert warning.startswith("warning: 1 row(s) have prompt + max_new_tokens (60) beyond")
    assert "finish_reason cache_full" in warning and "bucket_grid.cache_lengths" in warning
