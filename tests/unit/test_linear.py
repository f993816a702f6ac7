"""`model_runtime.linear`: the packed kernels (oneDNN, avx2) compute what F.linear computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model_runtime.kernels import panel_gemm
from model_runtime.linear import (
    Linear,
    avx2_unsupported,
    keeps_panels,
    onednn_supported,
    pack_linears,
    resolve_linear_kernel,
    row_bucket,
)
from model_runtime.model_runner import ModelRunner, StepInput

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not onednn_supported(CPU, torch.float32), reason="torch build without oneDNN"
)
BF16_PACKED = pytest.param(
    torch.bfloat16,
    2e-2,
    marks=pytest.mark.skipif(
        not onednn_supported(CPU, torch.bfloat16),
        reason="this CPU lacks oneDNN's bf16 instructions (AVX-512 BW/VL/DQ or AVX-NE-CONVERT)",
    ),
)
_BF16_AVX2_WHY_NOT = avx2_unsupported(CPU, torch.bfloat16)
needs_avx2 = pytest.mark.skipif(
    bool(_BF16_AVX2_WHY_NOT), reason=f"avx2 kernel unavailable: {_BF16_AVX2_WHY_NOT}"
)


def _linear(in_f: int, out_f: int, bias: bool, dtype: torch.dtype) -> Linear:
    torch.manual_seed(0)
    layer = Linear(in_f, out_f, bias=bias).to(dtype)
    with torch.no_grad():
        layer.weight.normal_(0, in_f**-0.5)
        if layer.bias is not None:
            layer.bias.normal_()
    return layer.requires_grad_(False)


@needs_onednn
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), BF16_PACKED])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 33, 300])  # 33 and 300 run padded (to 48 and 320)
def test_packed_matches_f_linear(dtype: torch.dtype, tol: float, bias: bool, rows: int) -> None:
    layer = _linear(96, 160, bias, dtype)
    x = torch.randn(rows, 96).to(dtype)
    expected = F.linear(x, layer.weight, layer.bias)
    plain_bytes = layer.nbytes()
    layer.pack()
    assert layer.packed is not None and layer.weight.numel() == 0
    assert layer.nbytes() == plain_bytes == 96 * 160 * x.element_size()
    got = layer(x)
    assert got.shape == expected.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@needs_avx2
@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_avx2_matches_f_linear(dtype: torch.dtype, tol: float, bias: bool, rows: int) -> None:
    """Within rounding of torch's own F.linear (bf16: both accumulate in fp32; the kernel's
    exact-rounding test against its reference is in test_panel_gemm.py)."""
    layer = _linear(96, 160, bias, dtype)
    x = torch.randn(2, rows, 96).to(dtype)
    expected = F.linear(x, layer.weight, layer.bias)
    layer.pack("avx2")
    assert layer.kernel == "avx2" and layer.weight.numel() == 0
    assert layer.nbytes() == 96 * 160 * x.element_size()
    got = layer(x)
    assert got.shape == expected.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@needs_onednn
def test_packed_accepts_leading_dims() -> None:
    layer = _linear(32, 48, False, torch.float32)
    weight = layer.weight.clone()
    layer.pack()
    for shape in [(3, 5, 32), (5, 7, 32)]:  # 15 rows run as they are, 35 padded to 48
        x = torch.randn(shape)
        torch.testing.assert_close(layer(x), F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_row_buckets_are_few_and_cheap() -> None:
    """Packed GEMMs see few distinct row counts (oneDNN compiles a kernel per shape and keeps
    1024), and padding stays small where a GEMM is compute-bound (many rows)."""
    buckets = [row_bucket(n) for n in range(1, 4097)]
    assert all(b >= n for n, b in enumerate(buckets, start=1))
    assert buckets == sorted(buckets)
    assert len(set(buckets)) <= 80, len(set(buckets))
    assert all(b == n for n, b in enumerate(buckets[:32], start=1))  # small batches exact
    assert max((b - n) / n for n, b in enumerate(buckets, start=1) if n > 256) < 0.25
    assert max((b - n) / n for n, b in enumerate(buckets, start=1) if n > 1024) < 0.25


def test_resolve_kernel() -> None:
    assert resolve_linear_kernel("torch", CPU, torch.float32) == "torch"
    assert resolve_linear_kernel("auto", CPU, torch.float16) == "torch"  # no fp16 oneDNN path
    assert resolve_linear_kernel("auto", torch.device("meta"), torch.float32) == "torch"
    with pytest.raises(ValueError, match=r"one of \['auto', 'torch', 'onednn', 'avx2'\]"):
        resolve_linear_kernel("mkl", CPU, torch.float32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"needs a CPU device.*float16"):
        resolve_linear_kernel("onednn", CPU, torch.float16)
    with pytest.raises(ValueError, match=r"avx2.*CPU bfloat16 or float32 weights.*float16"):
        resolve_linear_kernel("avx2", CPU, torch.float16)


def test_resolve_kernel_auto_on_cpu() -> None:
    """bfloat16: oneDNN where the CPU has its bf16 path, else the AVX2 kernel where it builds,
    else F.linear. float32: the AVX2 kernel where AVX2 is the CPU's best vector unit and it
    builds, else oneDNN."""
    bf16 = (
        "onednn"
        if onednn_supported(CPU, torch.bfloat16)
        else "torch"
        if _BF16_AVX2_WHY_NOT
        else "avx2"
    )
    assert resolve_linear_kernel("auto", CPU, torch.bfloat16) == bf16
    avx2_only = str(torch.backends.cpu.get_cpu_capability()) == "AVX2"
    fp32 = "avx2" if avx2_only and not _BF16_AVX2_WHY_NOT else "onednn"
    if onednn_supported(CPU, torch.float32) or fp32 == "avx2":
        assert resolve_linear_kernel("auto", CPU, torch.float32) == fp32


@needs_onednn
def test_pack_linears_is_idempotent_and_reports_kernel() -> None:
    model = torch.nn.Sequential(_linear(8, 8, False, torch.float32))
    assert pack_linears(model, "torch") == "torch" and model[0].packed is None
    assert pack_linears(model, "onednn") == "onednn"
    packed = model[0].packed
    assert pack_linears(model, "onednn") == "onednn" and model[0].packed is packed
    with pytest.raises(AssertionError, match="already packed for 'onednn'"):
        model[0].pack("avx2")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_keeps_a_panel_copy_beside_onednn(dtype: torch.dtype) -> None:
    """Where 'auto' resolves to oneDNN and the avx2 kernel runs (AVX-512/AMX hosts), every
    Linear keeps both packings: oneDNN's for `forward` and the panels for the fused decode step,
    which hold the same weight. A named kernel keeps one copy."""
    resolved = resolve_linear_kernel("auto", CPU, dtype)
    if resolved != "onednn" or avx2_unsupported(CPU, dtype):
        pytest.skip(
            f"'auto' is {resolved!r} here for {dtype} (avx2 kernel: "
            f"{avx2_unsupported(CPU, dtype) or 'available'}): no second packing to test"
        )
    assert keeps_panels("auto", "onednn", CPU, dtype)
    assert not keeps_panels("onednn", "onednn", CPU, dtype)
    assert not keeps_panels("auto", "avx2", CPU, dtype)  # the panels are the packing there
    layer = _linear(96, 80, True, dtype)
    weight = layer.weight.detach().clone()
    model = torch.nn.Sequential(layer)
    assert pack_linears(model, "auto") == "onednn"
    assert layer.kernel == "onednn" and layer.packed is not None
    panels = layer.panel_weight()
    assert panels is not None and panels is layer.panels
    assert torch.equal(panel_gemm.unpack_weight(panels, 80), weight)
    x = torch.randn(3, 96).to(dtype)
    ref = F.linear(x.float(), weight.float(), layer.bias.float()).to(dtype)  # type: ignore[union-attr]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(layer(x), ref, atol=tol, rtol=tol)  # oneDNN's packing
    via_panels = panel_gemm.linear(x, panels, 80, layer.bias)
    torch.testing.assert_close(via_panels, ref, atol=tol, rtol=tol)
    one = torch.nn.Sequential(_linear(96, 80, True, dtype))
    assert pack_linears(one, "onednn") == "onednn"
    assert one[0].panels is None and one[0].panel_weight() is None


@needs_onednn
def test_runner_logits_same_on_both_kernels(tiny_model_dir: Path) -> None:
    """Whole-model check on the tiny preset: prefill + decode logits agree to float rounding,
    and so do the greedy tokens (the fidelity tests run the default kernel)."""
    kernels = ("torch", "onednn") + (() if _BF16_AVX2_WHY_NOT else ("avx2",))
    runners = {
        k: ModelRunner.from_model_dir(tiny_model_dir, 16, 16, linear_kernel=k) for k in kernels
    }
    assert [r.linear_kernel for r in runners.values()] == list(kernels)
    prompt = list(range(5, 45))
    logits = {}
    for kernel, runner in runners.items():
        table = list(range(4))
        rows = [runner.execute([StepInput(prompt, 0, table)])[0]]
        rows.append(runner.execute([StepInput([7], len(prompt), table)])[0])
        logits[kernel] = torch.stack(rows)
    for k in kernels[1:]:
        torch.testing.assert_close(logits[k], logits["torch"], atol=1e-4, rtol=1e-4)
        assert torch.equal(logits[k].argmax(-1), logits["torch"].argmax(-1))
        assert runners[k].model.num_parameters() == runners["torch"].model.num_parameters()


@needs_avx2
def test_runner_bf16_logits_same_on_both_kernels(tiny_model_dir: Path) -> None:
    """The tiny model in bfloat16: prefill + decode logits from the avx2 kernel agree with
    torch's bf16 F.linear to bf16 rounding (both accumulate in fp32; each layer's output may
    round to the neighbouring bf16 value, and that compounds over 4 layers)."""
    runners = {
        k: ModelRunner.from_model_dir(tiny_model_dir, 16, 16, dtype="bfloat16", linear_kernel=k)
        for k in ("torch", "avx2")
    }
    assert [r.linear_kernel for r in runners.values()] == ["torch", "avx2"]
    prompt = list(range(5, 45))
    logits = {}
    for kernel, runner in runners.items():
        table = list(range(4))
        rows = [runner.execute([StepInput(prompt, 0, table)])[0]]
        rows.append(runner.execute([StepInput([7], len(prompt), table)])[0])
        logits[kernel] = torch.stack(rows)
    diff = (logits["avx2"] - logits["torch"]).abs().max().item()
    scale = logits["torch"].abs().max().item()
    assert diff <= 0.02 * scale, f"max logit diff {diff:.3g} (logit scale {scale:.3g})"
    assert runners["avx2"].model.num_parameters() == runners["torch"].model.num_parameters()
