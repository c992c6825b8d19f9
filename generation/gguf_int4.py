"""A GGUF's 4-bit tensors as int4 groups of 32 (int4.py), read from its blocks and cached.

Q4_0 (w = d (q - 8)), Q4_1 (w = d q + m) and Q4_K (w = d sc q - dmin mn for each 32 inputs of
a 256-block, sc and mn 6-bit) each give 32 consecutive inputs one scale and one offset, which
is what the int4 kernel's group of 32 holds: scale = d (or d sc), zero = offset + 8 scale. With
fp32 scales and zeros the codes give back the GGUF's weights as transformers dequantizes them,
bit for bit on SmolLM2's Q4_1 and Qwen 1.5B's Q4_K (checked on every tensor before the cache
is written). The kernel multiplies bf16 scales and zeros, which moves the weights by 0.19 % of
their RMS, about what rounding them to bf16 does (0.13-0.17 %): `bench/int4.py`,
`scale_rounding`.

Q5_0, Q6_K, Q8_0 and float tensors are not 4-bit groups; their linears stay bf16 (in int4.py
the ones not found here), or with quantize: int4+int8 are rounded to int8 per channel. bf16
keeps those weights to 3 significant digits, where torch's int8 weight-only kernel
(aten._weight_int8pack_mm, per channel) re-rounds 6-bit blocks; on the AVX-512 Xeon (1
thread) it ran Qwen 1.5B's Q6_K LM head faster than oneDNN's packed bf16 at 1 row (54.5 vs
71.5 ms) but slower at 8 (125.6 vs 66.0): bench/int4.py, `kept_lm_head_ms`.

The cache (CACHE_FILE under the GGUF's digest directory, in a folder of its own so that
nothing globbing the directory's `*.safetensors` takes it for fp32 weights) holds codes two
to a byte and fp32 scales and zeros by Hugging Face name, never the packed layout (which
depends on the CPU). Names and llama's q/k row order are transformers'
conversion's, checked against the fp32 weights it wrote, so a wrong mapping cannot pass.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from generation.int4 import Int4Weights

log = logging.getLogger("corpusgen.gguf_int4")

CACHE_FILE = "int4/blocks.safetensors"
BLOCK = 32
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Worst |dequantized codes - converted fp32 weight| accepted, over the tensor's largest weight:
# 0 measured (one fp32 rounding of the zero would be ~1e-7); a wrong name or row order is ~1.
MATCH_TOLERANCE = 1e-6


def _f16(raw: np.ndarray) -> np.ndarray:
    """[blocks, 2] bytes -> [blocks, 1] float32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(raw: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32] codes: the low nibbles are inputs 0-15 (ggml's order)."""
    return np.concatenate([raw & 15, raw >> 4], axis=-1)


def q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """18-byte blocks of 32 -> (codes [blocks, 32], scales, zeros [blocks, 1])."""
    d = _f16(blocks[:, :2])
    return _nibbles(blocks[:, 2:]), d, np.zeros_like(d)


def q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """20-byte blocks of 32: d, m, codes."""
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    return _nibbles(blocks[:, 4:]), d, m + 8 * d


def q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """144-byte blocks of 256: d, dmin, 8 packed 6-bit (scale, min) pairs, then 4 x 32 bytes
    whose low nibbles are one group of 32 and high nibbles the next. Returns codes [blocks,
    256] and scales, zeros [blocks, 8]."""
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    packed = blocks[:, 4:16].reshape(-1, 3, 4)  # ggml's get_scale_min_k4
    low, high, extra = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([low & 63, (extra & 15) | ((low >> 2) & 48)], axis=-1)
    mn = np.concatenate([high & 63, (extra >> 4) | ((high >> 2) & 48)], axis=-1)
    qs = blocks[:, 16:].reshape(-1, 4, 32)
    codes = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 256)
    scales = d * sc.astype(np.float32)
    return codes, scales, 8 * scales - dmin * mn.astype(np.float32)


DECODERS = {"Q4_0": (q4_0, 18), "Q4_1": (q4_1, 20), "Q4_K": (q4_k, 144)}


def hf_name(name: str) -> str | None:
    """The Hugging Face weight a GGUF tensor is (linears and the embedding), else None."""
    if name == "output.weight":
        return "lm_head.weight"
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if match and match[2] in LAYER_TENSORS:
        return f"model.layers.{match[1]}.{LAYER_TENSORS[match[2]]}.weight"
    return None


def _unpermuted(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for rotary halves (transformers' own inverse)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def read_4bit_tensors(gguf_path: Path) -> tuple[dict[str, Int4Weights], Counter]:
    """The GGUF's 4-bit linear weights by Hugging Face name, and the other linear tensors'
    types, counted (the embedding only where it is also the LM head)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    arch = reader.fields["general.architecture"].contents()
    heads = {
        "attn_q": reader.fields[f"{arch}.attention.head_count"].contents(),
        "attn_k": reader.fields[f"{arch}.attention.head_count_kv"].contents(),
    }
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    found, others = {}, Counter()
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None or (name == "model.embed_tokens.weight" and not tied):
            continue
        kind = tensor.tensor_type.name
        if kind not in DECODERS:
            others[kind] += 1
            continue
        decode, block_bytes = DECODERS[kind]
        out = tensor.data.shape[0]
        codes, scales, zeros = (a.reshape(out, -1) for a in decode(
            np.asarray(tensor.data).reshape(-1, block_bytes)))
        role = tensor.name.split(".")[-2]
        if arch == "llama" and role in heads:
            codes, scales, zeros = (_unpermuted(a, heads[role]) for a in (codes, scales, zeros))
        found[name] = Int4Weights.from_codes(
            torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(zeros))
    return found, others


def write_cache(gguf_path: Path, converted: dict[str, torch.Tensor], cache: Path) -> None:
    """Read the 4-bit tensors, check each against the fp32 weights the conversion wrote
    (`converted`, by Hugging Face name), and publish them to `cache` atomically."""
    from safetensors.torch import save_file

    found, others = read_4bit_tensors(gguf_path)
    tensors: dict[str, torch.Tensor] = {}
    for name, int4 in found.items():
        reference = converted[name].float()
        error = float((int4.dequantized() - reference).abs().max())
        if error > MATCH_TOLERANCE * float(reference.abs().max()):
            raise ValueError(
                f"{gguf_path.name}: {name}'s 4-bit blocks differ from its converted weights by "
                f"{error:.3g}; the GGUF's tensor names or row order are not as expected"
            )
        tensors |= {f"{name}.codes": int4.codes, f"{name}.scales": int4.scales,
                    f"{name}.zeros": int4.zeros}
    log.info("%s: %d linears in 4-bit groups; other linear tensors: %s", gguf_path.name,
             len(found), dict(others) or "none")
    cache.parent.mkdir(exist_ok=True)
    tmp = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, cache)  # a concurrent writer's copy is the same bytes


def read_cache(cache: Path) -> dict[str, Int4Weights]:
    from safetensors.torch import load_file

    tensors = load_file(cache)
    names = {key.rsplit(".", 1)[0] for key in tensors}
    return {name: Int4Weights(*(tensors[f"{name}.{part}"] for part in ("codes", "scales", "zeros")))
            for name in names}
