"""Run in a child process (under an emulated AVX2-only CPU, or with fast kernels disabled):
a bf16 target with each draft kind that has weights, and int4 and int8 targets with prompt lookup,
greedy and seeded, against plain decoding at the same precision. Prints one JSON object: the
CPU, each probe's verdict, the kernels each engine ran, and whether every speculative
completion equalled plain decoding's.

Prompts are token ids below the model's vocabulary size, so a model with a small vocabulary
keeps the run short under an emulator.
Usage: python tests/portable_engine_check.py MODEL_DIR [--greedy-only]
"""

from __future__ import annotations

import json
import sys

from engine_helpers import SMALL_GRID

from generation import Engine, kernels
from schemas import DraftSpec, EngineConfig, ModelSpec, SamplingParams

DRAFTS = {
    "quantized-bf16": DraftSpec(kind="quantized", dtype="bfloat16"),
    "quantized-int8": DraftSpec(kind="quantized", dtype="int8"),
}
PARAMS = {
    "greedy": SamplingParams(max_new_tokens=12),
    "seeded": SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=5),
}
GREEDY_ONLY = "--greedy-only"  # under an emulator: the seeded path is the same code


def engine(model_dir: str, draft: DraftSpec | None, quantize: str | None = None) -> Engine:
    target = ModelSpec(path=model_dir, dtype="bfloat16", quantize=quantize)
    return Engine.from_config(
        EngineConfig(target=target, draft=draft, device="cpu", bucket_grid=SMALL_GRID,
                     num_draft_tokens=4)
    )


def main(model_dir: str, greedy_only: bool = False) -> dict:
    params_used = {"greedy": PARAMS["greedy"]} if greedy_only else PARAMS
    plain = engine(model_dir, None)
    vocab = plain.target.model.config.vocab_size
    prompts = [[(7 * i + 3 * j) % (vocab - 3) + 3 for j in range(4 + 3 * i)] for i in range(5)]
    expected = {name: [c.token_ids for c in plain.generate(prompts, params)]
                for name, params in params_used.items()}
    result = {
        **kernels.hardware(),
        "probes": {name: probe().reason for name, probe in (
            (kernels.ONEDNN_PACKED_BF16, kernels.packed_bf16),
            (kernels.FBGEMM_INT8, kernels.fbgemm_int8),
            (kernels.FBGEMM_INT8_ROWS, kernels.fbgemm_int8_rows_exact),
            (kernels.FBGEMM_INT8_WHOLE, kernels.fbgemm_int8_whole),
            (kernels.INT_MM, kernels.int_mm),
            (kernels.INT4PACK_MM, kernels.int4pack_mm),
            (kernels.INT8PACK_MM, kernels.int8pack_mm),
            (kernels.ONEDNN_PACKED_FP32, kernels.packed_fp32),
        )},
        "kernels": {"plain": plain.hardware_info["cpu_kernels"]},
        "identical": {},
        "rounds": {},
    }
    for draft_name, draft in DRAFTS.items():
        speculative = engine(model_dir, draft)
        result["kernels"][draft_name] = speculative.hardware_info["cpu_kernels"]
        for name, params in params_used.items():
            got = [c.token_ids for c in speculative.generate(prompts, params)]
            result["identical"][f"{draft_name}/{name}"] = got == expected[name]
            result["rounds"][f"{draft_name}/{name}"] = speculative.stats.rounds
    for quantize in ("int4", "int8"):
        try:
            plain_quantized = engine(model_dir, None, quantize)
        except kernels.KernelUnavailable as refused:  # int8 without an exact int8 GEMM
            result["kernels"][f"{quantize}-target"] = f"refused: {refused}"
            continue
        speculative = engine(model_dir, DraftSpec(kind="prompt_lookup"), quantize)
        result["kernels"][f"{quantize}-target"] = plain_quantized.hardware_info["cpu_kernels"]
        for name, params in params_used.items():
            got = [c.token_ids for c in speculative.generate(prompts, params)]
            expected_quantized = [c.token_ids for c in plain_quantized.generate(prompts, params)]
            key = f"{quantize}-target/prompt-lookup/{name}"
            result["identical"][key] = got == expected_quantized
            result["rounds"][key] = speculative.stats.rounds
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], GREEDY_ONLY in sys.argv)))
