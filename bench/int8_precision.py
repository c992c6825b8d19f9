"""What quantize: int8's roundings cost in logits, against the float model: int8 weights per
output channel alone (their values in fp32 linears, 8 bits and, as CPUs without VNNI round
them, 7 bits and a sign), and with int8 activations per row as ExactInt8Linear runs them here
(with CORPUSGEN_DISABLE_KERNELS=fbgemm-int8-whole: as without VNNI), unsmoothed and smoothed
as load_model smooths them (SmoothQuant, from one forward of CALIBRATION_TEXT).

Our fp32 model, one teacher-forced forward of a code prompt (this repository's
generation/rejection.py, first 2,000 characters, in the chat template). Per variant:
KL(float || rounded) averaged over positions, top-1 agreement, and the median over positions
of the largest logit error over the largest logit. Prints JSON naming the machine and the
int8 kernel, and writes it to bench/results/int8-precision-<date>.json.
Usage: python bench/int8_precision.py [--models NAME ...]  (packaged names)
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from bench._common import machine
from generation.kernels import EIGHT_BIT_WEIGHTS, SEVEN_BIT_WEIGHTS
from generation.loading import load_model
from generation.quantize import (
    CALIBRATION_TEXT,
    ExactInt8Linear,
    forward_all,
    int8_weights,
    per_channel_int8,
    smoothing_factors,
)
from schemas import ModelSpec

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MAX_POSITIONS = 1024  # the prompts are 523 (Qwen) and 587 (SmolLM2) tokens


def int8_values_in_fp32(model: torch.nn.Module, limit: int) -> torch.nn.Module:
    """A copy whose linears hold their int8 values (codes in [-limit, limit]) in fp32 (the LM
    head untied)."""
    rounded = int8_weights(copy.deepcopy(model), lambda linear: linear)
    for module in rounded.modules():
        if isinstance(module, torch.nn.Linear):
            codes, scales = per_channel_int8(module.weight.detach().float(), limit=limit)
            module.weight = torch.nn.Parameter(codes.float() * scales[:, None])
    return rounded


def compared(logits: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    kl = F.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                  reduction="none").sum(-1)
    error = (logits - reference).abs().amax(-1) / reference.abs().amax(-1)
    return {
        "kl": round(float(kl.mean()), 5),
        "top1_agreement": round(float((logits.argmax(-1) == reference.argmax(-1))
                                      .float().mean()), 4),
        "median_max_error_over_max_logit": round(float(error.median()), 4),
    }


def measure(name: str) -> dict:
    loaded = load_model(ModelSpec(path=f"packaged:{name}"), MAX_POSITIONS, torch.device("cpu"))
    model, tokenizer = loaded.model, loaded.tokenizer
    code = (ROOT / "generation" / "rejection.py").read_text()[:2000]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Explain this code:\n{code}"}],
        add_generation_prompt=True, tokenize=False)
    tokens = tokenizer.encode(prompt)
    smoothing = smoothing_factors(model, tokenizer.encode(CALIBRATION_TEXT))
    variants = {  # built one at a time: a copy of Qwen 1.5B in fp32 is 6 GB
        # the weights as quantize: int8 rounds them with VNNI, and without it
        "int8_weights": lambda: int8_values_in_fp32(model, EIGHT_BIT_WEIGHTS),
        "seven_bit_weights": lambda: int8_values_in_fp32(model, SEVEN_BIT_WEIGHTS),
        "int8_weights_and_rows": lambda: int8_weights(copy.deepcopy(model), ExactInt8Linear),
        "int8_weights_and_rows_smoothed":  # what quantize: int8 runs
            lambda: int8_weights(copy.deepcopy(model), ExactInt8Linear, smoothing),
    }
    with torch.no_grad():
        reference = forward_all(model, tokens)[0]
        result = {}
        for variant, build in variants.items():
            rounded = build()
            result[variant] = compared(forward_all(rounded, tokens)[0], reference)
            kernels = {m.kernel for m in rounded.modules() if isinstance(m, ExactInt8Linear)}
            del rounded
    return {"prompt_tokens": len(tokens), "int8_kernel": "+".join(sorted(kernels)), **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+",
                        default=["qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"])
    parser.add_argument("--out", type=Path, default=RESULTS /
                        f"int8-precision-{datetime.date.today().isoformat()}.json")
    args = parser.parse_args()
    result = {"machine": machine(), "models": {name: measure(name) for name in args.models}}
    text = json.dumps(result, indent=2)
    print(text)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
