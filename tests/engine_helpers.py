"""Helpers shared by the engine and speculation tests (plain functions, not fixtures)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from generation import Engine, kernels
from schemas import BucketGrid, DraftSpec, EngineConfig, ModelSpec

# An int8 target needs an exact int8 GEMM: fbgemm's (AVX2 and up; 7-bit weights without VNNI)
# or torch._int_mm (oneDNN's AVX2 path saturates int16 pair sums, so its probe refuses there).
needs_exact_int8 = pytest.mark.skipif(
    not (kernels.fbgemm_int8_rows_exact().available or kernels.int_mm().available),
    reason=f"an int8 target needs an exact int8 GEMM: fbgemm's "
    f"({kernels.fbgemm_int8_rows_exact().reason}) or torch._int_mm ({kernels.int_mm().reason}) "
    f"(CPU: {kernels.cpu_summary()})",
)

SMALL_GRID = BucketGrid(
    batch_sizes=[1, 2, 4], prompt_lengths=[16, 32], cache_lengths=[64, 96], draft_lengths=[2, 4]
)
SENTENCE = "the cat sat on a mat while rain fell over quiet hills and rivers ran to the sea"
WORDS = SENTENCE.split()


def varied_prompts(count: int) -> list[str]:
    """Prompts of different lengths, so rows finish and refill at different times."""
    return [" ".join(WORDS[i % 5 : i % 5 + 2 + (3 * i) % 11]) for i in range(count)]


def hf_greedy(model_dir, engine: Engine, prompts, max_new_tokens: int) -> list[list[int]]:
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    outputs = []
    for prompt in prompts:
        ids = engine.encode(prompt)
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
        outputs.append(out[0, len(ids) :].tolist())
    return outputs


def engine_for(model_dir, **overrides) -> Engine:
    config = dict(target=ModelSpec(path=str(model_dir)), device="cpu", bucket_grid=SMALL_GRID)
    return Engine.from_config(EngineConfig(**(config | overrides)))


DRAFT_NAMES = [
    "independent-model",
    "independent-model-int8",
    "same-model",
    "quantized-int8",
    "quantized-bf16",
    "prompt-lookup",
]  # the keys of drafts()


def drafts(target_dir, other_dir) -> dict[str, DraftSpec]:
    """Every draft kind: another model (bf16 + int8 too), the target itself, quantized copies,
    prompt lookup."""
    return {
        "independent-model": DraftSpec(kind="model", model=ModelSpec(path=str(other_dir))),
        "independent-model-int8": DraftSpec(
            kind="model", model=ModelSpec(path=str(other_dir), dtype="bfloat16"), dtype="int8"
        ),
        "same-model": DraftSpec(kind="model", model=ModelSpec(path=str(target_dir))),
        "quantized-int8": DraftSpec(kind="quantized", dtype="int8"),
        "quantized-bf16": DraftSpec(kind="quantized", dtype="bfloat16"),
        "prompt-lookup": DraftSpec(kind="prompt_lookup", ngram_max=3),
    }
