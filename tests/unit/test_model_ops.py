"""The model's elementwise pieces give HF transformers' float32 bits exactly: RoPE on q and k
stacked in one call (with the sign of `rotate_half` folded into sin), and the fused RMSNorm.
Written against HF's formulas, so a rounding change shows here before it flips a token."""

from __future__ import annotations

import torch

from model_runtime.model import RMSNorm, apply_rope, rope_tables, signed_sin
from tests.fakes.model_configs import tiny_model_config


def _hf_rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def test_stacked_rope_is_bit_identical_to_hf() -> None:
    torch.manual_seed(0)
    cfg = tiny_model_config(head_dim=16, max_position_embeddings=256)
    cos_t, sin_t = rope_tables(cfg)
    positions = torch.tensor([0, 1, 17, 255])
    cos = cos_t[positions].unsqueeze(1)
    sin = sin_t[positions].unsqueeze(1)
    heads, kv_heads, dim = 4, 2, cfg.head_dim
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * dim) * 3
    q = qkv[:, : heads * dim].reshape(-1, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(-1, kv_heads, dim)
    want_q = q * cos + _hf_rotate_half(q) * sin
    want_k = k * cos + _hf_rotate_half(k) * sin
    # As the model calls it: q and k heads side by side, a strided view of the qkv rows.
    qk = qkv[:, : (heads + kv_heads) * dim].reshape(-1, heads + kv_heads, dim)
    got_q, got_k = apply_rope(qk, cos, signed_sin(sin)).split([heads, kv_heads], dim=1)
    assert torch.equal(got_q, want_q), (got_q - want_q).abs().max()
    assert torch.equal(got_k, want_k), (got_k - want_k).abs().max()


def test_rms_norm_is_bit_identical_to_hf() -> None:
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        norm = RMSNorm(96, 1e-5)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.2 * torch.rand(96))
        norm = norm.to(dtype)
        for rows in (1, 7, 64):
            x = (torch.randn(rows, 96) * 4).to(dtype)
            want = _hf_rms_norm(x, norm.weight.detach(), 1e-5)
            got = norm(x).detach()
            assert got.dtype == want.dtype
            assert torch.equal(got, want), (dtype, rows, (got.float() - want.float()).abs().max())
