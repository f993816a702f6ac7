"""Panel GEMM for AVX2 CPUs, bf16 or fp32 weights (`panel_gemm.c`). Runs in worker processes.

What it is for. bf16: on a CPU with AVX-512 (or AVX-NE-CONVERT) oneDNN's packed bf16 GEMM serves
bfloat16 models (`model_runtime.linear`). On an AVX2-only CPU (AMD Zen 1/2, older Intel) it is
unavailable, and torch's own bf16 `F.linear` there computes each output row as a separate
matrix-vector product: it reads the whole weight once per row, so a decode step grows linearly
with the batch (on the Zen 1 dev host, `small`'s 768x6144 gate/up GEMM: 1.6 ms at 1 row,
48 ms at 32 rows; oneDNN fp32 8 ms). Converting the weight to fp32 per call (`w.float()`) writes
and re-reads a full fp32 copy, more bytes than fp32 weights in the first place. fp32: a batch-1
decode step is a stream of GEMVs, and this kernel streams fp32 panels faster than oneDNN's
packed GEMV on that host (see `model_runtime.linear` for where `auto` uses which).

The kernel keeps the weight in column panels (bf16: half fp32's bytes, widened to fp32 in
registers) and multiplies each panel with every row of the batch while it is there, so the
weight leaves memory once per call at any batch size. It computes in fp32; bf16 outputs are
rounded once, as a bf16 GEMM with fp32 accumulation does. Same function as `reference_linear`
up to fp32 summation order. Panels live on 2 MB pages where Linux grants them
(`kernels.hugepages`).

How it is built: `model_runtime.kernels.build` compiles the C source on first use and loads it
with ctypes (which releases the GIL for the call, so a worker's grpc.aio loop runs while a GEMM
does). Where it cannot (no AVX2/FMA, no compiler), `load()` returns None and
`unavailable_reason()` says why; callers then keep torch's paths.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from model_runtime.kernels import build
from model_runtime.kernels.hugepages import empty_huge

PANEL = 16  # output columns per weight panel (panel_gemm.c)
GROUP = 64  # N is padded to a multiple of this (one unit of parallel work)
DTYPES = (torch.bfloat16, torch.float32)
_SOURCE = Path(__file__).with_name("panel_gemm.c")
_ENTRY = {torch.bfloat16: "pdserve_linear_bf16", torch.float32: "pdserve_linear_f32"}
# Column order of one bf16 panel's k step in memory: 0, 8, 1, 9, ..., 7, 15 (see widen_panel in
# panel_gemm.c: each 32-bit lane holds columns i and 8 + i). fp32 panels keep 0..15.
_INTERLEAVE = [c for i in range(PANEL // 2) for c in (i, PANEL // 2 + i)]


@functools.cache
def _load(isa: str | None) -> tuple[ctypes.CDLL | None, str]:
    lib, reason = build.load_library(_SOURCE, isa)
    if lib is None:
        return None, reason
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in _ENTRY.values():
        fn = getattr(lib, name)
        fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ptr, ctypes.c_int]
        fn.restype = ctypes.c_int
    return lib, ""


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernel library for `isa` (`build.ISA_FLAGS`; None: `build.default_isa()`),
    or None where it cannot run here (see the module doc)."""
    return _load(isa)[0]


def unavailable_reason(isa: str | None = None) -> str:
    """Why `load(isa)` returned None ('' when it did not)."""
    return _load(isa)[1]


def _columns(dtype: torch.dtype) -> list[int]:
    return _INTERLEAVE if dtype == torch.bfloat16 else list(range(PANEL))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 or fp32 weight -> panels [N_pad / 16, K, 16] (N_pad = N rounded up to 64,
    zero rows added): panel p, step k holds W[16p : 16p + 16, k], bf16 with its columns
    interleaved as 0, 8, 1, 9, ..., 7, 15 (the layouts drawn in panel_gemm.c)."""
    if weight.dtype not in DTYPES or weight.dim() != 2:
        raise ValueError(
            f"weight must be 2-D bfloat16 or float32, got {weight.dtype} {tuple(weight.shape)}"
        )
    n, k = weight.shape
    n_pad = -(-n // GROUP) * GROUP
    padded = torch.zeros((n_pad, k), dtype=weight.dtype)
    padded[:n] = weight
    panels = padded.view(n_pad // PANEL, PANEL, k)[:, _columns(weight.dtype)].transpose(1, 2)
    out = empty_huge((n_pad // PANEL, k, PANEL), weight.dtype)  # streamed whole each step
    out.copy_(panels)
    return out


def unpack_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """Inverse of `pack_weight`: the [out_features, K] weight (tests; reading a packed layer)."""
    panels, k, _ = packed.shape
    order = torch.argsort(torch.tensor(_columns(packed.dtype)))
    plain = packed.transpose(1, 2)[:, order]
    return plain.reshape(panels * PANEL, k)[:out_features]


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    isa: str | None = None,
) -> torch.Tensor:
    """y = x @ W^T + bias ([..., K] -> [..., out_features]) in the weight's dtype, computed in
    fp32 by the kernel with `torch.get_num_threads()` threads. x must be a CPU tensor of the
    weight's dtype; `packed` comes from `pack_weight` (one layout for every ISA). Needs
    `load(isa)` to be non-None."""
    lib = load(isa)
    assert lib is not None, unavailable_reason(isa)
    k = packed.shape[1]
    assert x.dtype == packed.dtype and x.shape[-1] == k, (
        f"x must be {packed.dtype} [..., {k}], got {x.dtype} {tuple(x.shape)}"
    )
    rows = x.numel() // k
    flat = x.reshape(rows, k).contiguous()
    out = torch.empty((rows, out_features), dtype=x.dtype)
    scratch = torch.empty((rows, k), dtype=torch.float32)
    if bias is not None:
        bias = bias.contiguous()
    fn = getattr(lib, _ENTRY[packed.dtype])
    args = (flat, rows, k, packed, out_features, bias, out, scratch)
    # ctypes calls are invisible to torch's profiler: label them while it runs.
    if torch.autograd._profiler_enabled():  # type: ignore[attr-defined]
        with torch.profiler.record_function("pdserve::panel_linear"):
            _call(fn, *args)
    else:
        _call(fn, *args)
    return out.view(*x.shape[:-1], out_features)


def _call(
    fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
    flat: torch.Tensor,
    rows: int,
    k: int,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    scratch: torch.Tensor,
) -> None:
    rc = fn(
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
    assert rc == 0, f"panel linear rejected rows={rows} k={k} n={out_features}"


def reference_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The plain torch reference: fp32 GEMM on the (widened) operands, in the inputs' dtype
    (bf16: rounded once)."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).to(x.dtype)
