"""The model's linear layers and the GEMM kernels behind them. Runs inside worker processes.

Every matmul with a weight (q/k/v, o, gate/up, down, LM head) is a `Linear`, in one of three
kernel states (`Linear.kernel`), chosen once after loading by `pack_linears`:

- "torch": plain `F.linear` (GPUs, float16, and wherever nothing below applies).
- "onednn": the weight reordered once into oneDNN's blocked layout (the plain copy freed);
  `forward` calls oneDNN's prepacked GEMM. On x86 CPUs this matters a great deal: torch's
  default CPU GEMM (MKL) takes its slow path on AMD processors, and even on Intel the
  prepacked layout saves a reorder per call. On the 2-core AMD EPYC this project is developed
  on, the `small` preset's float32 decode GEMMs run 1.9x (batch 1) to 2.9x (batch 32) faster
  packed (`benchmarks/bench_engine.py` measures it end to end). bfloat16 goes this way only
  where the CPU has oneDNN's bf16 instructions (AVX-512 BW/VL/DQ or AVX-NE-CONVERT).
- "avx2": bfloat16 or float32 weights in column panels, multiplied by
  `model_runtime.kernels.panel_gemm`, which reads the weight once per call whatever the batch
  and computes in fp32. The default on CPUs whose best vector unit is AVX2 (AMD Zen 1/2): for
  bfloat16 there is no oneDNN path there, and torch's own bf16 `F.linear` reads the whole
  weight once per row, so a decode step grew linearly with the batch; for float32 it streams a
  batch-1 step's GEMVs ~1.5x faster than oneDNN (`avx2_is_best` has the numbers).

- "quant": a weight kept quantized (`model_runtime.quant.QuantWeight`, ggml's Q8_0 / Q4_0 /
  Q4_1 blocks, set by the loader with `set_quant`; no float copy exists): up to
  `QUANT_GEMV_ROWS` rows (decode) `kernels.qgemm` multiplies in registers, on the int8 path
  where `int8_activations` (the activations quantized per 32-value block, AVX-512 VNNI) or
  the float one; above it (prefill) the weight is dequantized for the call into a transient
  [K, N] buffer of the activations' dtype (bf16: each weight rounded to bf16, as a dequantized
  bf16 checkpoint holds it) and multiplied by torch's GEMM (oneDNN). A quantized Linear left
  in state "torch" runs the plain reference: `quant.dequantize`, then `F.linear` in fp32,
  rounded once to the activations' dtype.

Two packings at once, chosen per step. On a CPU where 'auto' resolves to oneDNN (AVX-512 / AMX
hosts: its prefill GEMMs ran 2-6x the panel kernel's speed there) and the `avx2` kernel builds,
`pack_linears(model, "auto")` also keeps each weight in the panel layout (`Linear.panels`), so
that decode steps can run fused in one C call on the panels (`kernels.decode_step`, which reads
them at the weight-streaming floor) while prefill and mixed steps run oneDNN through the torch
modules. Both packings exist because one worker runs both kinds of step: a colocated worker
every few steps, and any worker after a role switch (`SetRole` changes a worker's role without
reloading it). The cost is a second copy of the weights (2x weight memory; the KV cache is sized
apart, by `EngineConfig.kv_cache_memory_mb`); `linear_kernel = "onednn"` keeps one copy and
runs decode steps through oneDNN.

oneDNN builds (JIT-compiles) a GEMM kernel for every new input shape, ~4 ms each on that
machine, and keeps the last 1024 in a cache. A serving engine's steps have a row count that
changes all the time (decode batch + prefill chunk), so unbucketed it spent most of a loaded
prefill worker's time compiling (a 64-token cached-prefix hit took ~1.8 s instead of ~20 ms
in `bench_prefix_routing`, nearly all of it system time). So the oneDNN path pads the rows up
to a bucket (`row_bucket`: exact up to 32, then multiples of 16, 64, 256): ~70 row counts in
all up to 4K tokens, a handful of kernels per weight shape, compiled once. Padding rows cost
nothing where a GEMM is bound by reading the weight (few rows) and at most ~6% above 256 rows.
The avx2 kernel is compiled once for all shapes and needs no padding.

Contract: a packed `Linear` computes the same function as the unpacked one, to float rounding
(GEMM summation order differs; in float32 the largest difference on the test models is ~1e-6
relative; in bfloat16 every kernel accumulates in fp32 and rounds the output once, so outputs
differ by at most a bf16 rounding step). After packing, `weight` is an empty placeholder: read
`out_features`, `in_features` and `weight_nbytes` instead.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from model_runtime import quant
from model_runtime.kernels import panel_gemm, qgemm

KernelName = Literal["torch", "onednn", "avx2", "quant"]
LinearKernel = Literal["auto", "torch", "onednn", "avx2"]
QuantActivations = Literal["auto", "int8", "float32"]
# Rows up to which a quantized Linear multiplies in registers; above, it dequantizes the weight
# once per call and runs a GEMM (prefill chunks).
QUANT_GEMV_ROWS = 16
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN picks the packed layout for an expected row count. Measured on the `small` preset's
# shapes, 128 was best or within 5% of best at 1, 8, 32 and 512 rows (decode and prefill).
_PACK_BATCH_HINT = 128


def row_bucket(rows: int) -> int:
    """The row count a packed GEMM runs with for `rows` rows (>= rows; see the module doc)."""
    if rows <= 32:
        return rows
    step = 16 if rows <= 256 else 64 if rows <= 1024 else 256
    return -(-rows // step) * step


class Linear(nn.Module):
    """y = x @ weight.T (+ bias), for x of shape [..., in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.kernel: KernelName = "torch"
        self.packed: torch.Tensor | None = None  # the weight in `kernel`'s layout, once packed
        # A second copy in `panel_gemm`'s layout for the fused decode step, kept beside a
        # oneDNN packing (`pack(..., panels=True)`); None otherwise.
        self.panels: torch.Tensor | None = None
        self.weight_nbytes = 0  # set by `pack`; before packing read weight.nbytes
        self.quant: quant.QuantWeight | None = None  # the weight kept quantized (`set_quant`)
        # quantized weights: multiply int8-quantized activations (`kernels.qgemm`)
        self.int8_activations = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self._quant_forward(x, self.quant)
        if self.kernel == "torch":
            return F.linear(x, self.weight, self.bias)
        assert self.packed is not None, f"Linear in state {self.kernel!r} has no packed weight"
        if self.kernel == "avx2":
            return panel_gemm.linear(x, self.packed, self.out_features, self.bias)
        rows = x.numel() // self.in_features
        padded = row_bucket(rows)
        if padded == rows:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.packed, self.bias, "none", [], ""
            )
            return out
        flat = torch.empty((padded, self.in_features), dtype=x.dtype, device=x.device)
        flat[:rows].copy_(x.reshape(rows, self.in_features))
        flat[rows:].zero_()
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out[:rows].view(*x.shape[:-1], self.out_features)

    def _quant_forward(self, x: torch.Tensor, qw: quant.QuantWeight) -> torch.Tensor:
        if self.kernel == "torch":  # the reference: fp32 GEMM, rounded once to x's dtype
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), quant.dequantize(qw), bias).to(x.dtype)
        rows = x.numel() // self.in_features
        if rows <= QUANT_GEMV_ROWS:
            return qgemm.linear(x, qw, self.bias, self.int8_activations)
        # transient [K, N] buffer, transposed view: no copy into torch's GEMM
        w = qgemm.dequantize_t(qw, x.dtype).t()
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, w, bias)

    def set_quant(self, qw: quant.QuantWeight) -> None:
        """Keep the weight quantized (the loader, before `pack_linears`): the float weight
        becomes an empty placeholder and the Linear runs the reference until packed."""
        assert self.kernel == "torch" and self.quant is None, "Linear already packed"
        assert (qw.out_features, qw.in_features) == (self.out_features, self.in_features), (
            f"quantized weight {qw.out_features}x{qw.in_features} for a "
            f"{self.out_features}x{self.in_features} Linear"
        )
        self.quant = qw
        self.weight_nbytes = qw.nbytes
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def pack(self, kernel: Literal["onednn", "avx2"] = "onednn", panels: bool = False) -> None:
        """Rearrange the weight for `kernel` and drop the plain copy (see `resolve_linear_kernel`
        for where each is available). `panels`: with 'onednn', also keep the weight in the
        panel layout (`panels`, for the fused decode step; the `avx2` kernel must be
        available). Packing twice is an error."""
        assert self.kernel == "torch", f"Linear already packed for {self.kernel!r}"
        assert self.quant is None, "a quantized Linear packs with `pack_quant`"
        w = self.weight.detach()
        self.weight_nbytes = w.numel() * w.element_size()
        if kernel == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT)
            if panels:
                self.panels = panel_gemm.pack_weight(w)
        else:
            self.packed = panel_gemm.pack_weight(w)
        self.kernel = kernel
        self.weight = nn.Parameter(w.new_empty(0), requires_grad=False)

    def pack_quant(self, int8_activations: bool) -> None:
        """Run the quantized weight on `kernels.qgemm` (state "quant"); `int8_activations`:
        its int8 path (where the CPU has it)."""
        assert self.quant is not None and self.kernel == "torch", "not a quantized Linear"
        self.kernel = "quant"
        self.int8_activations = int8_activations

    def panel_weight(self) -> torch.Tensor | None:
        """The weight in the layout the fused decode step reads: `panel_gemm`'s (the packed
        weight on the `avx2` kernel, the second copy beside a oneDNN packing) or, in state
        "quant", the quantized panels (`panel_code` says which); else None."""
        if self.kernel == "quant":
            assert self.quant is not None
            return self.quant.panels
        return self.packed if self.kernel == "avx2" else self.panels

    def panel_code(self) -> int:
        """0 for `panel_gemm` panels, else the quantized type's code in the C kernels."""
        return self.quant.code if self.kernel == "quant" and self.quant is not None else 0

    def nbytes(self) -> int:
        """Bytes a forward pass reads from the weight (packed or not)."""
        if self.kernel != "torch" or self.quant is not None:
            return self.weight_nbytes
        return self.weight.numel() * self.weight.element_size()


def onednn_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN prepacked GEMM is available for CPU tensors in float32 on x86 builds with oneDNN,
    and in bfloat16 only where the CPU has the instructions oneDNN's bf16 path needs
    (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU such as Zen 1/2 has neither)."""
    if not (
        device.type == "cpu"
        and dtype in _ONEDNN_DTYPES
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def avx2_unsupported(device: torch.device, dtype: torch.dtype) -> str:
    """Why the avx2 kernel cannot serve this device/dtype ('' when it can): it takes CPU
    bfloat16 or float32 weights and needs AVX2/FMA and a C compiler (`panel_gemm.load`)."""
    if device.type != "cpu" or dtype not in panel_gemm.DTYPES:
        return f"it takes CPU bfloat16 or float32 weights; got device {device}, dtype {dtype}"
    if panel_gemm.load() is None:
        return panel_gemm.unavailable_reason()
    return ""


def avx2_is_best(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether 'auto' picks avx2: CPU bfloat16 without oneDNN's bf16 path, or CPU float32 on a
    CPU whose best vector unit is AVX2 (there oneDNN's GEMM has no wider one to use, and the
    panel kernel measured 0.61-0.77x its time at 1-16 rows, 0.91-1.02x at 32-512), where the
    kernel builds. On AVX-512 CPUs float32 stays on oneDNN."""
    if device.type != "cpu" or avx2_unsupported(device, dtype):
        return False
    if dtype == torch.bfloat16:
        return not onednn_supported(device, dtype)
    return str(torch.backends.cpu.get_cpu_capability()) == "AVX2"


def resolve_linear_kernel(
    kernel: LinearKernel, device: torch.device, dtype: torch.dtype
) -> KernelName:
    """'auto' -> avx2 where `avx2_is_best`, else oneDNN where supported, else torch. Naming a
    kernel that cannot run here is a ValueError that says why."""
    if kernel not in get_args(LinearKernel):
        raise ValueError(
            f"linear kernel must be one of {list(get_args(LinearKernel))}, got {kernel!r}"
        )
    if kernel == "torch":
        return "torch"
    if kernel == "avx2":
        reason = avx2_unsupported(device, dtype)
        if reason:
            raise ValueError(f"linear kernel 'avx2' cannot run here: {reason}")
        return "avx2"
    if kernel == "auto" and avx2_is_best(device, dtype):
        return "avx2"
    if onednn_supported(device, dtype):
        return "onednn"
    if kernel == "onednn":
        raise ValueError(
            f"linear kernel 'onednn' needs a CPU device, float32 (or bfloat16 on a CPU with "
            f"oneDNN's bf16 instructions) and a torch build with oneDNN; got device {device}, "
            f"dtype {dtype}"
        )
    return "torch"


def keeps_panels(
    kernel: LinearKernel, resolved: KernelName, device: torch.device, dtype: torch.dtype
) -> bool:
    """Whether `pack_linears` keeps a panel copy beside the `resolved` packing: only for
    'auto' resolved to oneDNN where the `avx2` kernel runs (see the module doc: decode steps
    then run fused on the panels, prefill on oneDNN). A named kernel keeps one copy. Where the
    fused step cannot take the model after all (`FusedDecode.unsupported`), `ModelRunner`
    frees the copy."""
    return kernel == "auto" and resolved == "onednn" and not avx2_unsupported(device, dtype)


def resolve_quant_activations(activations: QuantActivations) -> bool:
    """Whether quantized Linears multiply int8 activations: 'int8' (where the CPU runs it,
    `qgemm.has_int8`; elsewhere the float path runs), 'float32' never, 'auto' where the CPU
    runs the int8 path. A value outside the three is a ValueError."""
    if activations not in get_args(QuantActivations):
        raise ValueError(
            f"quant_activations must be one of {list(get_args(QuantActivations))}, "
            f"got {activations!r}"
        )
    return activations != "float32" and qgemm.has_int8()


def pack_linears(
    model: nn.Module, kernel: LinearKernel, activations: QuantActivations = "auto"
) -> KernelName:
    """Switch every `Linear` in `model` to the resolved kernel (with a panel copy where
    `keeps_panels`); quantized ones (`Linear.quant`) to state "quant" (`kernels.qgemm`, its
    int8 path per `resolve_quant_activations`) unless `kernel` is 'torch' or the kernel cannot
    build here (then they run the reference). Returns the kernel in use for the float
    Linears, or "quant" when every Linear is quantized and packed."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    quantized = [m for m in linears if m.quant is not None]
    floats = [m for m in linears if m.quant is None]
    int8 = resolve_quant_activations(activations)
    if kernel != "torch" and qgemm.load() is not None:
        for layer in quantized:
            if layer.kernel == "torch":
                layer.pack_quant(int8)
    if not floats:
        return "quant" if quantized and quantized[0].kernel == "quant" else "torch"
    first = floats[0].weight if floats[0].kernel == "torch" else floats[0].packed
    assert first is not None
    resolved = resolve_linear_kernel(kernel, first.device, first.dtype)
    panels = keeps_panels(kernel, resolved, first.device, first.dtype)
    for layer in floats:
        if layer.kernel != resolved:
            assert layer.kernel == "torch", (
                f"cannot repack a Linear from {layer.kernel!r} to {resolved!r}"
            )
            if resolved == "onednn":
                layer.pack(resolved, panels=panels)
            elif resolved == "avx2":
                layer.pack(resolved)
    return resolved
