"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache. Runs in worker processes.

Math follows HF transformers' `LlamaForCausalLM` operation for operation (RMSNorm in float32,
rotate-half RoPE, SwiGLU, pre-norm residuals) so greedy tokens match it exactly in float32.
Two differences of form, not of math: q/k/v and gate/up projections are fused into one matmul
each (fewer, larger GEMMs), and the batch is one flat token dimension with an
`AttentionMetadata` describing where each sequence's tokens are.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model_runtime import quant
from model_runtime.attention.base import AttentionBackend, AttentionMetadata
from model_runtime.config import ModelConfig, RopeScaling
from model_runtime.kernels import qgemm
from model_runtime.kv_cache import KVCache, LayerKV
from model_runtime.linear import Linear


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim/2], with Llama-3 scaling applied when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq


def rope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (cos, sin) tables [max_position_embeddings, head_dim], HF's rotate-half layout."""
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    freqs = torch.outer(positions, rope_inv_freq(config))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama-3.1 frequency-dependent RoPE scaling (same formula as HF's `rope_type=llama3`)."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """`sin` [..., head_dim] with its first half negated: the sign `rotate_half` puts on it.

    HF applies RoPE as ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``.
    `apply_rope` computes ``x * cos + cat(x2, x1) * signed_sin(sin)`` instead: the same products
    (negating a factor is exact in IEEE arithmetic), so the same bits, in fewer ops.
    """
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, head_dim] (q and k heads may be stacked in one call);
    `cos` and `sin_signed` (`signed_sin`) broadcast as [T, 1, head_dim]."""
    t, heads, dim = x.shape
    swapped = x.view(t, heads, 2, dim // 2).flip(2).view(t, heads, dim)  # cat(x2, x1)
    return x * cos + swapped * sin_signed


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused kernel instead of six ops; in float32 it gives HF's bits (tested).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        h = config.hidden_size
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, h)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,  # `signed_sin` of the positions' sin
        cache: LayerKV,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads side by side [T, heads + kv_heads, D]: one RoPE for both.
        qk = apply_rope(qk.reshape(-1, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = torch.split(qk, [self.num_heads, self.num_kv_heads], dim=1)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        out = backend.forward(q, k, v, cache.key, cache.value, meta, self.scale, cache.scales)
        projected: torch.Tensor = self.o_proj(out.reshape(-1, self.q_size))
        return projected


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.inter)
        self.down_proj = Linear(self.inter, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerKV,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta, backend)
        mlp_out: torch.Tensor = self.mlp(self.post_attention_layernorm(x))
        return x + mlp_out


class LlamaModel(nn.Module):
    """Decoder stack + LM head. `forward` returns final-norm hidden states [T, hidden]."""

    # Non-persistent buffers set by `register_buffer` (declared so they type as tensors).
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        # The embedding kept quantized (`set_quant_embedding`); `embed_tokens` is then empty.
        self.embed_quant: quant.QuantWeight | None = None
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # With tied embeddings the loader puts the embedding tensor in lm_head.weight as well.
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        cos, sin = rope_tables(config)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        dtype = x.dtype
        cos = self.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)  # [T, 1, head_dim]
        sin = signed_sin(self.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1))
        backend.prepare(meta)
        for idx, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache.layer(idx), meta, backend)
            if on_layer_done is not None:
                on_layer_done(idx)
        hidden: torch.Tensor = self.norm(x)
        return hidden

    def set_quant_embedding(self, qw: quant.QuantWeight, dtype: torch.dtype) -> None:
        """Keep the embedding quantized: rows are dequantized to `dtype` when gathered."""
        self.embed_quant = qw
        self.embed_tokens = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings [T, hidden] of `input_ids` [T], in the model's dtype."""
        qw = self.embed_quant
        if qw is None:
            return F.embedding(input_ids, self.embed_tokens)
        dtype = self.embed_tokens.dtype
        if input_ids.device.type == "cpu" and qgemm.load() is not None:
            return qgemm.rows(qw, input_ids, dtype)
        return quant.dequantize_rows(qw, input_ids).to(dtype)  # the reference

    def num_parameters(self) -> int:
        """Parameter count as in the checkpoint, packed or not (a tied LM head counts once)."""
        total = 0
        for module in self.modules():
            if isinstance(module, Linear):
                if module is self.lm_head and self.config.tie_word_embeddings:
                    continue
                total += module.in_features * module.out_features
                total += module.bias.numel() if module.bias is not None else 0
            else:
                total += sum(p.numel() for p in module.parameters(recurse=False))
        if self.embed_quant is not None:
            total += self.embed_quant.out_features * self.embed_quant.in_features
        return total

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()
