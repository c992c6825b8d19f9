"""The engine's own Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2).

gpt-fast style: the KV cache is one preallocated tensor pair per layer, the caller passes the
positions explicitly, and every shape is decided by the caller, so compiled / HPU graphs replay.
Weights keep Hugging Face's parameter names and load straight from the checkpoint.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from generation import kernels

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    attention_bias: bool  # q/k/v projections
    output_bias: bool  # o_proj: Llama's attention_bias covers it, Qwen2's q/k/v bias does not
    mlp_bias: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    sliding_layers: tuple[bool, ...]  # per layer: does it attend within sliding_window only?

    @classmethod
    def from_hf(cls, raw: dict) -> DecoderConfig:
        """Read a config.json dict, accepting both transformers 4.x and 5.x key styles."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported by the corpusgen engine; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or (
            rope if rope.get("rope_type", "default") != "default" else None
        )
        if scaling is not None:
            scaling_type = scaling.get("rope_type", scaling.get("type"))
            if scaling_type not in ("default", "llama3"):
                raise UnsupportedModelError(
                    f"rope scaling {scaling_type!r} is not supported (llama3 is)"
                )
            if scaling_type == "default":
                scaling = None
        activation = raw.get("hidden_act", "silu")
        if activation != "silu":
            raise UnsupportedModelError(
                f"hidden_act {activation!r} is not supported by the corpusgen engine (silu is)"
            )
        heads, layers = raw["num_attention_heads"], raw["num_hidden_layers"]
        # Qwen2 windows only when use_sliding_window is set (transformers' default is off);
        # Mistral has no such switch.
        windowed = raw.get("use_sliding_window", model_type != "qwen2")
        sliding = raw.get("sliding_window") if windowed else None
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            attention_bias=model_type == "qwen2" or raw.get("attention_bias", False),
            output_bias=model_type != "qwen2" and raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            sliding_window=sliding,
            sliding_layers=_sliding_layers(raw, model_type, layers, sliding),
        )


def _sliding_layers(raw: dict, model_type: str, layers: int, window: int | None):
    """Which layers use the window: transformers 5 lists `layer_types`; before that, Qwen2
    windows layers from `max_window_layers` on and Mistral windows them all."""
    if window is None:
        return (False,) * layers
    if raw.get("layer_types"):
        return tuple(kind == "sliding_attention" for kind in raw["layer_types"])
    if model_type == "qwen2":
        first = raw.get("max_window_layers", layers)
        return tuple(index >= first for index in range(layers))
    return (True,) * layers


def rope_inverse_frequencies(config: DecoderConfig) -> torch.Tensor:
    """In float32, as transformers computes them: the same rounding gives the same logits."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, smooth in between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(is_medium, blended, scaled).float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


FEW_QUERIES = 12  # decode and verify widths up to this use few_query_attention on CPU
KEY_BLOCK = 128  # keys per p.v product: one GEMM K-block in any BLAS


def few_query_attention(q, keys, values, mask, fold: bool = True) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v over a cache prefix, in fp32, for a few query tokens per row.

    Each KV head's query heads and tokens are folded into one [g * t, d] matrix, so grouped-
    query attention is two plain batched GEMMs. On CPU, SDPA's masked path costs more than the
    arithmetic here (bf16, 1 thread, 384 keys, one Qwen 1.5B layer): 0.97 vs 0.12 ms at
    [1, 1], 7.8 vs 3.9 ms at [8, 1]. Wider calls (catch-up, prefill) keep SDPA, which wins from
    ~16 queries.

    A target's token must not round differently with its call: p.v sums the keys in blocks of
    KEY_BLOCK, in order, so keys past a row's length add exact zeros whatever the cache bucket
    (MKL splits one long sum by its length: over the same 300 keys a 512- and a 1024-key bucket
    round apart on AVX-512). And where the GEMMs round a row differently with g rows than with
    g * (K + 1) (`queries_fold_alike`), `fold=False` takes each token as its own pair of GEMMs,
    a decode's shapes: exact, at the price of reading the keys once per token.
    """
    b, h, t, d = q.shape
    if not fold and t > 1:
        tokens = [few_query_attention(q[:, :, i : i + 1], keys, values, mask[:, :, i : i + 1])
                  for i in range(t)]
        return torch.cat(tokens, dim=2)
    kv = keys.shape[1]
    groups = h // kv
    folded = q.reshape(b, kv, groups * t, d).float()
    scores = _scores(folded, keys.float()).view(b, kv, groups, t, -1)
    scores = scores.mul_(d**-0.5).masked_fill_(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(b, kv, groups * t, -1)
    return _mixed_values(probs, values.float()).view(b, h, t, d).to(q.dtype)


def _scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return torch.matmul(queries, keys.transpose(-1, -2))


def _mixed_values(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """probs @ values, summed over the keys in blocks of KEY_BLOCK, in order."""
    out = torch.matmul(probs[..., :KEY_BLOCK], values[..., :KEY_BLOCK, :])
    for start in range(KEY_BLOCK, values.shape[-2], KEY_BLOCK):
        end = start + KEY_BLOCK
        out += torch.matmul(probs[..., start:end], values[..., start:end, :])
    return out


@functools.cache
def queries_fold_alike(groups: int, head_dim: int, widths: tuple[int, ...]) -> bool:
    """Whether few_query_attention's two GEMMs, as it calls them, give a query head's row the
    same bits among `groups * w` rows for every token width w (1 for decode, K + 1 for verify)
    on this CPU. Measured on the Xeon with AVX-512 MKL: yes for Qwen's 6 and 7 heads per KV
    head x 128 dims and SmolLM2's 3 x 64, no for 3 x 128 or 1-2 heads; with AVX2 code only for
    Qwen 1.5B's 6 x 128."""
    generator = torch.Generator().manual_seed(0)
    rows = [groups * w for w in widths]
    queries = torch.randn(max(rows) + min(rows), head_dim, generator=generator)
    probs = torch.randn(len(queries), 3 * KEY_BLOCK, generator=generator)
    keys, values = torch.randn(2, 1, 1, 3 * KEY_BLOCK, head_dim, generator=generator)
    return kernels.rows_round_alike(lambda r: _scores(r[None, None], keys)[0, 0], queries, rows) \
        and kernels.rows_round_alike(lambda r: _mixed_values(r[None, None], values)[0, 0], probs,
                                     rows)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        h, kv, d = config.num_heads, config.num_kv_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        # q, k and v in one GEMM: one weight read and one kernel launch instead of three.
        self.qkv_proj = nn.Linear(config.hidden_size, (h + 2 * kv) * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=config.output_bias)
        self.fold_queries = True  # False: a target's verify attends token by token (above)

    def forward(self, x, cos, sin, mask, cache_k, cache_v, write_index, attend_len):
        b, t, _ = x.shape
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split((h * d, kv * d, kv * d), dim=-1)
        q = q.view(b, t, h, d).transpose(1, 2)
        k = k.view(b, t, kv, d).transpose(1, 2)
        v = v.view(b, t, kv, d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        cache_k.index_put_(write_index, k)
        cache_v.index_put_(write_index, v)
        if attend_len == 0:  # prefill from position 0: the new tokens are all there is to see
            keys, values = k, v
        else:  # decode: the first b cache rows, up to the covering cache-length bucket
            keys, values = cache_k[:b, :, :attend_len], cache_v[:b, :, :attend_len]
        if attend_len and t <= FEW_QUERIES and q.device.type == "cpu":
            out = few_query_attention(q, keys, values, mask, self.fold_queries)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def fold_queries_where_exact(model: nn.Module, widths: tuple[int, ...]) -> None:
    """A target's attention folds a verify's tokens into one GEMM only where that rounds each
    token as a 1-token decode does (`queries_fold_alike`); a draft keeps folding."""
    for module in model.modules():
        if isinstance(module, Attention):
            groups = module.num_heads // module.num_kv_heads
            module.fold_queries = queries_fold_alike(groups, module.head_dim, widths)


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        bias = config.mlp_bias
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache_k, cache_v, write_index, attend_len):
        x = x + self.self_attn(
            self.input_layernorm(x), cos, sin, mask, cache_k, cache_v, write_index, attend_len
        )
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBackbone(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class KVCache:
    """One preallocated [rows, kv_heads, length, head_dim] K and V tensor per layer.

    Row `rows - 1` is scratch: padded batch entries write there so they never touch a live row.
    A row's valid length is host-side state of the engine; rolling back is just a smaller length.
    """

    def __init__(self, config: DecoderConfig, rows: int, length: int, dtype, device):
        shape = (rows, config.num_kv_heads, length, config.head_dim)
        self.keys = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)
        ]
        self.values = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)
        ]
        self.rows, self.length = rows, length

    @property
    def scratch_row(self) -> int:
        return self.rows - 1

    def copy_prefix(self, source: int, destinations: list[int], length: int) -> None:
        """Give `destinations` row `source`'s first `length` positions: what prefilling the
        same prompt there would write, without the forward. Row by row, so every copy's shape
        is [kv_heads, prompt bucket, head_dim], on the grid HPU graphs were built for."""
        for tensor in (*self.keys, *self.values):
            for row in destinations:
                tensor[row, :, :length].copy_(tensor[source, :, :length])

    def move_rows(self, sources: list[int], destinations: list[int]) -> None:
        """Compact live rows into a prefix so a smaller batch bucket can slice the cache."""
        src = torch.tensor(sources, device=self.keys[0].device)
        dst = torch.tensor(destinations, device=self.keys[0].device)
        for tensor in (*self.keys, *self.values):
            tensor.index_copy_(0, dst, tensor.index_select(0, src))


class CausalLM(nn.Module):
    """Decoder + LM head with one entry point, `forward`, taking fully static-shaped inputs."""

    def __init__(self, config: DecoderConfig, max_positions: int):
        super().__init__()
        self.config = config
        self.model = DecoderBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        freqs = torch.outer(torch.arange(max_positions).float(), rope_inverse_frequencies(config))
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,  # [b, t]
        positions: torch.Tensor,  # [b, t] absolute position of each token
        rows: torch.Tensor,  # [b] cache row of each batch entry
        mask: torch.Tensor,  # [b, 1, t, keys] bool: causal visibility (windows applied here)
        logit_index: torch.Tensor,  # [b, n] which of the t positions need logits
        cache: KVCache,
        attend_len: int,  # 0: attend to this forward's tokens only; else cache prefix length
    ) -> torch.Tensor:  # [b, n, vocab] float32 logits
        x = self.model.embed_tokens(tokens)
        cos = self.rope_cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.rope_sin[positions].unsqueeze(1).to(x.dtype)
        heads = torch.arange(self.config.num_kv_heads, device=tokens.device)
        write_index = (rows[:, None, None], heads[None, :, None], positions[:, None, :])
        masks = {False: mask, True: self._windowed(mask, positions)}
        layers = zip(self.model.layers, cache.keys, cache.values, self.config.sliding_layers,
                     strict=True)
        for layer, keys, values, sliding in layers:
            x = layer(x, cos, sin, masks[sliding], keys, values, write_index, attend_len)
        x = torch.gather(x, 1, logit_index[..., None].expand(-1, -1, x.shape[-1]))
        return self.lm_head(self.model.norm(x)).float()

    def _windowed(self, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`mask` limited to the last sliding_window positions (cache index == position)."""
        window = self.config.sliding_window
        if window is None or not any(self.config.sliding_layers):
            return mask
        keys = torch.arange(mask.shape[-1], device=mask.device)
        return mask & (keys > positions[:, None, :, None] - window)

    def to_dtype(self, dtype: torch.dtype) -> CausalLM:
        """Cast weights, keeping the RoPE tables in fp32 (positions need the precision)."""
        cos, sin = self.rope_cos, self.rope_sin
        self.to(dtype)
        self.rope_cos, self.rope_sin = cos, sin
        return self

    def load_hf_weights(self, state: dict[str, torch.Tensor]) -> None:
        state = _fuse_projections(
            {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        )
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [
            k for k in missing if not (self.config.tie_word_embeddings and k == "lm_head.weight")
        ]
        if missing or unexpected:
            raise ValueError(
                "checkpoint does not match the model: "
                f"missing {missing[:5]}, unexpected {unexpected[:5]}"
            )


FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def _fuse_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face's separate q/k/v and gate/up weights (and biases), concatenated in the
    order the fused layers split them."""
    fused = dict(state)
    for key in [k for k in state if k.endswith(".self_attn.q_proj.weight")]:
        layer = key.removesuffix("self_attn.q_proj.weight")
        for target, parts in FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"{layer}{part}.{kind}" for part in parts]
                if all(name in state for name in names):
                    fused[f"{layer}{target}.{kind}"] = torch.cat([fused.pop(n) for n in names])
    return fused
