"""Paged decode attention in C for CPU workers (float32 or bfloat16 cache). Runs in the engine
thread of a worker process.

Why: the torch reference (`attention.torch_ref.paged_decode_attention`) gathers every decode
sequence's blocks into a padded copy and runs a masked `scaled_dot_product_attention` over it:
it writes and re-reads all of a step's context once more, and on CPUs without oneDNN's bf16
instructions (AVX2-only: AMD Zen 1/2) torch's bf16 SDPA runs its matmuls on a slow path, 3-4x
the float32 time at the same shapes. This kernel (`decode_attention.c`) reads each K and V
block once, in place, and computes in fp32 whatever the cache dtype (bf16 widened in
registers), with an online softmax per head; the output is rounded to the cache dtype once.

Contract: same function as the reference for one query token per sequence, up to fp32
summation order and exp rounding (float32: ~1e-6 relative; bfloat16: the output may land on
the neighbouring bf16 value). It takes head_dim a multiple of 8, at most 256 query heads, a
GQA group of at most 16 and blocks of at most 256 tokens, and a cache whose rows are
contiguous within a block (`KVCache.layer`'s views); for anything else `decode_attention`
returns None and the caller uses the reference.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from model_runtime.kernels import build

_SOURCE = Path(__file__).with_name("decode_attention.c")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    lib, reason = build.load_library(_SOURCE)
    if lib is None:
        return None, reason
    fn = lib.pdserve_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64]
    fn.argtypes += [ctypes.c_float, ctypes.c_int, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
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
) -> torch.Tensor | None:
    """[B, num_heads, head_dim] in the cache dtype, or None when the kernel cannot take these
    inputs (see the module doc); runs with `torch.get_num_threads()` threads."""
    lib = load()
    if lib is None or key_cache.device.type != "cpu" or key_cache.dtype not in _DTYPES:
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
    q = q.to(key_cache.dtype).contiguous()
    seq_lens = seq_lens.contiguous()
    out = torch.empty_like(q)
    rc = lib.pdserve_decode_attention(
        q.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        key_cache.stride(0),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        batch,
        heads,
        kv_heads,
        dim,
        block_size,
        scale,
        _DTYPES[key_cache.dtype],
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out if rc == 0 else None
