"""How close the metrics' plain-decoding estimate comes to a real plain run, printed as JSON.

SmolLM2-135M (packaged), greedy, 48 new tokens, 4 copy-heavy chat prompts at batch 4: a
prompt-lookup run (K=4) estimates what plain decoding would have taken (measured [b, 1] step
times x the plain steps each round replaced); the same prompts are then decoded plain. The runs
alternate; figures are medians. tests/test_reporting.py checks the same within +-25 %.

    python bench/payoff.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the measurement is shared with the test

from reporting_fixtures import measure_plain_estimate  # noqa: E402

from schemas import ModelSpec  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    seconds = measure_plain_estimate(ModelSpec(path="packaged:smollm2-135m-instruct"), args.repeats)
    estimate, measured = seconds["estimated_plain_seconds"], seconds["measured_plain_seconds"]
    print(json.dumps({
        "model": "packaged:smollm2-135m-instruct", "draft": "prompt_lookup, K=4",
        "prompts": "4 copy-heavy chat prompts, batch 4, 48 new tokens, greedy",
        "repeats": args.repeats, "torch_threads": 1,
        "seconds": {key: round(value, 3) for key, value in seconds.items()},
        "estimate_error": round(estimate / measured - 1, 3),
        "measured_speedup": round(measured / seconds["speculative_seconds"], 3),
        "estimated_speedup": round(estimate / seconds["speculative_seconds"], 3),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
