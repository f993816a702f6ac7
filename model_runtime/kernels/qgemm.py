"""GEMM over weights kept quantized (`qgemm.c`): y = x @ W^T with W in ggml's Q8_0 / Q4_0 /
Q4_1 blocks, dequantized in registers; and the two other reads of such a weight (all of it
dequantized, for prefill GEMMs; single rows, for an embedding). Runs in worker processes.

Contract (the reference is `model_runtime.quant.dequantize` + `F.linear` in fp32):

- `linear(..., int8=False)`: the reference's function up to fp32 summation order (each block's
  products summed, then scaled); bf16 outputs rounded once.
- `linear(..., int8=True)`, where `has_int8()` (the avx512 build on a CPU with AVX-512 VNNI):
  each activation row quantized to int8 per 32-value block (scale max|x| / 127) and multiplied
  with vpdpbusd, as llama.cpp's CPU backend does. Not the reference's bits: the activations
  carry ~0.4 % of each block's largest value as rounding error (on random data the outputs
  differed from the reference by < 1 % of the largest output). Without VNNI it runs the float
  path.
- `dequantize_t` and `rows`: exactly `quant.dequantize`'s values (then rounded once to bf16 for
  bf16 outputs).

Threads: `torch.get_num_threads()` of pool.h's claim-counter pool (the fused decode step's), so
a second thread that is not running never holds up the call.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Protocol

import torch

from model_runtime.kernels import build

_SOURCE = Path(__file__).with_name("qgemm.c")
DTYPES = (torch.bfloat16, torch.float32)


class QuantWeight(Protocol):
    """A weight in qgemm.c's quantized panel layout (made by `model_runtime.quant.pack_blocks`,
    whose `QuantWeight` this is; typed here so the kernels import nothing above them)."""

    @property
    def panels(self) -> torch.Tensor: ...  # uint8, the layout qgemm.c draws

    @property
    def code(self) -> int: ...  # qgemm.c's QT_* of its type

    @property
    def out_features(self) -> int: ...

    @property
    def in_features(self) -> int: ...


@functools.cache
def _load(isa: str | None) -> tuple[ctypes.CDLL | None, str]:
    lib, reason = build.load_library(_SOURCE, isa)
    if lib is None:
        return None, reason
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.pdserve_qlinear.argtypes = [
        ptr,
        c_int,
        i64,
        i64,
        ptr,
        c_int,
        i64,
        ptr,
        ptr,
        ptr,
        c_int,
        c_int,
    ]
    lib.pdserve_qlinear.restype = c_int
    lib.pdserve_qlinear_scratch_bytes.argtypes = [i64, i64]
    lib.pdserve_qlinear_scratch_bytes.restype = i64
    lib.pdserve_qlinear_has_int8.argtypes = []
    lib.pdserve_qlinear_has_int8.restype = c_int
    lib.pdserve_qrows.argtypes = [ptr, c_int, i64, i64, ptr, i64, ptr, c_int]
    lib.pdserve_qrows.restype = c_int
    lib.pdserve_qdequant_t.argtypes = [ptr, c_int, i64, i64, ptr, i64, c_int, c_int]
    lib.pdserve_qdequant_t.restype = c_int
    return lib, ""


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled library for `isa` (`build.ISA_FLAGS`; None: `build.default_isa()`), or None
    where it cannot run here (`unavailable_reason` says why)."""
    return _load(isa)[0]


def unavailable_reason(isa: str | None = None) -> str:
    return _load(isa)[1]


def has_int8(isa: str | None = None) -> bool:
    """Whether `linear(..., int8=True)` runs the int8 path here (else it runs the float one)."""
    lib = load(isa)
    return lib is not None and bool(lib.pdserve_qlinear_has_int8())


def _lib(isa: str | None) -> ctypes.CDLL:
    lib = load(isa)
    assert lib is not None, unavailable_reason(isa)
    return lib


def linear(
    x: torch.Tensor,
    w: QuantWeight,
    bias: torch.Tensor | None,
    int8: bool,
    isa: str | None = None,
) -> torch.Tensor:
    """y = x @ W^T + bias ([..., K] -> [..., out_features]) in x's dtype (bf16 or fp32), with
    `torch.get_num_threads()` threads; `int8`: the int8 path where `has_int8(isa)` (module
    doc)."""
    lib = _lib(isa)
    k, n = w.in_features, w.out_features
    assert x.dtype in DTYPES and x.shape[-1] == k, (
        f"x must be bfloat16 or float32 [..., {k}], got {x.dtype} {tuple(x.shape)}"
    )
    rows = x.numel() // k
    flat = x.reshape(rows, k).contiguous()
    out = torch.empty((rows, n), dtype=x.dtype)
    scratch = torch.empty(lib.pdserve_qlinear_scratch_bytes(rows, k), dtype=torch.uint8)
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    args = (
        flat.data_ptr(),
        int(x.dtype == torch.bfloat16),
        rows,
        k,
        w.panels.data_ptr(),
        w.code,
        n,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        scratch.data_ptr(),
        torch.get_num_threads(),
        int(int8),
    )
    # ctypes calls are invisible to torch's profiler: label them while it runs.
    if torch.autograd._profiler_enabled():  # type: ignore[attr-defined]
        with torch.profiler.record_function("pdserve::quant_linear"):
            rc = lib.pdserve_qlinear(*args)
    else:
        rc = lib.pdserve_qlinear(*args)
    assert rc == 0, f"quant linear rejected rows={rows} k={k} n={n} type code {w.code}"
    return out.view(*x.shape[:-1], n)


def dequantize_t(w: QuantWeight, dtype: torch.dtype, isa: str | None = None) -> torch.Tensor:
    """W^T as a [in_features, out_features] view (row stride N_pad) in `dtype` (bf16 or fp32):
    `dequantize_t(w, dt).t()` is the [out, in] weight a GEMM can take without a copy."""
    lib = _lib(isa)
    assert dtype in DTYPES, dtype
    n_pad = w.panels.shape[0] * 64
    out = torch.empty((w.in_features, n_pad), dtype=dtype)
    rc = lib.pdserve_qdequant_t(
        w.panels.data_ptr(),
        w.code,
        w.out_features,
        w.in_features,
        out.data_ptr(),
        n_pad,
        int(dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    assert rc == 0, f"dequantize rejected type code {w.code} [{w.out_features}, {w.in_features}]"
    return out[:, : w.out_features]


def rows(
    w: QuantWeight, ids: torch.Tensor, dtype: torch.dtype, isa: str | None = None
) -> torch.Tensor:
    """Rows `ids` of W dequantized, [*ids.shape, in_features] in `dtype` (an embedding lookup).
    An id outside [0, out_features) is a ValueError."""
    lib = _lib(isa)
    assert dtype in DTYPES, dtype
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty((flat.numel(), w.in_features), dtype=dtype)
    rc = lib.pdserve_qrows(
        w.panels.data_ptr(),
        w.code,
        w.out_features,
        w.in_features,
        flat.data_ptr(),
        flat.numel(),
        out.data_ptr(),
        int(dtype == torch.bfloat16),
    )
    if rc != 0:
        raise ValueError(f"token ids must be in [0, {w.out_features}), got {flat.tolist()}")
    return out.view(*ids.shape, w.in_features)
