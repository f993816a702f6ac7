"""`model_runtime.kernels.qgemm` against the plain reference, `quant.dequantize` + `F.linear`.

- Float path (every build): the reference's function up to fp32 summation order (fp32: within
  1e-5 of the output scale; bf16: the exact value rounded to bf16, give or take one bf16 step
  and that fp32 error: the kernel sums d * sum(q x) + m * sum(x) per block, which can cancel).
- int8 path (the avx512 build on a CPU with AVX-512 VNNI): each activation block rounded to
  int8 with scale max|x| / 127 moves each input by at most half a step, so an output moves by
  at most sum_k |w_k| * step_k / 2. The test computes that bound from the reference weight and
  the activations and holds the kernel to it (plus fp32 rounding).
- `dequantize_t` and `rows`: the reference's values exactly.

Shapes: one row and every row-block size (1-5, 7, 17, 33 rows, past the 32-row chunk), N
below one 64-row group and past it, K from one block to SmolLM2's 1536, bias, one and two
threads, every build this CPU runs (others skipped, saying why).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_runtime import quant
from model_runtime.config import QUANT_TYPES
from model_runtime.kernels import build, qgemm

pytestmark = pytest.mark.skipif(
    qgemm.load() is None, reason=f"qgemm kernel unavailable here: {qgemm.unavailable_reason()}"
)
ISAS = [
    pytest.param(
        isa,
        marks=pytest.mark.skipif(
            isa not in build.cpu_isas(), reason=f"this CPU runs {build.cpu_isas()}, not {isa}"
        ),
    )
    for isa in build.ISA_FLAGS
]
SHAPES = [  # rows, k, n, bias
    (1, 576, 960, False),  # SmolLM2's qkv at batch 1
    (1, 1536, 576, True),  # its down projection
    (2, 32, 64, True),
    (3, 64, 15, False),  # N below one group
    (4, 96, 130, True),  # N just over two groups
    (5, 128, 64, False),
    (7, 64, 65, True),
    (17, 96, 100, False),
    (33, 64, 70, True),  # past the 32-row chunk
]


def _operands(
    rows: int, k: int, n: int, qtype: quant.QuantType, bias: bool, seed: int
) -> tuple[torch.Tensor, quant.QuantWeight, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[0, :32] = 0.0  # an all-zero activation block: scale 0
    w = torch.randn(n, k, generator=g) * k**-0.5
    qw = quant.pack_blocks(quant.quantize(w, qtype), qtype, k)
    b = torch.randn(n, generator=g) if bias else None
    return x, qw, quant.dequantize(qw), b


def _bf16_step(v: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values around each |v| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(1e-30))) - 7)


def _int8_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Largest |int8 path - exact| per output (module doc), [rows, n]."""
    blocks = x.reshape(x.shape[0], -1, quant.BLOCK)
    step = blocks.abs().amax(-1, keepdim=True) / 127.0  # one int8 step, per block
    half_step = (step / 2).expand_as(blocks).reshape(x.shape).double()
    return half_step @ w.abs().double().t()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "k", "n", "bias"), SHAPES)
def test_linear_matches_the_reference(
    isa: str, qtype: quant.QuantType, threads: int, rows: int, k: int, n: int, bias: bool
) -> None:
    x, qw, w, b = _operands(rows, k, n, qtype, bias, seed=rows * k + n)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = want.abs().max().item()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = qgemm.linear(x, qw, b, int8=False, isa=isa)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        diff = (got.double() - want).abs().max().item()
        assert diff <= 1e-5 * scale, f"float path: max diff {diff:.3g} (scale {scale:.3g})"
        xb, bb = x.bfloat16(), None if b is None else b.bfloat16()
        exact = F.linear(xb.double(), w.double(), None if bb is None else bb.double())
        got_bf16 = qgemm.linear(xb, qw, bb, False, isa)
        assert got_bf16.dtype == torch.bfloat16
        over = (got_bf16.double() - exact).abs() - _bf16_step(exact) - 1e-5 * scale
        assert over.max().item() <= 0, f"bf16: {over.max().item():.3g} past one bf16 step"
        got8 = qgemm.linear(x, qw, b, int8=True, isa=isa)
        bound = _int8_bound(x, w) + 1e-5 * scale
        over = (got8.double() - want).abs() - bound
        assert over.max().item() <= 0, f"int8 path: {over.max().item():.3g} over its bound"
        if not qgemm.has_int8(isa):  # the float path ran
            assert torch.equal(got8, got)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize(("n", "k"), [(1, 32), (65, 96), (130, 64)])
def test_dequantize_and_rows_are_the_reference_values(
    isa: str, qtype: quant.QuantType, n: int, k: int
) -> None:
    _, qw, w, _ = _operands(1, k, n, qtype, False, seed=n)
    for dtype in (torch.float32, torch.bfloat16):
        t = qgemm.dequantize_t(qw, dtype, isa)
        assert t.shape == (k, n) and torch.equal(t.t(), w.to(dtype))
        ids = torch.tensor([[n - 1, 0, n // 2]])
        assert torch.equal(qgemm.rows(qw, ids, dtype, isa), w[ids].to(dtype))
    with pytest.raises(ValueError, match=rf"\[0, {n}\)"):
        qgemm.rows(qw, torch.tensor([n]), torch.float32, isa)


@pytest.mark.parametrize("isa", ISAS)
def test_int8_path_is_the_float_path_only_without_vnni(isa: str) -> None:
    """Where the CPU has AVX-512 VNNI the avx512 build reports the int8 path; the avx2 build
    never does."""
    if isa == "avx2":
        assert not qgemm.has_int8(isa)
    x, qw, _, _ = _operands(1, 64, 64, "Q8_0", False, seed=1)
    same = torch.equal(qgemm.linear(x, qw, None, True, isa), qgemm.linear(x, qw, None, False, isa))
    assert same != qgemm.has_int8(isa)
