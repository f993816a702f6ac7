"""Triton attention kernels and backend against the torch reference.

Without CUDA the kernels run on CPU tensors in Triton's interpreter. The interpreter is chosen
when `triton` is *imported* (its standard library — `tl.sum`, `tl.zeros`, ... — is decorated
then), so this module sets ``TRITON_INTERPRET=1`` before anything imports triton. If triton was
already imported without it (another module of the same pytest run got there first), the
kernels cannot run here and the tests skip with that reason; run this file on its own. With
CUDA the same tests run the compiled kernels on the GPU.

The interpreter's `tl.dot` is wrong for bfloat16 (it multiplies the raw bit patterns), so
bfloat16 is covered by tests/gpu/test_triton_cuda.py only.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from model_runtime.attention import triton_kernels as tk
from model_runtime.attention.base import AttentionMetadata, write_kv
from model_runtime.attention.torch_ref import (
    TorchAttentionBackend,
    paged_decode_attention,
    prefill_attention,
)
from model_runtime.attention.triton_backend import TritonAttentionBackend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Both our kernels and triton's own standard library (tl.sum, ...) must be interpreted.
_INTERPRETED = all(
    isinstance(fn, InterpretedFunction) for fn in (tk._paged_attention_kernel, tl.sum)
)
if DEVICE.type == "cpu" and not _INTERPRETED:
    if os.environ.get("TRITON_INTERPRET") != "1":
        why = f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} turns the interpreter off"
    else:
        why = "triton was imported (by a plugin or an earlier test module) before this module"
    pytest.skip(
        f"no CUDA, and the Triton kernels are not interpreted: {why}; "
        "run `pytest tests/unit/test_triton_attention.py` on its own",
        allow_module_level=True,
    )

# (atol, rtol): fp32 is near-exact; fp16 allows about two ulp of the fp16 output.
TOL = {torch.float32: (2e-5, 0.0), torch.float16: (1e-3, 4e-3)}


def assert_close(
    name: str, got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float]
) -> None:
    """|got - want| <= atol + rtol * |want| elementwise, in fp32; the max abs diff is printed
    (see it with -s) and named on failure."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    atol, rtol = tol
    err = (got.float() - want.float()).abs()
    diff = err.max().item()
    print(f"{name}: max abs diff {diff:.3e}")
    bad = err > atol + rtol * want.float().abs()
    assert not bad.any(), (
        f"{name}: max abs diff {diff:.3e}, {int(bad.sum())} elements beyond "
        f"atol {atol:.0e} + rtol {rtol:.0e} * |want|"
    )


def random_caches(
    num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer view of a KVCache-shaped tensor (so the caches are strided like the real ones)."""
    kv = torch.randn(2, num_blocks, 2, block_size, kv_heads, head_dim, device=DEVICE)
    kv = kv.to(dtype)
    return kv[1, :, 0], kv[1, :, 1]


def random_tables(seq_lens: list[int], block_size: int, num_blocks: int) -> torch.Tensor:
    """Distinct, shuffled block ids per sequence; padding entries point at real blocks too."""
    need = [-(-n // block_size) for n in seq_lens]
    assert sum(need) <= num_blocks, (need, num_blocks)
    ids = torch.randperm(num_blocks).tolist()
    width = max(need) + 1
    table = torch.zeros(len(seq_lens), width, dtype=torch.long)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(ids[:n], dtype=torch.long)
        table[b, n:] = ids[n] if n < len(ids) else 0
        ids = ids[n:]
    return table.to(DEVICE)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_matches_reference(block_size: int, dtype: torch.dtype) -> None:
    torch.manual_seed(block_size)
    num_blocks, kv_heads, head_dim, tokens = 6, 3, 24, 13
    key_cache, value_cache = random_caches(num_blocks, block_size, kv_heads, head_dim, dtype)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    fused = torch.randn(tokens, 3, kv_heads, head_dim, device=DEVICE).to(dtype)
    k, v = fused[:, 1], fused[:, 2]  # strided views, as a fused QKV projection yields
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    write_kv(k, v, ref_k, ref_v, slots)
    tk.write_kv_triton(k, v, key_cache, value_cache, slots)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)


def test_write_kv_skips_negative_slots() -> None:
    key_cache, value_cache = random_caches(2, 8, 1, 16, torch.float32)
    before = key_cache.clone()
    k = torch.randn(2, 1, 16, device=DEVICE)
    tk.write_kv_triton(k, k, key_cache, value_cache, torch.tensor([-1, 3], device=DEVICE))
    before.view(-1, 1, 16)[3] = k[1]
    assert torch.equal(key_cache, before)


# (block_size, group, head_dim, dtype); seq lens below hit 1, k*bs-1, k*bs, k*bs+1.
DECODE_CASES = [
    (8, 1, 16, torch.float32),
    (16, 2, 32, torch.float32),
    (32, 4, 64, torch.float32),
    (16, 4, 128, torch.float32),
    (8, 2, 24, torch.float32),  # head_dim not a power of two: padded and masked
    (16, 2, 64, torch.float16),
]


@pytest.mark.parametrize(("block_size", "group", "head_dim", "dtype"), DECODE_CASES)
def test_decode_matches_reference(
    block_size: int, group: int, head_dim: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(block_size * 131 + group * 7 + head_dim)
    kv_heads = 2
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size, 3 * block_size + 1]
    num_blocks = 16
    key_cache, value_cache = random_caches(num_blocks, block_size, kv_heads, head_dim, dtype)
    tables = random_tables(seq_lens, block_size, num_blocks)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, device=DEVICE).to(dtype)
    scale = head_dim**-0.5
    want = paged_decode_attention(q, key_cache, value_cache, tables, lens, scale)
    got = tk.paged_decode_attention_triton(q, key_cache, value_cache, tables, lens, scale)
    assert got.dtype == dtype
    assert_close(f"decode bs={block_size} g={group} d={head_dim} {dtype}", got, want, TOL[dtype])


def test_decode_long_context() -> None:
    torch.manual_seed(1)
    block_size, seq_lens = 16, [1024, 1000, 7]
    key_cache, value_cache = random_caches(140, block_size, 1, 32, torch.float32)
    tables = random_tables(seq_lens, block_size, 140)
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=DEVICE)  # int64 lens accepted too
    q = torch.randn(3, 2, 32, device=DEVICE)
    want = paged_decode_attention(q, key_cache, value_cache, tables, lens, 0.3)
    got = tk.paged_decode_attention_triton(q, key_cache, value_cache, tables.int(), lens, 0.3)
    assert_close("decode long context", got, want, TOL[torch.float32])


@pytest.mark.parametrize(("block_size", "group"), [(8, 1), (16, 2), (32, 4)])
def test_prefill_matches_reference(block_size: int, group: int) -> None:
    """Varlen causal attention: fresh prompts, chunks after a cached prefix, a single token."""
    torch.manual_seed(block_size + group)
    kv_heads, head_dim = 2, 32
    # (cached tokens, new tokens)
    steps = [(0, 40), (block_size, block_size + 1), (2 * block_size - 1, 1), (3, 2 * block_size)]
    seq_lens = [c + n for c, n in steps]
    num_blocks = 24
    key_cache, value_cache = random_caches(
        num_blocks, block_size, kv_heads, head_dim, torch.float32
    )
    tables = random_tables(seq_lens, block_size, num_blocks)
    qsl = [0]
    for _, n in steps:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], kv_heads * group, head_dim, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    tk.paged_attention_triton(
        q, key_cache, value_cache, tables,
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        torch.arange(len(steps), dtype=torch.int32, device=DEVICE),
        max_query_len=max(n for _, n in steps), scale=0.2, out=out,
    )  # fmt: skip
    for b, seq_len in enumerate(seq_lens):
        lo, hi = qsl[b], qsl[b + 1]
        want = prefill_attention(q[lo:hi], key_cache, value_cache, tables[b], seq_len, 0.2)
        assert_close(
            f"prefill bs={block_size} g={group} seq {b}", out[lo:hi], want, TOL[torch.float32]
        )


def make_metadata(
    steps: list[tuple[int, int]], block_size: int, num_blocks: int
) -> AttentionMetadata:
    """Metadata for sequences given as (cached tokens, new tokens), like the model runner's."""
    seq_lens = [c + n for c, n in steps]
    tables = random_tables(seq_lens, block_size, num_blocks)
    qsl, slots = [0], []
    for b, (cached, new) in enumerate(steps):
        qsl.append(qsl[-1] + new)
        for pos in range(cached, cached + new):
            slots.append(int(tables[b, pos // block_size]) * block_size + pos % block_size)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=DEVICE),
        query_start_loc=qsl,
        query_lens=[n for _, n in steps],
        seq_lens=seq_lens,
        block_tables=tables,
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        decode_indices=[i for i, (_, n) in enumerate(steps) if n == 1],
        prefill_indices=[i for i, (_, n) in enumerate(steps) if n != 1],
    )


@pytest.mark.parametrize(("group", "dtype"), [(2, torch.float32), (4, torch.float16)])
def test_backend_matches_torch_backend(group: int, dtype: torch.dtype) -> None:
    """Mixed decode + prefill steps through forward(), two layers sharing one prepare()."""
    torch.manual_seed(group)
    block_size, kv_heads, head_dim, num_blocks = 16, 2, 32, 24
    steps = [(16, 1), (0, 20), (31, 1), (5, 27), (0, 1)]
    meta = make_metadata(steps, block_size, num_blocks)
    tokens = meta.query_start_loc[-1]
    triton_backend, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    assert triton_backend.name == "triton"
    triton_backend.prepare(meta)
    torch_backend.prepare(meta)
    for layer in range(2):
        key_cache, value_cache = random_caches(num_blocks, block_size, kv_heads, head_dim, dtype)
        ref_k, ref_v = key_cache.clone(), value_cache.clone()
        q = torch.randn(tokens, kv_heads * group, head_dim, device=DEVICE).to(dtype)
        k = torch.randn(tokens, kv_heads, head_dim, device=DEVICE).to(dtype)
        v = torch.randn(tokens, kv_heads, head_dim, device=DEVICE).to(dtype)
        got = triton_backend.forward(q, k, v, key_cache, value_cache, meta, 0.25)
        want = torch_backend.forward(q, k, v, ref_k, ref_v, meta, 0.25)
        assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)
        assert_close(f"backend g={group} {dtype} layer {layer}", got, want, TOL[dtype])


@pytest.mark.parametrize(
    "steps", [[(16, 1), (0, 20), (31, 1)], [(16, 1), (3, 1), (47, 1)]], ids=["mixed", "all_decode"]
)
def test_backend_takes_the_models_strided_views(steps: list[tuple[int, int]]) -> None:
    """q, k and v as the model hands them over: views split out of one [T, q+k+v heads, D]
    tensor (not contiguous). An all-decode step also takes the torch backend's shortcut."""
    torch.manual_seed(7)
    block_size, kv_heads, group, head_dim, num_blocks = 16, 2, 2, 32, 24
    meta = make_metadata(steps, block_size, num_blocks)
    tokens = meta.query_start_loc[-1]
    qkv = torch.randn(tokens, kv_heads * (group + 2), head_dim, device=DEVICE)
    q, k, v = torch.split(qkv, [kv_heads * group, kv_heads, kv_heads], dim=1)
    assert not q.is_contiguous()
    triton_backend, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    triton_backend.prepare(meta)
    torch_backend.prepare(meta)
    key_cache, value_cache = random_caches(
        num_blocks, block_size, kv_heads, head_dim, torch.float32
    )
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    got = triton_backend.forward(q, k, v, key_cache, value_cache, meta, 0.25)
    want = torch_backend.forward(q, k, v, ref_k, ref_v, meta, 0.25)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)
    assert_close("strided views", got, want, TOL[torch.float32])


def test_rejects_mismatched_inputs() -> None:
    key_cache, value_cache = random_caches(4, 8, 2, 16, torch.float32)
    tables = torch.zeros(1, 2, dtype=torch.long, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="q must be"):
        q = torch.randn(1, 3, 16, device=DEVICE)  # 3 heads over 2 KV heads
        tk.paged_decode_attention_triton(q, key_cache, value_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="share dtype"):
        q = torch.randn(1, 2, 16, device=DEVICE, dtype=torch.float16)
        tk.paged_decode_attention_triton(q, key_cache, value_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="one device"):
        q = torch.randn(1, 2, 16, device=DEVICE)
        tk.paged_decode_attention_triton(q, key_cache, value_cache, tables, lens.to("meta"), 1.0)
    with pytest.raises(ValueError, match="cache dtype"):
        k = torch.randn(1, 2, 16, device=DEVICE, dtype=torch.float16)
        tk.write_kv_triton(k, k, key_cache, value_cache, torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="share shape and strides"):
        tk.paged_decode_attention_triton(
            torch.randn(1, 2, 16, device=DEVICE), key_cache, value_cache[:2], tables, lens, 1.0
        )


def int8_layer(
    num_blocks: int, block_size: int, kv_heads: int, head_dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Layer 1 of an int8 `KVCache` (values and scales in one block), filled with quantized
    random K/V whose magnitudes vary by row."""
    from model_runtime.kv_cache import KVCache
    from model_runtime.kv_quant import quantize
    from tests.fakes.model_configs import tiny_model_config

    cfg = tiny_model_config(
        num_attention_heads=kv_heads, num_key_value_heads=kv_heads, head_dim=head_dim
    )
    cache = KVCache(cfg, num_blocks, block_size, torch.float32, DEVICE, cache_dtype="int8")
    k, v, scales = cache.layer(1)
    assert scales is not None
    g = torch.Generator().manual_seed(seed)
    for vals, sc in ((k, scales[0]), (v, scales[1])):
        x = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
        x *= torch.rand(num_blocks, block_size, kv_heads, 1, generator=g) * 4
        q8, s = quantize(x)
        vals.copy_(q8.to(DEVICE))
        sc.copy_(s.to(DEVICE))
    return k, v, scales


@pytest.mark.parametrize("block_size", [8, 16])
def test_write_kv_int8_writes_the_reference_bytes(block_size: int) -> None:
    """The Triton quantizing write gives `base.write_kv`'s bytes (values and float16 scales)
    on K/V rows of every magnitude, from strided views; a negative slot writes nothing."""
    num_blocks, kv_heads, head_dim, tokens = 6, 3, 24, 14
    key_cache, value_cache, scales = int8_layer(num_blocks, block_size, kv_heads, head_dim, 1)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    ref_scales = (scales[0].clone(), scales[1].clone())
    g = torch.Generator().manual_seed(block_size)
    fused = torch.randn(tokens, 3, kv_heads, head_dim, generator=g)
    fused *= torch.tensor([1e-6, 1e-3, 1.0, 50.0, 1e4, 1.0, 0.0] * 2)[:, None, None, None]
    fused = fused.to(DEVICE)
    k, v = fused[:, 1], fused[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens].to(DEVICE)
    write_kv(k, v, ref_k, ref_v, slots, kv_scales=ref_scales)
    tk.write_kv_triton(k, v, key_cache, value_cache, slots, kv_scales=scales)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)
    for got, want in zip(scales, ref_scales, strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    before = key_cache.clone()
    tk.write_kv_triton(k[:1], v[:1], key_cache, value_cache, slots[:1] * 0 - 1, kv_scales=scales)
    assert torch.equal(key_cache, before)


# (block_size, group, head_dim, q dtype); bf16 queries only on a GPU (the interpreter's tl.dot
# multiplies bf16 bit patterns)
INT8_CASES = [
    (8, 1, 16, torch.float32),
    (16, 2, 32, torch.float32),
    (16, 4, 64, torch.float32),
    (8, 2, 24, torch.float32),
    (16, 2, 64, torch.float16),
]


@pytest.mark.parametrize(("block_size", "group", "head_dim", "dtype"), INT8_CASES)
def test_decode_on_int8_cache_matches_reference(
    block_size: int, group: int, head_dim: int, dtype: torch.dtype
) -> None:
    kv_heads = 2
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size, 3 * block_size + 1]
    num_blocks = 16
    key_cache, value_cache, scales = int8_layer(num_blocks, block_size, kv_heads, head_dim, 2)
    tables = random_tables(seq_lens, block_size, num_blocks)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(head_dim)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=gen).to(DEVICE, dtype)
    scale = head_dim**-0.5
    want = paged_decode_attention(q, key_cache, value_cache, tables, lens, scale, kv_scales=scales)
    got = tk.paged_decode_attention_triton(q, key_cache, value_cache, tables, lens, scale, scales)
    assert got.dtype == dtype
    name = f"int8 decode bs={block_size} g={group} d={head_dim} {dtype}"
    assert_close(name, got, want, TOL[dtype])


def test_backend_on_int8_cache_matches_torch_backend() -> None:
    """Mixed decode + prefill steps through forward() on an int8 cache: the same bytes
    written, the same attention as the torch reference backend (float32 queries)."""
    block_size, kv_heads, group, head_dim, num_blocks = 16, 2, 2, 32, 24
    steps = [(16, 1), (0, 20), (31, 1), (5, 27), (0, 1)]
    meta = make_metadata(steps, block_size, num_blocks)
    tokens = meta.query_start_loc[-1]
    triton_backend, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    triton_backend.prepare(meta)
    torch_backend.prepare(meta)
    key_cache, value_cache, scales = int8_layer(num_blocks, block_size, kv_heads, head_dim, 3)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    ref_scales = (scales[0].clone(), scales[1].clone())
    g = torch.Generator().manual_seed(4)
    q = torch.randn(tokens, kv_heads * group, head_dim, generator=g).to(DEVICE)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g).to(DEVICE)
    v = torch.randn(tokens, kv_heads, head_dim, generator=g).to(DEVICE)
    got = triton_backend.forward(q, k, v, key_cache, value_cache, meta, 0.25, scales)
    want = torch_backend.forward(q, k, v, ref_k, ref_v, meta, 0.25, ref_scales)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)
    assert torch.equal(scales[0], ref_scales[0]) and torch.equal(scales[1], ref_scales[1])
    assert_close("int8 backend", got, want, TOL[torch.float32])
