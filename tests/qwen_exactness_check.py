"""Run in a child process (natively, or with each library capped at AVX2): the Qwen2.5-Coder
1.5B bf16 target on 4 of the bench's code prompts, 48 tokens, greedy. Prints one JSON object:
the kernels, whether each prompt decodes the same in a batch of 4 as alone, and whether the
0.5B int8 draft at K=4 gives plain decoding's tokens.
Usage: python tests/qwen_exactness_check.py
"""

from __future__ import annotations

import json

from bench.qwen_pair import CODE, DRAFT, TARGET
from generation import Engine
from schemas import DraftSpec, EngineConfig, SamplingParams

GRID = {"batch_sizes": [1, 4], "prompt_lengths": [32, 64, 96, 128], "cache_lengths": [256],
        "draft_lengths": [4]}


def engine(draft: DraftSpec | None = None) -> Engine:
    target = TARGET.model_copy(update={"dtype": "bfloat16"})
    return Engine.from_config(EngineConfig(target=target, draft=draft, device="cpu",
                                           bucket_grid=GRID, num_draft_tokens=4))


def main() -> dict:
    prompts, params = CODE[:4], SamplingParams(max_new_tokens=48)
    plain = engine()
    together = [c.token_ids for c in plain.generate(prompts, params)]
    alone = [plain.generate([prompt], params)[0].token_ids for prompt in prompts]
    result = {"kernels": plain.hardware_info["cpu_kernels"],
              "batch_equals_alone": [a == b for a, b in zip(together, alone, strict=True)]}
    del plain
    draft = DraftSpec(kind="model", model=DRAFT.model_copy(update={"dtype": "bfloat16"}),
                      dtype="int8")
    speculative = engine(draft)
    drafted = [c.token_ids for c in speculative.generate(prompts, params)]
    result["speculation_equals_plain"] = [a == b for a, b in zip(drafted, together, strict=True)]
    result["rounds"] = speculative.stats.rounds
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
