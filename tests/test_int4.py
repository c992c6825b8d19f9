"""4-bit weights (quantize: int4, draft dtype int4): torch's int4 CPU kernel computes what the
dequantized weights give, each row alone, so an int4 target keeps the engine's promises
(speculation = plain decoding, seeded records the same whatever the draft, K or batch); a
GGUF's 4-bit blocks become int4 groups unchanged; without the kernel the same weights run
in fp32. quantize: int4+int8 runs a GGUF's other linears through torch's int8 weight-only
kernel, which keeps the same promises."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from engine_helpers import SMALL_GRID, drafts, engine_for, varied_prompts
from test_seeded_sampling import (
    SAMPLING,
    alone,
    assert_seeded_records_hold_under_an_int8_draft,
    shuffled,
)

from generation import gguf_int4, kernels
from generation.draft_length import FixedDraftLength
from generation.int4 import (
    DRAFT_KERNEL_ROWS,
    GROUP_SIZES,
    Int4Linear,
    Int4Weights,
    Int8WeightOnlyLinear,
    Int8Weights,
)
from generation.loading import load_model, load_state_dict, resolve_model_dir
from generation.packing import RowExactLinear, row_exact_kernel
from schemas import DraftSpec, EngineConfig, ModelSpec, SamplingParams

pytestmark = pytest.mark.skipif(
    not kernels.int4pack_mm().available,
    reason=f"needs torch's int4 CPU kernel: {kernels.int4pack_mm().reason}",
)


def int4_spec(model_dir) -> ModelSpec:
    return ModelSpec(path=str(model_dir), dtype="bfloat16", quantize="int4")


def rounded_linear(group_size: int, bias: bool = True) -> tuple[torch.nn.Linear, Int4Weights]:
    torch.manual_seed(group_size)
    linear = torch.nn.Linear(512, 96, bias=bias)
    return linear, Int4Weights.from_float(linear.weight, group_size)


@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_an_int4_linear_computes_the_dequantized_weights_product(group_size):
    """Within two bf16 roundings of each output (the kernel's, and the bias added): 2^-7 of
    the value, 1e-3 near zero."""
    linear, weights = rounded_linear(group_size)
    steps = weights.scales.repeat_interleave(group_size, dim=1)
    dequantized = weights.dequantized(torch.bfloat16)
    assert float(((dequantized - linear.weight.detach()).abs() / steps).max()) <= 0.5 + 1e-3
    int4 = Int4Linear(linear.to(torch.bfloat16), weights, kernel_rows=None)
    for rows in (1, 3, 8, 40):
        x = torch.randn(2, rows, 512).bfloat16()
        reference = F.linear(x.float(), dequantized, linear.bias.detach().float())
        torch.testing.assert_close(int4(x).float(), reference, rtol=2**-7, atol=1e-3)


needs_int8pack = pytest.mark.skipif(
    not kernels.int8pack_mm().available,
    reason=f"needs torch's int8 weight-only CPU kernel: {kernels.int8pack_mm().reason}",
)


@needs_int8pack
def test_an_int8_weight_only_linear_computes_its_rounded_weights_product():
    """Codes within half a step of the float weights (the bf16 scale rounded first), and the
    kernel's product within two bf16 roundings of the fp32 one."""
    linear, _ = rounded_linear(32)
    int8 = Int8Weights.from_float(linear.weight)
    exact = int8.multiplied(torch.float32)
    assert torch.equal(int8.scales.bfloat16().float(), int8.scales)
    assert float(((exact - linear.weight.detach()).abs() / int8.scales[:, None]).max()) <= 0.5
    module = Int8WeightOnlyLinear(linear.to(torch.bfloat16), int8, kernel_rows=None)
    for rows in (1, 3, 8, 40):
        x = torch.randn(2, rows, 512).bfloat16()
        reference = F.linear(x.float(), exact, linear.bias.detach().bfloat16().float())
        torch.testing.assert_close(module(x).float(), reference, rtol=2**-7, atol=1e-3)


@needs_int8pack
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_weight_only_row_is_bitwise_the_same_alone_or_among_any_number_of_rows(kind):
    linear, int4 = rounded_linear(32, bias=False)
    module = (Int4Linear(linear.to(torch.bfloat16), int4, kernel_rows=None) if kind == "int4"
              else Int8WeightOnlyLinear(linear.to(torch.bfloat16),
                                        Int8Weights.from_float(linear.weight), kernel_rows=None))
    x = torch.randn(72, 512).bfloat16()
    together = module(x)
    for rows in (1, 2, 3, 4, 5, 8, 9, 17, 40, 72):
        assert torch.equal(module(x[:rows]), together[:rows]), rows
    assert all(torch.equal(module(x[i : i + 1]), together[i : i + 1]) for i in (0, 5, 38, 71))


def test_a_draft_runs_its_wide_calls_on_the_bf16_copy():
    linear, weights = rounded_linear(32, bias=False)
    draft = Int4Linear(linear.to(torch.bfloat16), weights, kernel_rows=DRAFT_KERNEL_ROWS)
    dense = []
    draft.dense.register_forward_hook(lambda module, args, out: dense.append(args[0].shape))
    for rows in (1, DRAFT_KERNEL_ROWS, DRAFT_KERNEL_ROWS + 1):
        draft(torch.randn(rows, 512).bfloat16())
    assert dense == [(DRAFT_KERNEL_ROWS + 1, 512)]


# ---- GGUF blocks -------------------------------------------------------------------------


def random_blocks(kind: str, count: int) -> np.ndarray:
    """Random bytes as GGUF blocks, their fp16 scales set to finite values."""
    _, block_bytes = gguf_int4.DECODERS[kind]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (count, block_bytes), dtype=np.uint8)
    halves = 1 if kind == "Q4_0" else 2  # d, or d and m / dmin
    scales = rng.uniform(-0.05, 0.05, (count, halves)).astype(np.float16)
    blocks[:, : 2 * halves] = scales.view(np.uint8).reshape(count, 2 * halves)
    return blocks


@pytest.mark.parametrize("kind", sorted(gguf_int4.DECODERS))
def test_gguf_4bit_blocks_are_int4_groups_of_32(kind):
    """Codes, fp32 scales and zeros give back gguf's own dequantization of the blocks."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    blocks = random_blocks(kind, 64)
    expected = torch.from_numpy(dequantize(blocks, GGMLQuantizationType[kind]).reshape(4, -1))
    decode, _ = gguf_int4.DECODERS[kind]
    codes, scales, zeros = (torch.from_numpy(a).reshape(4, -1) for a in decode(blocks))
    weights = Int4Weights.from_codes(codes, scales, zeros)
    assert weights.group_size == 32
    torch.testing.assert_close(weights.dequantized(), expected, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_smollm2_int4_runs_its_shipped_q4_1_blocks_and_keeps_its_q8_0_head(smollm2_spec):
    spec = smollm2_spec.model_copy(update={"dtype": "bfloat16", "quantize": "int4"})
    loaded = load_model(spec, 128, torch.device("cpu"))
    kinds = {type(m).__name__ for n, m in loaded.model.named_modules() if n.endswith("_proj")}
    assert kinds == {"Int4Linear"}  # every q/k/v, o, gate/up and down: Q4_1 in the GGUF
    assert type(loaded.model.lm_head) is torch.nn.Linear  # tied to the Q8_0 embedding
    directory = resolve_model_dir(spec)
    assert (directory / gguf_int4.CACHE_FILE).is_file()
    cached = gguf_int4.read_cache(directory / gguf_int4.CACHE_FILE)
    converted = load_state_dict(directory)  # the fp32 weights alone: the cache is not one
    assert set(converted) >= set(cached) and len(cached) == 7 * 30
    name = "model.layers.3.self_attn.k_proj.weight"  # llama's q/k rows: reordered like fp32
    torch.testing.assert_close(cached[name].dequantized(), converted[name], rtol=0, atol=1e-6)


# ---- the engine at int4 ------------------------------------------------------------------


def test_int4_logits_match_the_dequantized_weights_in_fp32(tiny_llama_dir):
    """Prefill (the bf16 copies) and decode steps (the kernel) against the same model with
    its 4-bit weights dequantized and multiplied in fp32 (the fallback). Both run bf16
    activations, so logits of magnitude 2-4 (bf16 steps of 1/64) may differ by 4 steps."""
    prompts = [[5 + i, 17, 300 + 7 * i, 42, 8] for i in range(3)]
    kernel = engine_for(tiny_llama_dir, target=int4_spec(tiny_llama_dir))
    with kernels.disabled(kernels.INT4PACK_MM):
        reference = engine_for(tiny_llama_dir, target=int4_spec(tiny_llama_dir))
    logits = {}
    for name, engine in (("kernel", kernel), ("reference", reference)):
        prefill = engine.target.prefill(prompts, [0, 1, 2])
        step = engine.target.decode(torch.tensor([[9], [10], [11]]), torch.tensor([5, 5, 5]), 3)
        logits[name] = prefill, step
    assert 2 < float(logits["kernel"][0].abs().max()) < 4
    for got, expected in zip(logits["kernel"], logits["reference"], strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=4 / 64)


@pytest.mark.parametrize("draft", ["independent-model", "independent-model-int8",
                                   "prompt-lookup", "int4-model"])
def test_speculation_at_int4_gives_plain_decodings_tokens(
    draft, tiny_llama_dir, tiny_llama_other_dir
):
    int4 = int4_spec(tiny_llama_dir)
    prompts = [*varied_prompts(5), "the cat sat on the mat the cat sat on the mat the cat"]
    kinds = drafts(tiny_llama_dir, tiny_llama_other_dir) | {
        "int4-model": DraftSpec(kind="model", model=ModelSpec(path=str(tiny_llama_other_dir)),
                                dtype="int4"),
    }
    plain = engine_for(tiny_llama_dir, target=int4)
    speculative = engine_for(tiny_llama_dir, target=int4, draft=kinds[draft],
                             num_draft_tokens=4)
    for params in (SamplingParams(max_new_tokens=16), SAMPLING["top-k-top-p"]):
        expected = [c.token_ids for c in plain.generate(prompts, params)]
        assert [c.token_ids for c in speculative.generate(prompts, params)] == expected
    assert speculative.stats.rounds > 0
    if draft == "int4-model":
        assert speculative.model_info["draft_model"] == f"{tiny_llama_other_dir}#int4"


def test_an_int4_target_keeps_its_seeded_records_whatever_the_batch_draft_or_k(
    tiny_llama_dir, tiny_llama_other_dir
):
    int4 = int4_spec(tiny_llama_dir)
    one_row = SMALL_GRID.model_copy(update={"batch_sizes": [1]})
    params = SAMPLING["top-k-top-p"]
    expected = alone(engine_for(tiny_llama_dir, target=int4, bucket_grid=one_row), params)
    assert shuffled(engine_for(tiny_llama_dir, target=int4), params, order_seed=3) == expected
    draft = drafts(tiny_llama_dir, tiny_llama_other_dir)["independent-model"]
    speculative = engine_for(tiny_llama_dir, target=int4, draft=draft, num_draft_tokens="auto")
    auto = speculative.draft_length
    for order_seed, k in enumerate([2, None]):
        speculative.draft_length = auto if k is None else FixedDraftLength(k)
        assert shuffled(speculative, params, order_seed) == expected, k
    assert speculative.stats.rounds > 0
    assert speculative.model_info["target_model"] == f"{tiny_llama_dir}#int4"
    target_kernels = speculative.hardware_info["cpu_kernels"].split("target=")[1]
    assert kernels.INT4PACK_MM in target_kernels.split(" ")[0].split("+")


def test_an_int4_draft_of_a_float_target_keeps_the_targets_tokens(tiny_llama_dir):
    draft = DraftSpec(kind="quantized", dtype="int4")
    speculative = engine_for(tiny_llama_dir, draft=draft, num_draft_tokens=4)
    plain = engine_for(tiny_llama_dir)
    prompts, params = varied_prompts(6), SAMPLING["plain"]
    assert [c.token_ids for c in speculative.generate(prompts, params)] == [
        c.token_ids for c in plain.generate(prompts, params)]
    assert speculative.stats.accepted > 0
    draft_kernels = speculative.hardware_info["cpu_kernels"].split("draft=")[1].split("+")
    assert kernels.INT4PACK_MM in draft_kernels  # beside fp32-compute where bf16 is not packed


def test_without_the_int4_kernel_the_same_weights_run_in_fp32(tiny_llama_dir, caplog):
    """The probe's fallback: CORPUSGEN_DISABLE_KERNELS=int4pack-mm (or a failed probe) logs
    why, and the dequantized 4-bit weights run in fp32: the kernel's tokens here."""
    prompts, params = varied_prompts(6), SamplingParams(max_new_tokens=16)
    kernel = engine_for(tiny_llama_dir, target=int4_spec(tiny_llama_dir))
    with caplog.at_level(logging.WARNING, "corpusgen.kernels"), \
            kernels.disabled(kernels.INT4PACK_MM):
        fallback = engine_for(tiny_llama_dir, target=int4_spec(tiny_llama_dir))
        assert kernels.int4pack_mm().reason == f"disabled by {kernels.DISABLE_ENV}"
    assert "kernel int4pack-mm unavailable, using the fallback" in caplog.text
    linears = {type(m) for n, m in fallback.target.model.named_modules() if n.endswith("proj")}
    assert linears == {RowExactLinear}
    assert fallback.hardware_info["cpu_kernels"] == f"target={row_exact_kernel()}"
    assert [c.token_ids for c in fallback.generate(prompts, params)] == [
        c.token_ids for c in kernel.generate(prompts, params)]


def test_int4_needs_bf16_activations_and_a_quantized_target_no_quantized_copy():
    for quantize in ("int4", "int4+int8"):
        with pytest.raises(ValueError, match=re.escape(f"quantize: {quantize} multiplies bf16")):
            ModelSpec(path="m", quantize=quantize)
    int4 = ModelSpec(path="m", dtype="bfloat16", quantize="int4")
    assert int4.name == "m#int4"
    assert ModelSpec(path="m", dtype="bfloat16", quantize="int4+int8").name == "m#int4+int8"
    with pytest.raises(ValueError, match=r"the target is already int4; use draft\.kind: model"):
        EngineConfig(target=int4, draft=DraftSpec(kind="quantized", dtype="int8"))


@pytest.mark.slow
@needs_int8pack
def test_int4_int8_runs_smollm2s_q8_0_head_int8_and_keeps_the_engines_promises(smollm2_spec):
    """quantize: int4+int8 on SmolLM2's GGUF: its Q4_1 projections int4, its Q8_0 head int8
    per channel. Logits against the same weights multiplied in fp32 (the fallback's), within
    1.5 % of the largest (bf16 activations through 30 layers); seeded records the same alone,
    in a batch, and under a model draft at fixed and auto K."""
    spec = smollm2_spec.model_copy(update={"dtype": "bfloat16", "quantize": "int4+int8"})
    plain = engine_for(spec.path, target=spec)
    model = plain.target.model
    assert type(model.lm_head) is Int8WeightOnlyLinear
    assert {type(m) for n, m in model.named_modules() if n.endswith("_proj")} == {Int4Linear}
    assert plain.model_info["target_model"] == f"{spec.path}#int4+int8"
    assert kernels.INT8PACK_MM in plain.hardware_info["cpu_kernels"]

    with kernels.disabled(kernels.INT8PACK_MM):
        reference = engine_for(spec.path, target=spec)
    assert kernels.INT8PACK_MM not in reference.hardware_info["cpu_kernels"]
    prompts = [plain.encode(text) for text in varied_prompts(3)]
    logits = {}
    for name, engine in (("kernel", plain), ("reference", reference)):
        prefill = engine.target.prefill(prompts, [0, 1, 2])
        lengths = torch.tensor([len(p) for p in prompts])
        step = engine.target.decode(prefill.argmax(-1)[:, None], lengths, 3)
        logits[name] = prefill, step
    for got, expected in zip(logits["kernel"], logits["reference"], strict=True):
        scale = float(expected.abs().max())
        assert float((got - expected).abs().max()) < 0.015 * scale  # measured 0.3-0.5 %
        assert torch.equal(got.argmax(-1), expected.argmax(-1))

    assert_seeded_records_hold_under_an_int8_draft(spec, plain, smollm2_spec)
