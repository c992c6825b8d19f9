"""The engine on the CPUs people have: each fast kernel is probed before use, and every
fallback runs here whatever this machine's CPU.

Two ways to leave the fast paths: CORPUSGEN_DISABLE_KERNELS turns them off on any CPU, and
QEMU's user-mode emulator with `-cpu Haswell` presents an AVX2-only CPU to the cpuid checks of
torch and oneDNN, so the prepacked bf16 kernel refuses with the very error an AVX2 AMD EPYC
gives, and the engine must fall back on its own.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_helpers import engine_for
from portable_engine_check import main as check_portable_engine

from generation import kernels
from generation.kernels import KernelUnavailable
from generation.packing import Fp32ComputeLinear, row_exact_kernel
from schemas import DraftSpec, ModelSpec

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def disabled_kernels(monkeypatch):
    """Set CORPUSGEN_DISABLE_KERNELS for one test, with every probe asked afresh."""

    def disable(names: str) -> None:
        monkeypatch.setenv(kernels.DISABLE_ENV, names)
        for probe in kernels.PROBES:
            probe.cache_clear()

    yield disable
    monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
    for probe in kernels.PROBES:
        probe.cache_clear()


def test_a_disabled_kernel_reports_why_and_an_unknown_name_is_refused(disabled_kernels):
    disabled_kernels(f"{kernels.ONEDNN_PACKED_BF16}, {kernels.INT_MM}")
    assert kernels.packed_bf16() == kernels.Probe(False, f"disabled by {kernels.DISABLE_ENV}")
    assert not kernels.int_mm().available
    disabled_kernels("avx512")
    with pytest.raises(ValueError, match="unknown kernels \\['avx512'\\]; known: onednn-packed"):
        kernels.packed_bf16()


def test_the_cpu_is_named_by_model_and_isa():
    hardware = kernels.hardware()
    assert hardware["cpu_model"] and hardware["torch_version"].startswith("2.")
    level, *extensions = hardware["cpu_isa"].split()
    assert level in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "SVE256")
    assert set(extensions) <= set(kernels.ISA_PROBES)


def exact_int8_kernel() -> str:
    """The kernel an int8 target runs here: fbgemm's (8-bit weights where their sums are
    int32), else torch._int_mm."""
    if not kernels.fbgemm_int8_rows_exact().available:
        return kernels.INT_MM
    return kernels.fbgemm_int8_rows_kernel()


def test_without_the_packed_kernel_a_bf16_engine_runs_torchs_linear_and_stays_exact(
    disabled_kernels, tiny_llama_small_vocab_dir
):
    """As on a CPU without AVX-512: bf16 targets and drafts compute their linears in fp32;
    greedy and seeded speculation still give plain decoding's tokens, with every draft."""
    disabled_kernels(kernels.ONEDNN_PACKED_BF16)
    result = check_portable_engine(str(tiny_llama_small_vocab_dir))
    target = row_exact_kernel()
    assert result["kernels"] == {
        "plain": f"target={target}",
        "quantized-bf16": f"target={target} draft=fp32-compute",
        "quantized-int8": f"target={target} draft=fbgemm-int8",
        "int4-target": "target=" + "+".join(sorted([kernels.INT4PACK_MM, target])),
        "int8-target": f"target={exact_int8_kernel()}",
    }
    assert all(result["identical"].values()), result["identical"]
    assert all(result["rounds"].values()), result["rounds"]


def test_an_int8_draft_without_fbgemm_is_refused_naming_the_kernel_and_the_way_out(
    disabled_kernels, tiny_llama_dir
):
    disabled_kernels(kernels.FBGEMM_INT8)
    with pytest.raises(KernelUnavailable, match="an int8 draft needs a kernel") as refused:
        engine_for(tiny_llama_dir, draft=DraftSpec(kind="quantized", dtype="int8"))
    assert "CPU: " in str(refused.value) and "draft.kind: prompt_lookup" in str(refused.value)
    bf16_draft = engine_for(tiny_llama_dir, draft=DraftSpec(kind="quantized", dtype="bfloat16"))
    draft_kernel = bf16_draft.hardware_info["cpu_kernels"].split("draft=")[1]
    assert draft_kernel in (kernels.ONEDNN_PACKED_BF16, "fp32-compute")




def test_an_int8_target_without_an_exact_int8_gemm_is_refused(disabled_kernels, tiny_llama_dir):
    """Either exact kernel will do (each alone is tested in test_speculative); with neither,
    the refusal names both and the way out."""
    target = ModelSpec(path=str(tiny_llama_dir), quantize="int8")
    disabled_kernels(kernels.FBGEMM_INT8_ROWS)
    if kernels.int_mm().available:
        assert engine_for(tiny_llama_dir, target=target).hardware_info["cpu_kernels"] == \
            f"target={kernels.INT_MM}"
    disabled_kernels(f"{kernels.FBGEMM_INT8_ROWS},{kernels.INT_MM}")
    with pytest.raises(KernelUnavailable, match=r"an int8 target .*fbgemm: disabled .*"
                       r"torch._int_mm: disabled .*\(remove quantize\)"):
        engine_for(tiny_llama_dir, target=target)


def test_the_fallback_keeps_bf16_weights_values_and_computes_in_fp32():
    torch.manual_seed(0)
    bf16 = torch.nn.Linear(96, 160).to(torch.bfloat16)
    linear = Fp32ComputeLinear(bf16)
    assert linear.weight.dtype == torch.float32
    assert torch.equal(linear.weight, bf16.weight.float())  # the bf16 model's values
    x = torch.randn(5, 96).to(torch.bfloat16)
    expected = torch.nn.functional.linear(x.float(), bf16.weight.float(), bf16.bias.float())
    assert torch.equal(linear(x), expected.to(torch.bfloat16))


QEMU = shutil.which("qemu-x86_64")


def portable_check(model_dir: Path, prefix: list[str], caps: dict[str, str],
                   *flags: str) -> tuple[dict, str]:
    """portable_engine_check.py in a child process (under `prefix`, with `caps` set): its
    JSON result and its log."""
    # this checkout first, not whatever the venv has installed (a worktree beside it)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)]),
           "OMP_NUM_THREADS": "1", **caps}
    env.pop(kernels.DISABLE_ENV, None)
    done = subprocess.run(
        [*prefix, sys.executable, str(TESTS / "portable_engine_check.py"), str(model_dir),
         *flags],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 ISA caps")
def test_with_each_library_capped_at_avx2_the_engine_falls_back_and_stays_exact(
    tiny_llama_small_vocab_dir,
):
    """MKL and torch's kernels change their summation order with the ISA, so the fallback's
    exactness (speculation = plain decoding, greedy and seeded) is checked on AVX2 code too."""
    result, log = portable_check(tiny_llama_small_vocab_dir, [], kernels.AVX2_CAPS)
    assert result["cpu_isa"].startswith("AVX2 ")
    assert "avx512bw" in result["probes"][kernels.ONEDNN_PACKED_BF16]
    assert result["probes"][kernels.ONEDNN_PACKED_FP32] == "probe passed"
    assert result["kernels"]["plain"] == f"target={kernels.ONEDNN_PACKED_FP32}"
    assert result["probes"][kernels.FBGEMM_INT8_ROWS] == "probe passed"  # fbgemm's AVX2 code
    assert "saturates" in result["probes"][kernels.FBGEMM_INT8_WHOLE]  # no VNNI: 7-bit weights
    assert result["kernels"]["int8-target"] == f"target={kernels.FBGEMM_INT8_ROWS}"
    assert all(result["identical"].values()), result["identical"]
    assert "kernel onednn-packed-bf16 unavailable, using the fallback" in log


@pytest.mark.slow
@pytest.mark.skipif(
    QEMU is None,
    reason="needs qemu-user to emulate an AVX2-only CPU: bash tests/ensure_debian_packages.sh "
    "(make test runs it)",
)
def test_on_an_emulated_avx2_only_cpu_the_bf16_engine_falls_back_and_stays_exact(
    tiny_llama_small_vocab_dir,
):
    """The real refusal, not a switch: under `qemu-x86_64 -cpu Haswell` oneDNN's prepacked
    bf16 kernel raises its AVX-512 error in the probe, and the same checks as above pass."""
    result, log = portable_check(tiny_llama_small_vocab_dir, [QEMU, "-cpu", "Haswell"], {},
                                 "--greedy-only")
    assert result["cpu_isa"] == "AVX2 avx2"
    assert "avx512bw" in result["probes"][kernels.ONEDNN_PACKED_BF16]
    assert result["probes"][kernels.FBGEMM_INT8] == "probe passed"
    assert result["probes"][kernels.ONEDNN_PACKED_FP32] == "probe passed"  # its AVX2 path
    assert result["kernels"]["quantized-int8"] == "target=onednn-packed-fp32 draft=fbgemm-int8"
    assert result["probes"][kernels.INT4PACK_MM] == "probe passed"  # its AVX2 path
    assert result["probes"][kernels.INT8PACK_MM] == "probe passed"  # its AVX2 path
    assert result["kernels"]["int4-target"] == "target=int4pack-mm+onednn-packed-fp32"
    assert result["probes"][kernels.FBGEMM_INT8_ROWS] == "probe passed"  # 7-bit weights
    assert "saturates" in result["probes"][kernels.FBGEMM_INT8_WHOLE]  # no VNNI: 7-bit weights
    assert result["kernels"]["int8-target"] == f"target={kernels.FBGEMM_INT8_ROWS}"
    assert all(result["identical"].values()), result["identical"]
    assert "kernel onednn-packed-bf16 unavailable, using the fallback" in log


def _inductor_has_avx2() -> bool:
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    return any(str(isa) == "avx2" for isa in valid_vec_isa_list())


@pytest.mark.skipif(not _inductor_has_avx2(), reason="needs AVX2: two vector widths to pick")
def test_a_graph_compiled_under_one_isa_cap_is_not_reused_under_another(monkeypatch):
    """Inductor's graph cache on disk left out the vector width it picked from
    ATEN_CPU_CAPABILITY: a graph cached by a native AVX-512 process ran under AVX2 caps with
    16-lane code built as 8-lane and read out of bounds. Compiled under AVX2 caps, then with
    vectorization off, the same graph must be compiled again, not found in the cache."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    from generation.runner import compile_for_this_cpu

    def scaled_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return x[rows] * 2.0 + 1.0

    x, rows = torch.arange(64.0).reshape(4, 16), torch.tensor([3, 0, 2])
    with fresh_cache():
        for capability in ("avx2", "default"):
            monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
            torch._dynamo.reset()
            counters.clear()
            compiled = torch.compile(scaled_rows, backend=compile_for_this_cpu, dynamic=False)
            assert torch.equal(compiled(x, rows), scaled_rows(x, rows))
            assert counters["inductor"]["fxgraph_cache_hit"] == 0, capability
            assert counters["inductor"]["fxgraph_cache_miss"] == 1, capability
