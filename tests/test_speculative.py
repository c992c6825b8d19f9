"""Speculative decoding: exact greedy outputs, the target's distribution under sampling,
per-row acceptance accounting and static shapes while K and acceptance vary."""

from __future__ import annotations

import itertools

import pytest
import torch
from engine_helpers import (
    DRAFT_NAMES,
    SMALL_GRID,
    drafts,
    engine_for,
    hf_greedy,
    needs_exact_int8,
    varied_prompts,
)
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from generation import kernels, quantize
from generation.draft_length import DraftStopper, FixedDraftLength
from generation.phase import prefilling
from generation.quantize import ExactInt8Linear, Int8Linear
from schemas import DraftSpec, ModelSpec, SamplingParams

BATCH_1_AND_8 = SMALL_GRID.model_copy(update={"batch_sizes": [1, 8]})
BATCH_1_ONLY = SMALL_GRID.model_copy(update={"batch_sizes": [1]})


@pytest.mark.parametrize("grid", [BATCH_1_ONLY, BATCH_1_AND_8], ids=["batch1", "batch8"])
@pytest.mark.parametrize("draft", DRAFT_NAMES)
def test_greedy_speculation_is_token_identical(draft, grid, tiny_llama_dir, tiny_llama_other_dir):
    prompts = [*varied_prompts(10), "the cat sat on the mat the cat sat on the mat the cat"]
    params = SamplingParams(max_new_tokens=14)
    plain = engine_for(tiny_llama_dir, bucket_grid=grid).generate(prompts, params)
    spec = drafts(tiny_llama_dir, tiny_llama_other_dir)[draft]
    engine = engine_for(tiny_llama_dir, bucket_grid=grid, draft=spec, num_draft_tokens=4)
    completions = engine.generate(prompts, params)
    assert [c.token_ids for c in completions] == [c.token_ids for c in plain]
    stats = engine.stats
    assert stats.proposed > 0 and stats.rounds > 0
    assert stats.proposed == sum(c.proposed for c in completions)
    assert stats.accepted == sum(c.accepted for c in completions)
    assert stats.acceptance_rate == stats.accepted / stats.proposed
    assert stats.mean_accepted_length == 1 + stats.accepted / stats.rounds
    if draft == "same-model":
        assert stats.acceptance_rate == 1.0
    if draft == "independent-model":
        assert stats.acceptance_rate < 0.5  # ragged: rows keep different numbers of tokens
        assert len({c.accepted for c in completions}) > 1
    if draft == "independent-model-int8":  # the draft really runs int8 linears
        assert isinstance(engine.proposer.runner.model.model.layers[0].mlp.down_proj, Int8Linear)
        assert engine.model_info["draft_model"] == f"{tiny_llama_other_dir}#int8"


def test_greedy_speculation_matches_transformers(tiny_llama_dir, tiny_llama_other_dir):
    prompts = varied_prompts(9)
    spec = DraftSpec(kind="model", model=ModelSpec(path=str(tiny_llama_other_dir)))
    engine = engine_for(tiny_llama_dir, draft=spec, num_draft_tokens=2)
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=10))
    assert [c.token_ids for c in completions] == hf_greedy(tiny_llama_dir, engine, prompts, 10)


def test_per_position_acceptance_is_monotone_and_consistent(tiny_llama_dir):
    engine = engine_for(
        tiny_llama_dir, draft=DraftSpec(kind="quantized", dtype="int8"), num_draft_tokens=4
    )
    completions = engine.generate(varied_prompts(6), SamplingParams(max_new_tokens=16))
    stats = engine.stats
    accepted = stats.accepted_per_position
    assert len(accepted) == 4 == len(stats.proposed_per_position)
    assert all(a >= b for a, b in itertools.pairwise(accepted))
    assert sum(accepted) == stats.accepted
    for completion in completions:
        assert sum(completion.accepted_per_position) == completion.accepted


def test_no_new_shape_after_warmup_while_k_and_acceptance_vary(
    tiny_llama_dir, tiny_llama_other_dir
):
    spec = DraftSpec(kind="model", model=ModelSpec(path=str(tiny_llama_other_dir)))
    engine = engine_for(tiny_llama_dir, draft=spec, num_draft_tokens="auto")
    engine.warmup()
    target_shapes, draft_shapes = set(engine.target.shapes), set(engine.proposer.runner.shapes)
    prompts = [*varied_prompts(11), "word " * 20]
    engine.generate(prompts, SamplingParams(max_new_tokens=40, temperature=0.8, seed=1))
    auto = engine.draft_length
    for k in SMALL_GRID.draft_lengths:  # force every K, then back to auto
        engine.draft_length = FixedDraftLength(k)
        engine.generate(prompts[:5], SamplingParams(max_new_tokens=12))
    engine.draft_length = auto
    engine.generate(prompts, SamplingParams(max_new_tokens=30))
    assert set(engine.target.shapes) == target_shapes
    assert set(engine.proposer.runner.shapes) == draft_shapes
    assert {2, 4} <= set(engine.stats.steps_per_k)


def test_draft_with_another_tokenizer_is_refused(tiny_llama_dir, tmp_path):
    other = tiny_vocab_model(tmp_path / "other", seed=0)
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        engine_for(tiny_llama_dir, draft=DraftSpec(kind="model", model=ModelSpec(path=str(other))))


# ---- the distribution test ---------------------------------------------------------------
VOCAB = 16


def tiny_vocab_model(root, seed: int, scale: float = 8.0):
    """A random 16-token Llama with a word-level tokenizer, saved as an HF directory."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.mul_(scale)
    model.save_pretrained(root)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(root)
    return root


def exact_pair_distribution(model_dir, prompt: list[int], temperature: float) -> torch.Tensor:
    """P(x2, x3) of the target's sampling, marginalised over x1, by enumeration: [16, 16]."""
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()

    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.softmax(model(prefixes).logits[:, -1].double() / temperature, -1)

    base = torch.tensor([prompt])
    p1 = next_probs(base)[0]  # [16]
    one = torch.cat([base.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], 1)
    p2 = next_probs(one)  # [x1, x2]
    two = torch.cat(
        [one.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(VOCAB)[:, None]], 1
    )
    p3 = next_probs(two).view(VOCAB, VOCAB, VOCAB)  # [x1, x2, x3]
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit, cells with expected count < 5 pooled into one."""
    expected = probs.flatten() * counts.sum()
    observed = counts.flatten().double()
    small = expected < 5
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2))


PROMPT, TEMPERATURE, SAMPLES = [3, 5, 7], 1.0, 30_000
FALSE_ALARM = 1e-3


@pytest.fixture(scope="module")
def vocab16_pair(tmp_path_factory):
    """A 16-token target, an independent 16-token draft, and both exact (x2, x3) distributions."""
    root = tmp_path_factory.mktemp("vocab16")
    target_dir = tiny_vocab_model(root / "target", seed=11)
    draft_dir = tiny_vocab_model(root / "draft", seed=12)
    exact = exact_pair_distribution(target_dir, PROMPT, TEMPERATURE)
    draft_exact = exact_pair_distribution(draft_dir, PROMPT, TEMPERATURE)
    assert 0.5 * (exact - draft_exact).abs().sum() > 0.25  # the draft clearly differs
    return target_dir, draft_dir, exact, draft_exact


def shifted_by(exact: torch.Tensor, towards: torch.Tensor, total_variation: float):
    """`exact` with `total_variation` of its mass moved towards another distribution."""
    distance = 0.5 * (exact - towards).abs().sum()
    return exact + total_variation / distance * (towards - exact)


def test_chi_square_test_detects_a_two_percent_shift(vocab16_pair):
    """Power check: with SAMPLES draws, a sampler 2 % (total variation) off the target, towards
    the draft, fails the test below nearly always, and an exact one passes it."""
    _, _, exact, draft_exact = vocab16_pair
    shifted = shifted_by(exact, draft_exact, 0.02)
    generator = torch.Generator().manual_seed(0)

    def counts(probs: torch.Tensor) -> torch.Tensor:
        draws = torch.multinomial(probs.flatten(), SAMPLES, replacement=True, generator=generator)
        return draws.bincount(minlength=VOCAB * VOCAB).view(VOCAB, VOCAB)

    trials = 60
    detected = sum(chi_square_p_value(counts(shifted), exact) < FALSE_ALARM for _ in range(trials))
    passed = sum(chi_square_p_value(counts(exact), exact) > FALSE_ALARM for _ in range(trials))
    assert detected >= 0.9 * trials and passed >= 0.95 * trials


# Coupled sampling with any draft returns plain sampling's tokens exactly (every draft kind:
# tests/test_seeded_sampling.py), so one drafted coupled case stands for the others here.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("draft", "verification"),
    [
        ("none", "coupled"),
        ("independent-model", "coupled"),
        ("independent-model", "rejection"),
        ("independent-model", "rejection-stopped-early"),
    ],
)
def test_sampling_keeps_the_target_distribution(draft, verification, vocab16_pair, monkeypatch):
    """SAMPLES seeded samples of (x2, x3) against the target's exact distribution. Stopped
    early: K auto, rounds that draft 2 or 4 tokens as the draft's own confidence decides."""
    target_dir, draft_dir, exact, draft_exact = vocab16_pair
    grid = SMALL_GRID.model_copy(update={"batch_sizes": [64], "prompt_lengths": [4]})
    spec = None if draft == "none" else drafts(target_dir, draft_dir)[draft]
    stopped_early = verification == "rejection-stopped-early"
    k = "auto" if stopped_early else 2
    engine = engine_for(target_dir, bucket_grid=grid, num_draft_tokens=k, draft=spec)
    if stopped_early:
        verification = "rejection"
        monkeypatch.setattr(engine.draft_length.chooser, "choose", lambda *args: 2)
        priced = DraftStopper.keep_going

        def by_the_first_rows_confidence(self, drafted, confidence):
            priced(self, drafted, confidence)  # still records the round for calibration
            return drafted != 2 or bool(confidence[0] > 0.1)

        monkeypatch.setattr(DraftStopper, "keep_going", by_the_first_rows_confidence)
    params = SamplingParams(max_new_tokens=3, temperature=TEMPERATURE, verification=verification)
    completions = engine.generate([PROMPT] * SAMPLES, params, seeds=list(range(SAMPLES)))
    counts = torch.zeros(VOCAB, VOCAB)
    for completion in completions:
        counts[completion.token_ids[1], completion.token_ids[2]] += 1
    stats = engine.stats
    if draft == "independent-model":  # both acceptance and rejection paths exercised
        assert 0.1 < stats.acceptance_rate < 0.9
    if spec is not None:
        assert stats.accepted_per_position[1] > 0  # bonus tokens after full acceptance happened
    if stopped_early:
        assert min(stats.steps_per_k.get(2, 0), stats.steps_per_k.get(4, 0)) > 50
    assert chi_square_p_value(counts, exact) > FALSE_ALARM
    assert chi_square_p_value(counts, draft_exact) < 1e-9  # not the draft's distribution


@pytest.mark.parametrize("rows", [1, 300], ids=["fbgemm-rows", "dense-rows"])
def test_int8_linear_with_bias_follows_a_bf16_linear(rows):
    """A bf16 draft with biased projections (Qwen2's qkv): both kernels, few rows through
    fbgemm and a prefill's many rows through the dequantized dense product, track the
    original linear to int8 precision."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    expected = linear(x).float()
    got = Int8Linear(linear)(x)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    error = (got.float() - expected).norm() / expected.norm()
    assert error < 0.03


@pytest.mark.slow
def test_compiled_int8_linears_stay_in_one_graph_and_equal_eager():
    """fbgemm's packed weights are a TorchScript object that dynamo cannot trace: without the
    handle op, each Int8Linear splits the graph and compiling an int8 draft gains nothing."""
    torch.manual_seed(0)
    layers = torch.nn.Sequential(
        Int8Linear(torch.nn.Linear(64, 128)), torch.nn.SiLU(), Int8Linear(torch.nn.Linear(128, 32))
    )
    x = torch.randn(3, 64)
    with torch.inference_mode():
        explained = torch._dynamo.explain(layers)(x)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0)
        assert torch.equal(torch.compile(layers)(x), layers(x))


@pytest.mark.slow
def test_a_deep_copied_int8_linear_compiles_with_its_own_packed_weights():
    """quantized_copy deep-copies a model: the copy's handle must name the copy's packed
    weights, which outlive the original's."""
    import copy
    import gc

    original = Int8Linear(torch.nn.Linear(64, 32))
    copied = copy.deepcopy(original)
    del original
    gc.collect()
    x = torch.randn(2, 64)
    with torch.inference_mode():
        assert torch.equal(torch.compile(copied)(x), copied(x))


EXACT_INT8_KERNELS = {  # each exact kernel: its probe, and the fast paths off so it runs alone
    kernels.FBGEMM_INT8_WHOLE: (kernels.fbgemm_int8_whole, [kernels.INT_MM]),
    kernels.FBGEMM_INT8_ROWS: (kernels.fbgemm_int8_rows_exact,
                               [kernels.FBGEMM_INT8_WHOLE, kernels.INT_MM]),
    kernels.INT_MM: (kernels.int_mm, [kernels.FBGEMM_INT8_ROWS]),
}
FBGEMM_KERNELS = [kernels.FBGEMM_INT8_WHOLE, kernels.FBGEMM_INT8_ROWS]


@pytest.mark.parametrize("kernel", EXACT_INT8_KERNELS)
def test_exact_int8_linear_is_row_invariant_and_close(kernel, monkeypatch):
    """With each exact kernel, a row's output is bitwise the same alone or among 8
    neighbours (decode), and both the integer product and the prefill's product track the
    float linear; fbgemm's prefill is the very integer product."""
    probe, others = EXACT_INT8_KERNELS[kernel]
    with kernels.disabled(*others):
        if not probe().available:
            pytest.skip(f"{kernel}: {probe().reason}")
        torch.manual_seed(0)
        linear = torch.nn.Linear(64, 48, bias=True)
        exact = ExactInt8Linear(linear)
        assert exact.kernel == kernel
        x = torch.randn(8, 3, 64)
        assert torch.equal(exact(x)[2:3, :1], exact(x[2:3, :1]))
        expected = linear(x)
        for got in (exact(x), _prefilled(exact, x)):
            assert (got - expected).norm() / expected.norm() < 0.03
        if kernel != kernels.INT_MM:
            assert torch.equal(_prefilled(exact, x), exact(x))


@needs_exact_int8
def test_smoothing_moves_an_outlier_channels_rounding_into_the_weights():
    """Rows whose channel 5 is 50x the others: per-row codes give that channel most of the
    126 steps. SmoothQuant's factors (max|x|^0.5 / max|W|^0.5 per channel) even the channels
    out, and the product keeps its value (x / s times W * s)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True)
    x = torch.randn(16, 64)
    x[:, 5] *= 50
    smoothing = (x.abs().amax(0) ** 0.5 / linear.weight.detach().abs().amax(0) ** 0.5)
    with torch.no_grad():
        expected = linear(x)
        errors = [float((ExactInt8Linear(linear, s)(x) - expected).norm() / expected.norm())
                  for s in (None, smoothing)]
    assert errors[1] < errors[0] / 2, errors


@pytest.mark.parametrize("kernel", FBGEMM_KERNELS)
def test_fbgemm_int8_rows_sums_exactly_at_the_weights_and_codes_extremes(kernel):
    """Codes at +-126 times the widest weights each kernel stores: fbgemm's AVX2 code adds
    pairs of u8 x s8 products in int16, where 7-bit weights fit (254 x 64 x 2 = 32512) and
    8-bit ones would not (254 x 127 x 2), so those run only where the sums are int32 (VNNI).
    The emulated AVX2 runs of tests/test_portability.py probe the same extremes there."""
    probe, others = EXACT_INT8_KERNELS[kernel]
    limit = kernels.WEIGHT_CODE_LIMITS[kernel]
    with kernels.disabled(*others):
        if not probe().available:
            pytest.skip(f"{kernel}: {probe().reason}")
        weights = torch.full((16, 64), limit, dtype=torch.int8)
        weights[8:] = -limit
        scales = torch.full((16,), 0.5)
        codes = torch.tensor([[126.0] * 64, [-126.0] * 64, [125.0, -126.0] * 32])
        out = kernels.fbgemm_int8_rows(codes, kernels.fbgemm_prepack(weights, scales, None))
    assert torch.equal(out.double(), codes.double() @ weights.double().t() * 0.5)


@pytest.mark.parametrize("kernel", FBGEMM_KERNELS)
def test_an_exact_int8_linear_stores_weights_its_kernel_sums_without_saturating(kernel):
    """Every weight code within the kernel's limit, each output channel's largest at it (the
    scale uses every step)."""
    probe, others = EXACT_INT8_KERNELS[kernel]
    limit = kernels.WEIGHT_CODE_LIMITS[kernel]
    with kernels.disabled(*others):
        if not probe().available:
            pytest.skip(f"{kernel}: {probe().reason}")
        torch.manual_seed(0)
        exact = ExactInt8Linear(torch.nn.Linear(64, 48))
    assert exact.kernel == kernel
    stored, _ = torch.ops.quantized.linear_unpack(exact.packed)
    codes = stored.int_repr().abs()
    assert torch.equal(codes.amax(1), torch.full((48,), limit, dtype=codes.dtype))


def test_exact_int8_rows_padded_for_cudas_kernel_keep_their_results(monkeypatch):
    """CUDA's _int_mm needs more than 16 rows; a decode step's 1-8 rows are padded with zeros
    there. Padding (forced here on CPU) must give every real row the same result."""
    with kernels.disabled(kernels.FBGEMM_INT8_ROWS):
        if not kernels.int_mm().available:
            pytest.skip(kernels.int_mm().reason)
        torch.manual_seed(0)
        exact = ExactInt8Linear(torch.nn.Linear(64, 48, bias=True))
    x = torch.randn(3, 1, 64)
    unpadded = exact(x)
    monkeypatch.setitem(quantize.INT_MM_MIN_ROWS, "cpu", 17)
    assert torch.equal(exact(x), unpadded)


def _prefilled(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with prefilling():
        return module(x)
