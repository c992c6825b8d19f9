"""Would llama.cpp's own kernels serve our target better? ggml's matrix product on the GGUF's
4/6-bit blocks against our int8 linear (fbgemm, exact integer sums), per kind of linear.

The Qwen 1.5B target's GGUF tensors as shipped (Q4_K, Q6_K) go through ggml's CPU backend
(`make peers-llama` builds it: libggml-base and libggml-cpu) by ctypes: one graph per row
count, `ggml_mul_mat` of the weights by fp32 rows, which ggml quantizes to 8 bits itself, as
llama.cpp does. Ours: the same weights dequantized, then `ExactInt8Linear` as `quantize: int8`
builds it. A pass runs one kind of linear (the FFN's gate, its down projection, attention's
query) of every layer in turn, as a decode step streams them from memory: one layer's matrix
alone would stay in cache between calls. Per row count (a decode step's 1 row, a K=1..4
verify's 2-5, batch 8), medians of a pass's milliseconds per layer, one thread, the two taking
turns. Also each one's relative error against the dequantized weights in fp32 (layer 0, random
rows) and whether a row's result is the same alone as among others (what speculation and
seeded records need of a target's kernel). Prints JSON.
Usage: python bench/ggml_kernels.py [--repeats 9] [--ggml-lib .peers/llama.cpp/build/bin]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from bench._common import machine
from bench.qwen_pair import TARGET
from generation.loading import packaged_gguf
from generation.quantize import ExactInt8Linear
from schemas.engine import PACKAGED_PREFIX

GGML_LIB = Path(__file__).resolve().parent.parent / ".peers" / "llama.cpp" / "build" / "bin"
KINDS = ("ffn_gate", "ffn_down", "attn_q")
ROWS = (1, 2, 3, 5, 8)
GGML_F32 = 0


class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


class ComputePlan(ctypes.Structure):  # ggml-cpu.h: struct ggml_cplan
    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", ctypes.c_void_p),
                ("n_threads", ctypes.c_int), ("threadpool", ctypes.c_void_p),
                ("abort_callback", ctypes.c_void_p), ("abort_callback_data", ctypes.c_void_p),
                ("use_ref", ctypes.c_bool)]


def ggml(lib_dir: Path):
    """ggml's base and CPU libraries with the signatures used here."""
    pointer = ctypes.c_void_p
    base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    signatures = {
        (base, "ggml_init"): ([InitParams], pointer),
        (base, "ggml_new_tensor_2d"): ([pointer, ctypes.c_int, ctypes.c_int64, ctypes.c_int64],
                                       pointer),
        (base, "ggml_get_data"): ([pointer], pointer),
        (base, "ggml_mul_mat"): ([pointer, pointer, pointer], pointer),
        (base, "ggml_new_graph"): ([pointer], pointer),
        (base, "ggml_build_forward_expand"): ([pointer, pointer], None),
        (base, "ggml_free"): ([pointer], None),
        (cpu, "ggml_graph_plan"): ([pointer, ctypes.c_int, pointer], ComputePlan),
        (cpu, "ggml_graph_compute"): ([pointer, ctypes.POINTER(ComputePlan)], ctypes.c_int),
        (cpu, "ggml_cpu_init"): ([], None),
    }
    for (library, name), (arguments, result) in signatures.items():
        function = getattr(library, name)
        function.argtypes, function.restype = arguments, result
    cpu.ggml_cpu_init()
    return base, cpu


class GgmlLinear:
    """One GGUF weight tensor in a ggml context, with a prepared graph per row count."""

    def __init__(self, libs, raw: np.ndarray, kind: int, in_features: int, out_features: int):
        self.base, self.cpu = libs
        self.in_features, self.out_features = in_features, out_features
        room = raw.nbytes + 8 * 2**20 + 2 * sum(ROWS) * 4 * (in_features + out_features)
        self.context = self.base.ggml_init(InitParams(room, None, False))
        self.weight = self.base.ggml_new_tensor_2d(self.context, kind, in_features, out_features)
        ctypes.memmove(self.base.ggml_get_data(self.weight), raw.ctypes.data, raw.nbytes)
        self.graphs: dict[int, tuple] = {}

    def _graph(self, rows: int):
        if rows not in self.graphs:
            base = self.base
            x = base.ggml_new_tensor_2d(self.context, GGML_F32, self.in_features, rows)
            y = base.ggml_mul_mat(self.context, self.weight, x)
            graph = base.ggml_new_graph(self.context)
            base.ggml_build_forward_expand(graph, y)
            plan = self.cpu.ggml_graph_plan(graph, 1, None)
            work = (ctypes.c_uint8 * max(plan.work_size, 1))()
            plan.work_data = ctypes.cast(work, ctypes.c_void_p)
            self.graphs[rows] = (x, y, graph, plan, work)
        return self.graphs[rows]

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        x, y, graph, plan, _ = self._graph(len(rows))
        rows = rows.float().contiguous()
        ctypes.memmove(self.base.ggml_get_data(x), rows.data_ptr(), rows.numel() * 4)
        if self.cpu.ggml_graph_compute(graph, ctypes.byref(plan)) != 0:
            raise RuntimeError("ggml_graph_compute failed")
        out = torch.empty(len(rows), self.out_features)
        ctypes.memmove(out.data_ptr(), self.base.ggml_get_data(y), out.numel() * 4)
        return out

    def close(self) -> None:
        self.base.ggml_free(self.context)


def pass_ms(linears: list, x: torch.Tensor) -> float:
    """Milliseconds per layer of one pass over every layer's linear."""
    started = time.perf_counter()
    for linear in linears:
        linear(x)
    return (time.perf_counter() - started) * 1e3 / len(linears)


def rows_alone_alike(function, x: torch.Tensor) -> bool:
    """Each row's result alone equals its result among the others."""
    together = function(x)
    return all(torch.equal(function(x[i : i + 1])[0], together[i]) for i in range(len(x)))


def both_linears(libs, tensor) -> tuple[GgmlLinear, ExactInt8Linear, torch.Tensor]:
    """One GGUF tensor in ggml and as our int8 linear, and its dequantized fp32 weights."""
    from gguf import dequantize

    in_features, out_features = int(tensor.shape[0]), int(tensor.shape[1])
    weight = torch.from_numpy(
        dequantize(tensor.data, tensor.tensor_type).reshape(out_features, in_features)).float()
    theirs = GgmlLinear(libs, np.ascontiguousarray(tensor.data), int(tensor.tensor_type),
                        in_features, out_features)
    linear = nn.Linear(in_features, out_features, bias=False)
    linear.weight.data = weight
    return theirs, ExactInt8Linear(linear), weight


def compare(libs, tensors: list, repeats: int, generator: torch.Generator) -> dict:
    built = [both_linears(libs, tensor) for tensor in tensors]
    contenders = {"ggml": [b[0] for b in built], "ours_int8": [b[1] for b in built]}
    first_theirs, first_ours, weight = built[0]
    per_rows = {}
    for rows in ROWS:
        x = torch.randn(rows, weight.shape[1], generator=generator)
        reference = x @ weight.t()
        with torch.inference_mode():
            times = {key: [] for key in contenders}
            for _ in range(repeats):  # take turns, so drift hits both
                for key, linears in contenders.items():
                    times[key].append(pass_ms(linears, x))
            per_rows[rows] = {
                "ms_per_layer": {key: round(statistics.median(v), 3) for key, v in times.items()},
                "relative_error": {
                    key: round(float((f(x) - reference).norm() / reference.norm()), 5)
                    for key, f in (("ggml", first_theirs), ("ours_int8", first_ours))},
                "rows_alone_alike": {key: rows_alone_alike(f, x) for key, f in
                                     (("ggml", first_theirs), ("ours_int8", first_ours))},
            }
    one = per_rows[1]["ms_per_layer"]
    result = {
        "ggml_type": tensors[0].tensor_type.name, "shape": list(weight.shape),
        "layers": len(tensors), "our_kernel": first_ours.kernel, "rows": per_rows,
        "cost_over_one_row": {key: {rows: round(per_rows[rows]["ms_per_layer"][key] / one[key], 2)
                                    for rows in ROWS} for key in one},
    }
    for theirs, _, _ in built:
        theirs.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--ggml-lib", type=Path, default=GGML_LIB,
                        help="libggml-base.so and libggml-cpu.so (make peers-llama)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from gguf import GGUFReader

    libs = ggml(args.ggml_lib)
    reader = GGUFReader(str(packaged_gguf(TARGET.path.removeprefix(PACKAGED_PREFIX))))
    generator = torch.Generator().manual_seed(0)
    results = {}
    for kind in KINDS:
        tensors = [t for t in reader.tensors
                   if t.name.startswith("blk.") and t.name.endswith(f".{kind}.weight")]
        results[kind] = compare(libs, tensors, args.repeats, generator)
    print(json.dumps({"machine": machine(), "ggml_lib": str(args.ggml_lib),
                      "repeats": args.repeats, "linears": results}, indent=2))


if __name__ == "__main__":
    main()
