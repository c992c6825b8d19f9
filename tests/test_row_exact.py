"""A target's row gets the same bits in every decode call it can be in: alone or in any
batch, in a 1-token step or a K+1-token verify, in any cache-length bucket. GEMM libraries pick
their kernel, and so their order of summation, by the call's shape, so a bf16-on-AVX2 or fp32
target's seeded record would depend on its neighbours, its draft and its K. These tests use
real layer shapes (Qwen2.5 1.5B's), where MKL's sgemm changes kernel with the row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from generation import kernels
from generation.model import few_query_attention, queries_fold_alike
from generation.packing import (
    PER_ROW,
    PackedLinear,
    RowExactLinear,
    decode_row_counts,
    row_exact_kernel,
    target_linears_for,
)
from generation.phase import prefilling

GRID_ROWS = decode_row_counts([1, 2, 4, 8], [2, 4, 6])  # the default grid's decode calls


def test_decode_row_counts_cover_every_step_and_verify_of_the_grid():
    assert decode_row_counts([1, 4], [2, 4]) == (1, 3, 4, 5, 12, 20)
    assert max(GRID_ROWS) == 8 * 7


@pytest.mark.parametrize("path", ["packed", "per-row"])
def test_a_target_linear_row_is_bitwise_the_same_in_every_decode_call(path):
    torch.manual_seed(0)
    dense = torch.nn.Linear(1536, 2048, bias=True)
    with kernels.disabled(*([kernels.ONEDNN_PACKED_FP32] if path == "per-row" else [])):
        linear = RowExactLinear(dense, GRID_ROWS)
    assert linear.kernel == (row_exact_kernel() if path == "packed" else PER_ROW)
    x = torch.randn(57, 1536)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(57)])
    torch.testing.assert_close(alone, F.linear(x, dense.weight, dense.bias), rtol=1e-4, atol=1e-4)
    for rows in (1, *GRID_ROWS):
        together = linear(x[:rows])
        assert torch.equal(together, alone[:rows]), rows
    verify = linear(x[:40].view(8, 5, 1536))  # [b, K + 1] as a verify calls it
    assert torch.equal(verify.view(40, -1), alone[:40])
    with prefilling():  # one prompt per call: any product, the same numbers to 1e-4
        torch.testing.assert_close(linear(x[:32]), alone[:32], rtol=1e-4, atol=1e-4)


def test_a_bf16_target_linear_keeps_the_bf16_weights_values():
    torch.manual_seed(0)
    bf16 = torch.nn.Linear(96, 160).to(torch.bfloat16)
    x = torch.randn(5, 96).to(torch.bfloat16)
    expected = F.linear(x.float(), bf16.weight.float(), bf16.bias.float())
    for disabled in ([], [kernels.ONEDNN_PACKED_FP32]):
        with kernels.disabled(*disabled):
            linear = RowExactLinear(bf16, (2, 5))
        got = linear(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), expected.to(torch.bfloat16).float(),
                                   rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("groups", [1, 3, 6])
@pytest.mark.parametrize("fold", ["token-by-token", "folded-where-alike"])
def test_a_query_token_attends_alike_in_a_verify_and_in_any_cache_bucket(groups, fold):
    """Each of 5 verified tokens equals that token decoded alone, with 300 valid keys in a
    384-, 512- or 1024-key bucket (one Qwen 1.5B layer has 6 query heads per KV head); tokens
    are folded into one GEMM only where this CPU's GEMMs round them alike, as a target does."""
    torch.manual_seed(0)
    kv, d, valid, t = 2, 128, 300, 5
    folds = fold == "folded-where-alike" and queries_fold_alike(groups, d, (1, t))
    q = torch.randn(2, kv * groups, t, d)
    keys, values = torch.randn(2, kv, 1024, d), torch.randn(2, kv, 1024, d)
    visible = torch.arange(1024) < valid - t + 1 + torch.arange(t)[:, None]  # causal [t, keys]

    def attend(tokens: slice, length: int) -> torch.Tensor:
        mask = visible[tokens, :length].expand(2, 1, -1, -1)
        return few_query_attention(q[:, :, tokens], keys[:, :, :length], values[:, :, :length],
                                   mask, folds)

    verify = attend(slice(0, t), 384)
    for token in range(t):
        for length in (384, 512, 1024):
            assert torch.equal(attend(slice(token, token + 1), length)[:, :, 0],
                               verify[:, :, token]), (token, length)
    reference = F.scaled_dot_product_attention(
        q, keys[:, :, :384], values[:, :, :384], attn_mask=visible[:, :384], enable_gqa=True
    )
    torch.testing.assert_close(verify, reference, rtol=1e-4, atol=1e-4)


@pytest.fixture
def one_thread():
    """oneDNN splits a product by thread count: 1 thread, as the benches run, shows it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.skipif(not kernels.packed_bf16().available, reason="needs oneDNN's packed bf16")
def test_a_packed_bf16_target_linear_rounds_every_row_of_a_verify_as_alone(one_thread):
    """On one thread oneDNN's packed bf16 product of Qwen's down projection shape rounds 5-15
    of the 40 rows of a [8, 5] verify apart from the same rows alone (measured here); a
    target's plan pads the call to a row count where each row rounds as it does alone."""
    torch.manual_seed(0)
    holder = torch.nn.Sequential(torch.nn.Linear(8960, 1536, bias=False).to(torch.bfloat16))
    holder[0].weight.data.normal_()
    unplanned = PackedLinear(holder[0])
    target_linears_for(holder, torch.device("cpu"), GRID_ROWS)
    planned = holder[0]
    assert isinstance(planned, PackedLinear) and planned.plan is not None
    x = torch.randn(40, 8960).to(torch.bfloat16)
    alone = torch.cat([planned(x[i : i + 1]) for i in range(40)])
    assert torch.equal(planned(x), alone)
    assert torch.equal(torch.cat([unplanned(x[i : i + 1]) for i in range(40)]), alone)
    if torch.equal(unplanned(x), alone):
        pytest.skip("this CPU's oneDNN rounds each of 40 rows as alone without a plan")
