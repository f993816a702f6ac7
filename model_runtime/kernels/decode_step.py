"""The fused decode step's C binding (`decode_step.c`): the model descriptor `ModelStruct` the
C function reads, the per-layer address row layout, the kernel's shape limits, the op names
its profiling counters use, and the library loader. Runs in the engine thread of a worker.

The runner that fills the descriptor from a `LlamaModel` and calls the step is
`model_runtime/fused_decode.py` (`FusedDecode`); this module knows no model, so the kernels
package imports nothing above it.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from model_runtime.kernels import build

_SOURCE = Path(__file__).with_name("decode_step.c")
LAYER_FIELDS = 12  # per-layer addresses and weight codes (the L_* enum in decode_step.c)
KV_FIELD = 7  # L_KV: the layer's KV cache address
MAX_HEADS, MAX_GROUP, MAX_BLOCK = 256, 16, 256  # decode_attention.c's limits
MAX_HEAD_DIM = 512  # decode_step.c's, on an int8 cache
# The OP_* enum of decode_step.c: where `FusedDecode.op_seconds` adds each op's wall time.
OPS = (
    "embedding gather",
    "rmsnorm",
    "qkv gemm",
    "rope + kv write",
    "attention",
    "o_proj gemm",
    "residual adds",
    "gate/up gemm",
    "silu * up",
    "down gemm",
    "lm head gemm",
)


class ModelStruct(ctypes.Structure):
    """The model descriptor `pdserve_decode_step` reads (the `Model` struct of decode_step.c)."""

    _fields_ = [
        ("num_layers", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("inter", ctypes.c_int64),
        ("vocab", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("block_stride", ctypes.c_int64),
        ("v_offset", ctypes.c_int64),
        ("max_position", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("bf16", ctypes.c_int),
        ("embed", ctypes.c_void_p),
        ("final_norm", ctypes.c_void_p),
        ("lm_head", ctypes.c_void_p),
        ("cos_table", ctypes.c_void_p),
        ("sin_table", ctypes.c_void_p),
        ("layers", ctypes.c_void_p),
        ("kv_int8", ctypes.c_int),
        ("ks_offset", ctypes.c_int64),
        ("vs_offset", ctypes.c_int64),
        ("scale_stride", ctypes.c_int64),
        ("embed_code", ctypes.c_int64),
        ("lm_head_code", ctypes.c_int64),
        ("int8", ctypes.c_int64),
    ]


@functools.cache
def _load(isa: str | None) -> tuple[ctypes.CDLL | None, str]:
    lib, reason = build.load_library(_SOURCE, isa)
    if lib is None:
        return None, reason
    fn = lib.pdserve_decode_step
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [
        ptr,
        ptr,
        ptr,
        i64,
        ptr,
        i64,
        ptr,
        ctypes.c_int,
        ptr,
        i64,
        i64,
        ctypes.c_int,
        ptr,
    ]
    fn.restype = ctypes.c_int
    return lib, ""


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled step for `isa` (`build.ISA_FLAGS`; None: `build.default_isa()`), or None
    where it cannot run here (`unavailable_reason` says why)."""
    return _load(isa)[0]


def unavailable_reason(isa: str | None = None) -> str:
    return _load(isa)[1]
