"""bf16 linears prepacked for oneDNN on CPU: the same numbers as F.linear, bit for bit, so
packing moves speed and never a token. These tests measure the packed kernel itself, so they
need a CPU that runs it (AVX512-BW/VL/DQ or AVX-NE-CONVERT); test_portability.py runs the
fallback everywhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import engine_for, varied_prompts

from generation import kernels
from generation.packing import PACKED_MIN_ROWS, PackedLinear, RowExactLinear
from schemas import DraftSpec, ModelSpec, SamplingParams

pytestmark = pytest.mark.skipif(
    not kernels.packed_bf16().available,
    reason=f"needs oneDNN's prepacked bf16 kernel: {kernels.packed_bf16().reason} "
    f"(CPU: {kernels.cpu_summary()})",
)


@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_linear_is_bitwise_the_bf16_linear(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(linear)
    for shape in [(1, 1), (1, 5), (8, 1), (8, 9), (2, 64)]:
        x = torch.randn(*shape, 96, dtype=torch.bfloat16)
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))


def test_a_packed_linear_computes_few_rows_at_its_fast_row_count():
    """oneDNN's product is slower at 1-3 rows than at 4; a decode step's one row is padded to
    PACKED_MIN_ROWS and only its own row is returned, the same numbers as unpadded."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160).to(torch.bfloat16)
    packed = PackedLinear(linear)
    product, seen_rows = packed._product, []
    packed._product = lambda rows: (seen_rows.append(rows.shape[0]), product(rows))[1]
    for rows in (1, 3, 4, 9):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))
    assert seen_rows == [PACKED_MIN_ROWS, PACKED_MIN_ROWS, 4, 9]


def linear_kinds(engine) -> set[str]:
    return {
        type(module).__name__
        for runner in engine._runners
        for module in runner.model.modules()
        if isinstance(module, torch.nn.Linear | PackedLinear | RowExactLinear)
    }


def test_a_bf16_engine_packs_its_linears_and_keeps_its_tokens(tiny_llama_dir, tiny_llama_other_dir):
    def engine():
        bf16 = ModelSpec(path=str(tiny_llama_dir), dtype="bfloat16")
        draft = DraftSpec(
            kind="model", model=ModelSpec(path=str(tiny_llama_other_dir), dtype="bfloat16")
        )
        # A fixed K: the drafts must run, and K auto prices a same-size draft out of it.
        return engine_for(tiny_llama_dir, target=bf16, draft=draft, num_draft_tokens=2)

    prompts, params = varied_prompts(6), SamplingParams(max_new_tokens=16)
    packed = engine()
    assert linear_kinds(packed) == {"PackedLinear"}
    with kernels.disabled(kernels.ONEDNN_PACKED_BF16):
        unpacked = engine()
    assert linear_kinds(unpacked) == {"RowExactLinear", "Fp32ComputeLinear"}  # target, draft
    assert [c.token_ids for c in packed.generate(prompts, params)] == [
        c.token_ids for c in unpacked.generate(prompts, params)
    ]
    assert packed.stats.rounds > 0


def test_fp32_targets_round_rows_alike_and_compiled_runners_keep_plain_linears(tiny_llama_dir):
    assert linear_kinds(engine_for(tiny_llama_dir)) == {"RowExactLinear"}
    draft = DraftSpec(kind="model", model=ModelSpec(path=str(tiny_llama_dir)))
    assert linear_kinds(engine_for(tiny_llama_dir, draft=draft)) == {"RowExactLinear", "Linear"}
    bf16 = ModelSpec(path=str(tiny_llama_dir), dtype="bfloat16")
    assert linear_kinds(engine_for(tiny_llama_dir, target=bf16, compile=True)) == {"Linear"}
