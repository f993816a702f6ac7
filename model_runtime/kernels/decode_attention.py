"""Paged decode attention in C for CPU workers (float32, bfloat16 or int8 cache). Runs in the
engine thread of a worker process.

Why: the torch reference (`attention.torch_ref.paged_decode_attention`) gathers every decode
sequence's blocks into a padded copy and runs a masked `scaled_dot_product_attention` over it:
it writes and re-reads all of a step's context once more, and on CPUs without oneDNN's bf16
instructions (AVX2-only: AMD Zen 1/2) torch's bf16 SDPA runs its matmuls on a slow path, 3-4x
the float32 time at the same shapes. This kernel (`decode_attention.c`) reads each K and V
block once, in place, and computes in fp32 whatever the cache dtype (bf16 widened in
registers), with an online softmax per head; the output is rounded to the cache dtype once.
An int8 cache (`model_runtime.kv_cache`) is read the same way, its int8 values widened in
registers and each token's float16 K/V scale applied once per head (to the score, and to the
softmax weight of its V row); q and the output are then in the model's dtype.

Contract: same function as the reference for one query token per sequence, up to fp32
summation order and exp rounding (float32: ~1e-6 relative; bfloat16: the output may land on
the neighbouring bf16 value; int8: the reference's float32 attention over the dequantized
cache, to fp32 rounding, then rounded to q's dtype). It takes head_dim a multiple of 8, at
most 256 query heads, a GQA group of at most 16 and blocks of at most 256 tokens, and a cache
whose rows are contiguous within a block (`KVCache.layer`'s views); for anything else
`decode_attention` returns None and the caller uses the reference.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from model_runtime.kernels import build

_SOURCE = Path(__file__).with_name("decode_attention.c")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # q/out; cache kinds 0, 1 and 2 = int8
_KV_I8 = 2


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    lib, reason = build.load_library(_SOURCE)
    if lib is None:
        return None, reason
    fn = lib.pdserve_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, ptr, i64, ptr, i64, i64, i64, i64, i64]
    fn.argtypes += [ctypes.c_float, ctypes.c_int, ctypes.c_int, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.pdserve_kv_quantize.argtypes = [ptr, i64, i64, ptr, ptr]
    lib.pdserve_kv_quantize.restype = None
    return lib, ""


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot run here (`unavailable_reason` says why)."""
    return _load()[0]


def unavailable_reason() -> str:
    return _load()[1]


def decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided)
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, >= blocks of the longest sequence] int64
    seq_lens: torch.Tensor,  # [B] int64, each >= 1
    scale: float,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an int8 cache's scales
) -> torch.Tensor | None:
    """[B, num_heads, head_dim] in the cache dtype (an int8 cache: q's dtype), or None when the
    kernel cannot take these inputs (see the module doc); runs with `torch.get_num_threads()`
    threads."""
    lib = load()
    if lib is None or key_cache.device.type != "cpu":
        return None
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = key_cache.shape
    row_strides = (kv_heads * dim, dim, 1)
    if (
        key_cache.stride()[1:] != row_strides
        or value_cache.stride() != key_cache.stride()
        or block_tables.dtype != torch.int64
        or seq_lens.dtype != torch.int64
        or block_tables.stride(-1) != 1
    ):
        return None
    scale_ptrs: tuple[int | None, int | None] = (None, None)
    if kv_scales is None:
        if key_cache.dtype not in _DTYPES:
            return None
        q = q.to(key_cache.dtype).contiguous()
        kind, scale_stride = _DTYPES[key_cache.dtype], 0
    else:
        ks, vs = kv_scales
        if (
            key_cache.dtype != torch.int8
            or q.dtype not in _DTYPES
            or ks.stride()[1:] != (kv_heads, 1)
            or vs.stride() != ks.stride()
        ):
            return None
        q = q.contiguous()
        kind, scale_ptrs, scale_stride = _KV_I8, (ks.data_ptr(), vs.data_ptr()), ks.stride(0)
    seq_lens = seq_lens.contiguous()
    out = torch.empty_like(q)
    rc = lib.pdserve_decode_attention(
        q.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        *scale_ptrs,
        key_cache.stride(0),
        scale_stride,
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        batch,
        heads,
        kv_heads,
        dim,
        block_size,
        scale,
        _DTYPES[q.dtype],
        kind,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out if rc == 0 else None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The C quantizer the fused decode step writes K/V with (`kernels/kv_quant.h`), on
    float32 rows `x` [rows, head_dim]: (int8 values, float16 scales [rows]); the same bytes as
    `kv_quant.quantize` (tested). RuntimeError where the kernel cannot load."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"decode attention kernel unavailable: {unavailable_reason()}")
    x = x.float().contiguous()
    q = torch.empty(x.shape, dtype=torch.int8)
    scales = torch.empty(x.shape[0], dtype=torch.float16)
    lib.pdserve_kv_quantize(x.data_ptr(), x.shape[0], x.shape[1], q.data_ptr(), scales.data_ptr())
    return q, scales
