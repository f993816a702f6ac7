"""`model_runtime.kernels.panel_gemm`: the AVX2 panel GEMM against its torch reference.

The kernel and `reference_linear` compute the same fp32 sums in a different order. bf16: each
rounds once to bf16, so an output may land on the neighbouring bf16 value (one step of the bit
pattern) and nowhere else. fp32: they agree to fp32 summation error. Shapes cover one row,
every row-block size (1-6 rows and the tails after them), the many-rows path, the 96-row chunk
boundary, N that is not a multiple of the 64-column group, K of 1, bias, leading dimensions,
and one and two threads.
"""

from __future__ import annotations

import pytest
import torch

from model_runtime.kernels import build, panel_gemm

pytestmark = pytest.mark.skipif(
    panel_gemm.load() is None,
    reason=f"panel kernel unavailable here: {panel_gemm.unavailable_reason()}",
)
# Every build (instruction set) of the kernel; the ones this CPU cannot run are skipped.
ISAS = [
    pytest.param(
        isa,
        marks=pytest.mark.skipif(
            isa not in build.cpu_isas(), reason=f"this CPU runs {build.cpu_isas()}, not {isa}"
        ),
    )
    for isa in build.ISA_FLAGS
]


def _operands(
    rows: int, k: int, n: int, bias: bool, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def assert_matches(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """bf16: `assert_within_one_bf16_step`; fp32: equal to fp32 summation error."""
    if want.dtype == torch.bfloat16:
        assert_within_one_bf16_step(got, want, what)
        return
    assert got.shape == want.shape and got.dtype == want.dtype, what
    diff = (got - want).abs().max().item() if got.numel() else 0.0
    torch.testing.assert_close(
        got, want, atol=2e-5, rtol=2e-5, msg=lambda m: f"{what}: max diff {diff:.3g}; {m}"
    )


def assert_within_one_bf16_step(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal, or adjacent bf16 values of the same sign, or both within 1e-6 of zero."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16, what
    steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    same_sign = torch.signbit(got) == torch.signbit(want)
    near_zero = (got.float().abs() < 1e-6) & (want.float().abs() < 1e-6)
    ok = (same_sign & (steps <= 1)) | near_zero
    diff = (got.float() - want.float()).abs()
    assert bool(ok.all()), (
        f"{what}: {int((~ok).sum())} of {ok.numel()} outputs off by more than one bf16 step; "
        f"max abs diff {diff.max().item():.3g}, max step {int(steps.max())}"
    )


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("rows", "k", "n", "bias"),
    [
        (1, 768, 1280, False),  # decode at batch 1, a `small` qkv shape
        (2, 64, 64, True),
        (3, 40, 100, False),  # N below one group
        (4, 33, 130, True),  # odd K, N just over two groups
        (5, 128, 64, False),
        (6, 96, 192, True),
        (7, 96, 200, False),  # a full row block + a tail of 1
        (16, 256, 320, True),
        (24, 600, 130, True),  # the many-rows path: K in three slices, N two groups + 2
        (32, 300, 64, False),
        (97, 64, 130, True),  # crosses the 96-row chunk
        (3, 1, 16, False),  # K = 1
    ],
)
def test_kernel_matches_reference(
    rows: int, k: int, n: int, bias: bool, threads: int, dtype: torch.dtype, isa: str
) -> None:
    x, w, b = _operands(rows, k, n, bias, dtype=dtype)
    packed = panel_gemm.pack_weight(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = panel_gemm.linear(x, packed, n, b, isa=isa)
    finally:
        torch.set_num_threads(before)
    assert_matches(got, panel_gemm.reference_linear(x, w, b), f"{isa} {dtype} {rows}x{k}x{n}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_leading_dims_and_empty_batch(dtype: torch.dtype) -> None:
    x, w, b = _operands(15, 48, 80, True, dtype=dtype)
    packed = panel_gemm.pack_weight(w)
    got = panel_gemm.linear(x.view(3, 5, 48), packed, 80, b)
    assert got.shape == (3, 5, 80)
    assert_matches(got.view(15, 80), panel_gemm.reference_linear(x, w, b), "3x5 rows")
    assert panel_gemm.linear(x[:0], packed, 80, b).shape == (0, 80)


def test_pack_layout_round_trips_and_pads() -> None:
    _, w, _ = _operands(1, 24, 70, False)
    packed = panel_gemm.pack_weight(w)
    assert packed.shape == (128 // panel_gemm.PANEL, 24, panel_gemm.PANEL)  # 70 -> 128 columns
    assert packed[1, 5, 6] == w[16 + 3, 5]  # panel 1, step 5: slot 2i holds column i (3)
    assert packed[1, 5, 7] == w[16 + 8 + 3, 5]  # slot 2i + 1 holds column 8 + i
    assert torch.equal(panel_gemm.unpack_weight(packed, 70), w)
    assert not packed.view(-1, 24 * 16)[70 // 16 + 1 :].any()  # padding rows are zero
    fp32 = panel_gemm.pack_weight(w.float())  # fp32 panels keep the columns in order
    assert fp32[1, 5, 3] == w[16 + 3, 5].float()
    assert torch.equal(panel_gemm.unpack_weight(fp32, 70), w.float())
    with pytest.raises(ValueError, match="2-D bfloat16 or float32"):
        panel_gemm.pack_weight(w.half())


def test_rounding_is_nearest_even_and_keeps_specials() -> None:
    """Two-term sums of bf16 values are exact in fp32, so the output must be exactly that sum
    rounded to bf16 as torch rounds it: ties to even, inf kept, NaN still NaN."""
    w = torch.ones(1, 2).bfloat16()
    terms = [
        [1.0, 2**-8],  # halfway between 1 and 1 + 2**-7: down to the even 1.0
        [1.0, 2**-8 + 2**-7],  # halfway between 1 + 2**-7 and 1 + 2**-6: up to the even one
        [-1.0, -(2**-8 + 2**-7)],
        [1.0, 2**-9],  # below halfway
        [3.0e38, 3.0e38],  # overflows to inf
        [float("inf"), 1.0],
        [float("nan"), 1.0],
    ]
    x = torch.tensor(terms).bfloat16()
    got = panel_gemm.linear(x, panel_gemm.pack_weight(w), 1, None)[:, 0]
    want = x.float().sum(-1).to(torch.bfloat16)
    assert torch.equal(got[:6], want[:6]), (got, want)
    assert got[:2].tolist() == [1.0, 1.0 + 2**-6] and torch.isnan(got[6])
