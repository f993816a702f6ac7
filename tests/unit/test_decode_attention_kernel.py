"""`model_runtime.kernels.decode_attention` against the torch reference `paged_decode_attention`.

Shapes hit one token, block boundaries (len = k * block_size and +-1), a context spanning many
blocks in shuffled order, every specialised GQA group (1, 2, 3, 4, 8) and a generic one (5),
the strided K/V views of a real `KVCache` layer, float32 and bfloat16, one and two threads.
float32 agrees to fp32 rounding; bfloat16 computes in fp32 and rounds once, so an output may
sit one bf16 step away from the reference's (which rounds its intermediate results to bf16).
An int8 cache (values and float16 scales in one block, `KVCache(cache_dtype="int8")`) is
checked on the same shapes against the reference's float32 attention over the dequantized
cache, with float32 and bfloat16 queries.
"""

from __future__ import annotations

import pytest
import torch

from model_runtime.attention.torch_ref import paged_decode_attention
from model_runtime.kernels import decode_attention
from model_runtime.kv_cache import KVCache
from model_runtime.kv_quant import quantize
from tests.fakes.model_configs import tiny_model_config

pytestmark = pytest.mark.skipif(
    decode_attention.load() is None,
    reason=f"decode kernel unavailable here: {decode_attention.unavailable_reason()}",
)
TOL = {torch.float32: (2e-6, 2e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}  # (atol, rtol)
SHAPES = [
    ([1], 4, 4, 8, 16),  # one token, no GQA
    ([15, 16, 17], 4, 2, 16, 16),  # around one block
    ([31, 32, 33, 1], 12, 4, 64, 16),  # `small`'s heads, group 3
    ([200], 8, 2, 32, 16),  # 13 blocks in shuffled order, group 4
    ([40, 7], 8, 1, 16, 8),  # group 8 (multi-query)
    ([9, 70], 10, 2, 24, 32),  # generic group 5, other block size
]


def _case(
    lens: list[int], heads: int, kv_heads: int, dim: int, bs: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // bs) for n in lens)
    num_blocks = len(lens) * max_blocks + 3
    kv = torch.randn(num_blocks, 2, bs, kv_heads, dim, generator=g).to(dtype)  # KVCache layout
    q = (torch.randn(len(lens), heads, dim, generator=g) * 2).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)[: len(lens) * max_blocks]
    return q, kv[:, 0], kv[:, 1], perm.view(len(lens), max_blocks), torch.tensor(lens)


def _check(got: torch.Tensor | None, want: torch.Tensor, what: str) -> None:
    assert got is not None, f"{what}: kernel declined"
    atol, rtol = TOL[want.dtype]
    diff = (got.float() - want.float()).abs().max().item()
    torch.testing.assert_close(
        got.float(),
        want.float(),
        atol=atol,
        rtol=rtol,
        msg=lambda m: f"{what}: max diff {diff:.3g}; {m}",
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lens", "heads", "kv_heads", "dim", "bs"), SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_reference(
    lens: list[int], heads: int, kv_heads: int, dim: int, bs: int, dtype: torch.dtype, threads: int
) -> None:
    q, kc, vc, tables, seq_lens = _case(lens, heads, kv_heads, dim, bs, dtype, seed=len(lens))
    want = paged_decode_attention(q, kc, vc, tables, seq_lens, dim**-0.5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = decode_attention.decode_attention(q, kc, vc, tables, seq_lens, dim**-0.5)
    finally:
        torch.set_num_threads(before)
    _check(got, want, f"lens {lens} heads {heads}/{kv_heads} dim {dim} bs {bs} {dtype}")


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lens", "heads", "kv_heads", "dim", "bs"), SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_on_int8_cache_matches_reference(
    lens: list[int],
    heads: int,
    kv_heads: int,
    dim: int,
    bs: int,
    q_dtype: torch.dtype,
    threads: int,
) -> None:
    g = torch.Generator().manual_seed(len(lens) + dim)
    max_blocks = max(-(-n // bs) for n in lens)
    num_blocks = len(lens) * max_blocks + 3
    cfg = tiny_model_config(
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=dim, num_hidden_layers=1
    )
    cache = KVCache(cfg, num_blocks, bs, q_dtype, cache_dtype="int8")
    kc, vc, scales = cache.layer(0)
    assert scales is not None
    for vals, sc in ((kc, scales[0]), (vc, scales[1])):
        x = torch.randn(num_blocks, bs, kv_heads, dim, generator=g)
        x *= torch.rand(num_blocks, bs, kv_heads, 1, generator=g) * 4  # scales vary by row
        q8, s = quantize(x)
        vals.copy_(q8)
        sc.copy_(s)
    q = (torch.randn(len(lens), heads, dim, generator=g) * 2).to(q_dtype)
    perm = torch.randperm(num_blocks, generator=g)[: len(lens) * max_blocks]
    tables, seq_lens = perm.view(len(lens), max_blocks), torch.tensor(lens)
    want = paged_decode_attention(q, kc, vc, tables, seq_lens, dim**-0.5, kv_scales=scales)
    assert want.dtype == q_dtype
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = decode_attention.decode_attention(q, kc, vc, tables, seq_lens, dim**-0.5, scales)
    finally:
        torch.set_num_threads(before)
    assert got is None or got.dtype == q_dtype
    _check(got, want, f"int8: lens {lens} heads {heads}/{kv_heads} dim {dim} bs {bs} {q_dtype}")


def test_kernel_on_a_real_cache_layer_at_max_context() -> None:
    """KVCache.layer's views (block stride = 2 blocks), the model's full context in one table."""
    cfg = tiny_model_config(head_dim=16, max_position_embeddings=256)
    cache = KVCache(cfg, num_blocks=40, block_size=8, dtype=torch.float32)
    cache.kv.normal_()
    kc, vc, _ = cache.layer(1)
    tables = torch.arange(40).flip(0)[:32].view(1, 32)  # 256 tokens = max_position_embeddings
    q = torch.randn(1, 4, 16)
    lens = torch.tensor([256])
    want = paged_decode_attention(q, kc, vc, tables, lens, 0.25)
    _check(decode_attention.decode_attention(q, kc, vc, tables, lens, 0.25), want, "max context")


def test_kernel_declines_what_it_does_not_take() -> None:
    q, kc, vc, tables, lens = _case([5], 4, 2, 12, 4, torch.float32, seed=0)  # dim 12: not x8
    assert decode_attention.decode_attention(q, kc, vc, tables, lens, 0.3) is None
    q, kc, vc, tables, lens = _case([5], 4, 2, 8, 4, torch.float16, seed=0)
    assert decode_attention.decode_attention(q, kc, vc, tables, lens, 0.3) is None
