"""int8 KV quantization: the reference every kernel that writes or reads an int8 KV cache
matches. Runs in the engine thread of every worker whose cache is int8
(`EngineConfig.kv_cache_dtype = "int8"`); torch only, any device.

One scale per token per KV head (symmetric, absmax), stored as float16 beside the values in
the same block (`model_runtime.kv_cache` draws the layout)::

    scale = fp16(min(absmax(x[t, h, :]) / 127, 65504))
    q     = clamp(round_half_even(x / scale), -127, 127)    (0 where scale is 0)
    x'    = q * scale                                        (exact in float32)

Every step is exactly specified in float32 (the division is IEEE, the rounding half-to-even),
so the C kernels (`kernels/decode_step.c`) and the Triton write kernel produce the same bytes
as `quantize`. A dequantized value is an int8 times a float16 (8 + 11 significant bits), exact
in float32; attention over an int8 cache computes in float32 and rounds its output to the
model's dtype once.
"""

from __future__ import annotations

import torch

QMAX = 127  # symmetric range [-127, 127]: -128 is never produced
SCALE_DTYPE = torch.float16
SCALE_BYTES = 2
FP16_MAX = 65504.0


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values shaped like `x`, float16 scales `x.shape[:-1]`) for K or V rows `x`
    [..., head_dim] of any float dtype: one scale per row (a token's head)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / QMAX).clamp(max=FP16_MAX).to(SCALE_DTYPE)
    s = scale.float().unsqueeze(-1)
    q = torch.where(s > 0, xf / s, 0.0).round().clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of int8 `q` [..., head_dim] with scales `scale` [...] (exact)."""
    return q.float() * scale.float().unsqueeze(-1)
