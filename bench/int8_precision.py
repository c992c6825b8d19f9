"""What quantize: int8's roundings cost in logits: int8 weights per output channel, and int8
activations per row (126 steps of the row's largest), with and without SmoothQuant's
smoothing (alpha 0.5, the calibration text load_model uses), against the float model.

Hugging Face's model in fp32, the roundings applied by forward pre-hooks to every linear
(the LM head untied, as quantize: int8 unties it), one teacher-forced forward of a code prompt
(this repository's generation/rejection.py, first 2,000 characters, in the chat template).
Per variant: KL(float || rounded) averaged over positions, top-1 agreement, and the median
over positions of the largest logit error over the largest logit. Prints JSON naming the
machine and writes it to bench/results/int8-precision-<date>.json.
Usage: python bench/int8_precision.py [--models NAME ...]  (packaged names)
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench._common import machine
from generation.kernels import ROW_CODE_LIMIT
from generation.loading import resolve_model_dir
from generation.quantize import CALIBRATION_TEXT, SMOOTHING_ALPHA, per_channel_int8
from schemas import ModelSpec

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
VARIANTS = {  # name: (smoothed, activations rounded)
    "int8_weights": (False, False),
    "int8_weights_smoothed": (True, False),
    "int8_weights_and_rows": (False, True),
    "int8_weights_and_rows_smoothed": (True, True),  # what quantize: int8 runs
}


def input_maxima(model: torch.nn.Module, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each linear's largest |input| per channel over one forward, by module id."""
    maxima: dict[int, torch.Tensor] = {}

    def record(module: torch.nn.Module, args: tuple) -> None:
        seen = args[0].reshape(-1, args[0].shape[-1]).abs().amax(0)
        maxima[id(module)] = torch.maximum(maxima.get(id(module), seen), seen)

    hooks = [m.register_forward_pre_hook(record) for m in model.modules()
             if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        model(tokens)
    for hook in hooks:
        hook.remove()
    return maxima


def measure(name: str) -> dict:
    directory = resolve_model_dir(ModelSpec(path=f"packaged:{name}"))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    tokenizer = AutoTokenizer.from_pretrained(directory)
    code = (ROOT / "generation" / "rejection.py").read_text()[:2000]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Explain this code:\n{code}"}],
        add_generation_prompt=True, tokenize=False)
    tokens = torch.tensor([tokenizer.encode(prompt)])
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = {id(m): m.weight.detach().clone() for m in linears}
    maxima = input_maxima(model, torch.tensor([tokenizer.encode(CALIBRATION_TEXT)]))
    with torch.no_grad():
        reference = model(tokens).logits[0]
    result = {"prompt_tokens": tokens.shape[1]}
    for variant, (smoothed, rows) in VARIANTS.items():
        smoothing = {}
        for linear in linears:
            weight = weights[id(linear)]
            factor = (maxima[id(linear)].clamp_min(1e-5) ** SMOOTHING_ALPHA
                      / weight.abs().amax(0).clamp_min(1e-5) ** (1 - SMOOTHING_ALPHA)) \
                if smoothed else torch.ones(weight.shape[1])
            codes, scales = per_channel_int8(weight * factor)
            linear.weight.data = codes.float() * scales[:, None]
            smoothing[id(linear)] = factor

        def rounded(module: torch.nn.Module, args: tuple, rows: bool = rows,
                    smoothing: dict = smoothing) -> tuple:
            x = args[0] / smoothing[id(module)]
            if rows:
                scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-8) / ROW_CODE_LIMIT
                x = (x / scale).round() * scale
            return (x,)

        hooks = [m.register_forward_pre_hook(rounded) for m in linears]
        with torch.no_grad():
            logits = model(tokens).logits[0]
        for hook in hooks:
            hook.remove()
        kl = F.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                      reduction="none").sum(-1)
        error = (logits - reference).abs().amax(-1) / reference.abs().amax(-1)
        result[variant] = {
            "kl": round(float(kl.mean()), 5),
            "top1_agreement": round(float((logits.argmax(-1) == reference.argmax(-1))
                                          .float().mean()), 4),
            "median_max_error_over_max_logit": round(float(error.median()), 4),
        }
    return result


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
