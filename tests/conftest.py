"""Shared fixtures: real models (tiny random ones built from configs, and the packaged SmolLM2)
and a real S3 endpoint (a moto server on loopback, as s3fs's own test suite does)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Subprocesses (prefect, corpusgen, the deployment scripts) must come from the environment that
# runs the tests, also when it is not activated (CI runs .venv/bin/python -m pytest).
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
if os.environ.get("PYTEST_XDIST_WORKER"):  # make test: two workers on two cores, and torch's
    os.environ["OMP_NUM_THREADS"] = "1"  # 2-thread regions then wait on each other (one test
    import torch  # went from 12 s to 97 s); one thread each, their subprocesses too

    torch.set_num_threads(1)

SMOLLM2 = "packaged:smollm2-135m-instruct"
pytest_plugins = ["pipeline_fixtures"]  # the session's Prefect server, shared by every module


def free_port() -> int:
    """A port for a test server that binds seconds later: outside the OS's outgoing range."""
    from flows.local_server import free_listen_port

    return free_listen_port()


@pytest.fixture(scope="session")
def smollm2_spec():
    from schemas import ModelSpec

    return ModelSpec(path=SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_spec):
    from generation.loading import resolve_model_dir

    return resolve_model_dir(smollm2_spec)


def _tiny_model_dir(
    root, smollm2_dir, config_class, model_class, seed: int, noise: float = 0.0, **overrides
):
    """A random tiny model saved as a Hugging Face directory, with SmolLM2's real tokenizer.

    `noise` > 0 perturbs every weight matrix by that fraction of its spread (seeded apart)."""
    import torch
    from transformers import AutoTokenizer

    config = config_class(**{
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "tie_word_embeddings": True,
        **overrides,
    })
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with (
        torch.no_grad()
    ):  # random init gives near-uniform logits; sharpen them like a trained model
        for param in model.parameters():
            if param.dim() == 2:
                param.mul_(4.0)
        generator = torch.Generator().manual_seed(seed + 1000)
        for param in model.parameters():
            if noise and param.dim() == 2:
                param.add_(torch.randn(param.shape, generator=generator) * noise * param.std())
    model.save_pretrained(root)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(root)
    return root


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tiny-llama")
    return _tiny_model_dir(root, smollm2_dir, LlamaConfig, LlamaForCausalLM, seed=0)


@pytest.fixture(scope="session")
def tiny_llama_other_dir(tmp_path_factory, smollm2_dir):
    """tiny_llama_dir's weights plus noise: a draft that often disagrees with it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tiny-llama-other")
    return _tiny_model_dir(root, smollm2_dir, LlamaConfig, LlamaForCausalLM, seed=0, noise=0.6)


@pytest.fixture(scope="session")
def tiny_llama_small_vocab_dir(tmp_path_factory, smollm2_dir):
    """A tiny model with 256 logits (prompts as token ids): cheap even under an emulated CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tiny-llama-256")
    return _tiny_model_dir(root, smollm2_dir, LlamaConfig, LlamaForCausalLM, seed=0,
                           vocab_size=256)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, smollm2_dir):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("tiny-qwen2")
    return _tiny_model_dir(root, smollm2_dir, Qwen2Config, Qwen2ForCausalLM, seed=2)


@pytest.fixture(scope="session")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    yield {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing"}
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh bucket `corpus-test` on a reset moto server; returns s3fs storage options."""
    import requests
    import s3fs

    requests.post(f"{s3_endpoint['endpoint_url']}/moto-api/reset", timeout=10)
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(
        endpoint_url=s3_endpoint["endpoint_url"],
        key=s3_endpoint["key"],
        secret=s3_endpoint["secret"],
    )
    fs.mkdir("corpus-test")
    yield dict(s3_endpoint)
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """(filesystem, output root) on a local folder or in the moto bucket."""
    import fsspec
    import s3fs

    if request.param == "local":
        return fsspec.filesystem("file"), str(tmp_path / "out")
    options = request.getfixturevalue("s3_bucket")
    fs = s3fs.S3FileSystem(
        endpoint_url=options["endpoint_url"], key=options["key"], secret=options["secret"]
    )
    return fs, "corpus-test/out"
