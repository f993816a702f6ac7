"""Compiled Triton attention on a CUDA device against the torch reference, at serving sizes.

tests/unit/test_triton_attention.py covers the same kernels (on the GPU too, when present) at
small shapes; this file adds bfloat16 (wrong in Triton's CPU interpreter), realistic head dims,
GQA ratios, batch sizes and contexts, the KVCache layer views, and `get_backend` selection.
triton is imported inside the tests so that collecting this module on a CPU-only machine does
not import triton before the unit tests can switch on its interpreter.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from model_runtime.attention.base import AttentionMetadata
from model_runtime.attention.select import get_backend
from model_runtime.attention.torch_ref import TorchAttentionBackend, paged_decode_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device to run compiled Triton kernels"
    ),
]

CUDA = torch.device("cuda")
# (atol, rtol), about two ulp of the output dtype.
TOL = {
    torch.float32: (2e-5, 0.0),
    torch.float16: (1e-3, 4e-3),
    torch.bfloat16: (8e-3, 3e-2),
}


@pytest.fixture(scope="module")
def tk() -> ModuleType:
    """The kernel module, refusing interpreted kernels (they would not test the compiler)."""
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    from model_runtime.attention import triton_kernels

    if isinstance(triton_kernels._paged_attention_kernel, InterpretedFunction):
        pytest.skip("TRITON_INTERPRET=1 is set in this process; GPU tests need compiled kernels")
    return triton_kernels


def assert_close(
    name: str, got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float]
) -> None:
    """Elementwise |got - want| <= atol + rtol * |want|; prints the max abs diff."""
    atol, rtol = tol
    err = (got.float() - want.float()).abs()
    diff = err.max().item()
    print(f"{name}: max abs diff {diff:.3e}")
    bad = err > atol + rtol * want.float().abs()
    assert not bad.any(), f"{name}: max abs diff {diff:.3e}, {int(bad.sum())} elements off"


def shuffled_tables(seq_lens: list[int], block_size: int, num_blocks: int) -> torch.Tensor:
    """Distinct, shuffled block ids per sequence, padded with 0."""
    need = [-(-n // block_size) for n in seq_lens]
    ids = torch.randperm(num_blocks)[: sum(need)].tolist()
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.long)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    return table.to(CUDA)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("block_size", "heads", "kv_heads", "head_dim"), [
    (16, 32, 32, 128),  # Llama-2-7B
    (16, 32, 8, 128),  # Llama-3-8B
    (32, 14, 2, 64),  # Qwen2-0.5B
    (8, 16, 2, 96),  # head_dim padded to 128
])  # fmt: skip
def test_decode_serving_sizes(
    tk: ModuleType,
    dtype: torch.dtype,
    block_size: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> None:
    torch.manual_seed(0)
    lens = [1, block_size, block_size + 1, 4096, 4095, *torch.randint(1, 3000, (27,)).tolist()]
    num_blocks = sum(-(-n // block_size) for n in lens) + 8
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=CUDA).to(dtype)
    value_cache = torch.randn_like(key_cache)
    tables = shuffled_tables(lens, block_size, num_blocks)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=CUDA)
    q = torch.randn(len(lens), heads, head_dim, device=CUDA).to(dtype)
    scale = head_dim**-0.5
    want = paged_decode_attention(q, key_cache, value_cache, tables, seq_lens, scale)
    got = tk.paged_decode_attention_triton(q, key_cache, value_cache, tables, seq_lens, scale)
    assert_close(f"decode {dtype} bs={block_size} {heads}/{kv_heads}x{head_dim}", got, want,
                 TOL[dtype])  # fmt: skip


def mixed_step(block_size: int, num_blocks: int) -> AttentionMetadata:
    """A step of decode rows and prefill chunks after cached prefixes, on shuffled blocks."""
    steps = [(100, 1), (0, 300), (47, 1), (64, 129), (0, 1), (4000, 1)]  # (cached, new)
    seq_lens = [c + n for c, n in steps]
    tables = shuffled_tables(seq_lens, block_size, num_blocks)
    qsl, slots = [0], []
    for b, (cached, new) in enumerate(steps):
        qsl.append(qsl[-1] + new)
        slots += [int(tables[b, p // block_size]) * block_size + p % block_size
                  for p in range(cached, cached + new)]  # fmt: skip
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=CUDA),
        query_start_loc=qsl,
        query_lens=[n for _, n in steps],
        seq_lens=seq_lens,
        block_tables=tables,
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=CUDA),
        decode_indices=[i for i, (_, n) in enumerate(steps) if n == 1],
        prefill_indices=[i for i, (_, n) in enumerate(steps) if n != 1],
    )


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.bfloat16, "auto"),
        (torch.float32, "auto"),
        (torch.bfloat16, "int8"),
        (torch.float16, "int8"),
        (torch.float32, "int8"),
    ],
)
def test_backend_on_kv_cache_layers(tk: ModuleType, dtype: torch.dtype, cache_dtype: str) -> None:
    """get_backend('auto', cuda) is Triton; a mixed step over two real `KVCache` layers. The
    Triton write gives the torch write's bytes; on an int8 cache (values + float16 scales per
    block) the attention is the reference's float32 attention over the dequantized cache
    (bfloat16 queries there: the CPU interpreter cannot run them, so only here)."""
    from model_runtime.attention.triton_backend import TritonAttentionBackend
    from model_runtime.kv_cache import KVCache
    from tests.fakes.model_configs import tiny_model_config

    backend = get_backend("auto", CUDA)
    assert isinstance(backend, TritonAttentionBackend)
    torch.manual_seed(1)
    block_size, heads, kv_heads, head_dim, num_blocks = 16, 32, 8, 128, 512
    meta = mixed_step(block_size, num_blocks)
    qsl = meta.query_start_loc
    cfg = tiny_model_config(
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim
    )
    cache = KVCache(cfg, num_blocks, block_size, dtype, CUDA, cache_dtype=cache_dtype)
    if cache.quantized:
        cache.kv.copy_(torch.randint(-127, 128, cache.kv.shape, device=CUDA))
        for layer in range(2):  # sane scales (random bytes hold NaN/inf float16 patterns)
            for scales in cache.layer(layer).scales or ():
                scales.copy_(torch.rand(scales.shape, device=CUDA) * 0.05)
    else:
        cache.kv.normal_()
    ref = KVCache(cfg, num_blocks, block_size, dtype, CUDA, cache_dtype=cache_dtype)
    ref.kv.copy_(cache.kv)
    reference = TorchAttentionBackend()
    backend.prepare(meta)
    reference.prepare(meta)
    for layer in range(2):
        q = torch.randn(qsl[-1], heads, head_dim, device=CUDA).to(dtype)
        qkv = torch.randn(qsl[-1], 2, kv_heads, head_dim, device=CUDA).to(dtype)
        k, v = qkv[:, 0], qkv[:, 1]
        mine, theirs = cache.layer(layer), ref.layer(layer)
        got = backend.forward(q, k, v, mine.key, mine.value, meta, head_dim**-0.5, mine.scales)
        want = reference.forward(q, k, v, theirs.key, theirs.value, meta, head_dim**-0.5,
                                 theirs.scales)  # fmt: skip
        assert torch.equal(cache.kv[layer], ref.kv[layer]), f"layer {layer}: caches differ"
        assert_close(f"backend {dtype} {cache_dtype} layer {layer}", got, want, TOL[dtype])
