"""bf16-weight GEMM for AVX2 CPUs without oneDNN's bf16 path. Runs in worker processes.

What it is for. On a CPU with AVX-512 (or AVX-NE-CONVERT) oneDNN's packed bf16 GEMM serves
bfloat16 models (`model_runtime.linear`). On an AVX2-only CPU (AMD Zen 1/2, older Intel) it is
unavailable, and torch's own bf16 `F.linear` there computes each output row as a separate
matrix-vector product: it reads the whole weight once per row, so a decode step grows linearly
with the batch (on the Zen 1 dev host, `small`'s 768x6144 gate/up GEMM: 1.6 ms at 1 row,
48 ms at 32 rows; oneDNN fp32 8 ms). Converting the weight to fp32 per call (`w.float()`) writes
and re-reads a full fp32 copy, more bytes than fp32 weights in the first place.

This kernel (`bf16_gemm.c`) keeps the weight in bf16 (half fp32's bytes), widens it to fp32 in
registers, and multiplies it with every row of the batch while it is there, so the weight leaves
memory once per call at any batch size. It computes in fp32 and rounds the output to bf16 once,
as a bf16 GEMM with fp32 accumulation does (the same function as `reference_linear` up to fp32
summation order).

How it is built: `model_runtime.kernels.build` compiles the C source on first use and loads it
with ctypes (which releases the GIL for the call, so a worker's grpc.aio loop runs while a GEMM
does). Where it cannot (no AVX2/FMA, no compiler), `load()` returns None and
`unavailable_reason()` says why; callers then keep torch's `F.linear`.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from model_runtime.kernels import build
from model_runtime.kernels.hugepages import empty_huge

PANEL = 16  # output columns per weight panel (bf16_gemm.c)
GROUP = 64  # N is padded to a multiple of this (one unit of parallel work)
_SOURCE = Path(__file__).with_name("bf16_gemm.c")


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    lib, reason = build.load_library(_SOURCE)
    if lib is None:
        return None, reason
    fn = lib.pdserve_bf16_linear
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib, ""


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None where it cannot run here (see the module doc)."""
    return _load()[0]


def unavailable_reason() -> str:
    """Why `load()` returned None ('' when it did not)."""
    return _load()[1]


# Column order of one panel's k step in memory: 0, 8, 1, 9, ..., 7, 15 (see widen_panel in
# bf16_gemm.c: each 32-bit lane holds columns i and 8 + i).
_INTERLEAVE = [c for i in range(PANEL // 2) for c in (i, PANEL // 2 + i)]


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 weight -> panels [N_pad / 16, K, 16] (N_pad = N rounded up to 64, zero rows
    added): panel p, step k holds W[16p : 16p + 16, k] with its columns interleaved as
    0, 8, 1, 9, ..., 7, 15 (the layout drawn in bf16_gemm.c)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError(f"weight must be 2-D bfloat16, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    n_pad = -(-n // GROUP) * GROUP
    padded = torch.zeros((n_pad, k), dtype=torch.bfloat16)
    padded[:n] = weight
    panels = padded.view(n_pad // PANEL, PANEL, k)[:, _INTERLEAVE].transpose(1, 2)
    out = empty_huge((n_pad // PANEL, k, PANEL), torch.bfloat16)  # streamed whole each step
    out.copy_(panels)
    return out


def unpack_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """Inverse of `pack_weight`: the [out_features, K] weight (tests; reading a packed layer)."""
    panels, k, _ = packed.shape
    order = torch.argsort(torch.tensor(_INTERLEAVE))
    plain = packed.transpose(1, 2)[:, order]
    return plain.reshape(panels * PANEL, k)[:out_features]


def linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """y = x @ W^T + bias in bf16 ([..., K] -> [..., out_features]), computed in fp32 by the
    kernel with `torch.get_num_threads()` threads. x must be CPU bfloat16; `packed` comes from
    `pack_weight`. Needs `load()` to be non-None."""
    lib = load()
    assert lib is not None, unavailable_reason()
    k = packed.shape[1]
    assert x.dtype == torch.bfloat16 and x.shape[-1] == k, (
        f"x must be bfloat16 [..., {k}], got {x.dtype} {tuple(x.shape)}"
    )
    rows = x.numel() // k
    flat = x.reshape(rows, k).contiguous()
    out = torch.empty((rows, out_features), dtype=torch.bfloat16)
    scratch = torch.empty((rows, k), dtype=torch.float32)
    if bias is not None:
        bias = bias.contiguous()
    # ctypes calls are invisible to torch's profiler: label them while it runs.
    if torch.autograd._profiler_enabled():  # type: ignore[attr-defined]
        with torch.profiler.record_function("pdserve::bf16_linear"):
            _call(lib, flat, rows, k, packed, out_features, bias, out, scratch)
    else:
        _call(lib, flat, rows, k, packed, out_features, bias, out, scratch)
    return out.view(*x.shape[:-1], out_features)


def _call(
    lib: ctypes.CDLL,
    flat: torch.Tensor,
    rows: int,
    k: int,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    scratch: torch.Tensor,
) -> None:
    rc = lib.pdserve_bf16_linear(
        flat.data_ptr(),
        rows,
        k,
        packed.data_ptr(),
        out_features,
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        scratch.data_ptr(),
        torch.get_num_threads(),
    )
    assert rc == 0, f"pdserve_bf16_linear rejected rows={rows} k={k} n={out_features}"


def reference_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The plain torch reference: fp32 GEMM on the widened operands, rounded to bf16 once."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).to(torch.bfloat16)
