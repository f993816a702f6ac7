"""int8 KV quantization (`model_runtime.kv_quant`): the rule, its error bound, and the C
quantizer the fused decode step writes with (`kernels/kv_quant.h`) giving the same bytes on
rows that hit every branch (zero rows, float16-subnormal and overflowing scales, exact ties)."""

from __future__ import annotations

import pytest
import torch

from model_runtime.kernels import decode_attention
from model_runtime.kv_quant import FP16_MAX, dequantize, quantize


def _rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    d = 64
    rows = [
        torch.randn(200, d, generator=g),  # ordinary K/V rows
        torch.randn(50, d, generator=g) * 300,  # large activations
        torch.randn(20, d, generator=g) * 1e-6,  # scales in float16's subnormal range
        torch.randn(5, d, generator=g) * 1e-10,  # scales that round to zero
        torch.zeros(3, d),  # all-zero rows: scale 0, values 0
        torch.randn(3, d, generator=g) * 1e10,  # scale clamped to 65504: values saturate
    ]
    # exact ties: absmax 127 -> scale 1.0, halves round to even
    ties = torch.zeros(4, d)
    ties[:, 0] = 127.0
    ties[:, 1:9] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5])
    rows.append(ties)
    return torch.cat(rows)


def test_quantize_rule_and_error_bound() -> None:
    x = _rows()[:250]
    q, scale = quantize(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16
    assert q.shape == x.shape and scale.shape == x.shape[:-1]
    assert int(q.abs().max()) <= 127
    err = (dequantize(q, scale) - x).abs()
    # half a step, plus the float16 rounding of the scale (at most 2^-11 of 127 steps)
    bound = scale.float().unsqueeze(-1) * (0.5 + 127 * 2**-11)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


def test_quantize_edge_rows() -> None:
    x = _rows()
    q, scale = quantize(x)
    zero = x.abs().amax(-1) == 0
    assert bool((scale[zero] == 0).all()) and bool((q[zero] == 0).all())
    assert float(scale.max()) == FP16_MAX  # the clamp
    ties = q[-4:, 1:9]
    want = torch.tensor([0, 2, 2, 0, -2, -2, 4, 126], dtype=torch.int8)
    assert torch.equal(ties, want.expand_as(ties)), ties  # half to even, as torch.round
    # bfloat16 rows quantize exactly as their float32 values
    xb = x[:200].bfloat16()
    qb, sb = quantize(xb)
    q32, s32 = quantize(xb.float())
    assert torch.equal(qb, q32) and torch.equal(sb, s32)


@pytest.mark.skipif(
    decode_attention.load() is None,
    reason=f"decode kernel unavailable here: {decode_attention.unavailable_reason()}",
)
def test_c_quantizer_writes_the_same_bytes() -> None:
    x = _rows()
    want_q, want_s = quantize(x)
    got_q, got_s = decode_attention.quantize_rows(x)
    bad = (got_s.view(torch.int16) != want_s.view(torch.int16)).nonzero().flatten().tolist()
    assert not bad, f"scales differ at rows {bad[:5]}: {got_s[bad[:5]]} vs {want_s[bad[:5]]}"
    assert torch.equal(got_q, want_q), (got_q != want_q).nonzero()[:5]


@pytest.mark.skipif(
    decode_attention.load() is None,
    reason=f"decode kernel unavailable here: {decode_attention.unavailable_reason()}",
)
def test_c_float16_rounding_matches_torch_on_every_scale_range() -> None:
    """Scales spanning float16's subnormals, normals and overflow, including exact halfway
    values: the C float32 -> float16 conversion rounds as torch's does."""
    exps = torch.arange(-30, 18, dtype=torch.float32)
    mant = torch.linspace(1.0, 2.0, 4097)[:-1]
    absmax = (mant[None, :] * torch.pow(2.0, exps)[:, None]).flatten() * 127
    x = torch.zeros(absmax.numel(), 8)
    x[:, 0] = absmax
    _, want = quantize(x)
    _, got = decode_attention.quantize_rows(x)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
