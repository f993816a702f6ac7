"""The CPU backends (torch reference, and `cpu`: compiled decode attention) on a mixed step:
decode rows beside a long prefill give what each row's own single-sequence attention gives
(the decode gather is trimmed to the decode rows' context and its mask is built once per step,
not per layer); and on an all-decode step."""

from __future__ import annotations

import pytest
import torch

from model_runtime.attention.base import AttentionMetadata
from model_runtime.attention.cpu_backend import CpuAttentionBackend
from model_runtime.attention.torch_ref import (
    TorchAttentionBackend,
    decode_mask,
    paged_decode_attention,
    prefill_attention,
)
from model_runtime.kernels import decode_attention

BS, H, HKV, D = 4, 4, 2, 8
BACKENDS = [
    TorchAttentionBackend,
    pytest.param(
        CpuAttentionBackend,
        marks=pytest.mark.skipif(
            decode_attention.load() is None,
            reason=f"decode kernel unavailable: {decode_attention.unavailable_reason()}",
        ),
    ),
]


def test_decode_mask() -> None:
    mask = decode_mask(torch.tensor([1, 3]), 4)
    assert mask.tolist() == [[True, False, False, False], [True, True, True, False]]


def _mixed_step() -> AttentionMetadata:
    """Sequence 0: decode at context 5 (2 blocks); 1: a 20-token prefill (5 blocks, so
    meta.block_tables is 5 wide); 2: decode at context 3 (1 block)."""
    tables = torch.tensor([[3, 7, 0, 0, 0], [10, 11, 12, 13, 14], [20, 0, 0, 0, 0]])
    seq_lens = [5, 20, 3]
    slots = [tables[0, 4 // BS].item() * BS + 4 % BS]  # each new token's cache slot
    slots += [tables[1, p // BS].item() * BS + p % BS for p in range(20)]
    slots += [tables[2, 2 // BS].item() * BS + 2 % BS]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=[0, 1, 21, 22],
        query_lens=[1, 20, 1],
        seq_lens=seq_lens,
        block_tables=tables,
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        decode_indices=[0, 2],
        prefill_indices=[1],
    )


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_mixed_step_matches_per_sequence_reference(
    backend_cls: type[TorchAttentionBackend],
) -> None:
    torch.manual_seed(0)
    kc, vc = torch.randn(32, BS, HKV, D), torch.randn(32, BS, HKV, D)
    meta = _mixed_step()
    tables, seq_lens, starts = meta.block_tables, meta.seq_lens, meta.query_start_loc
    t = starts[-1]
    q = torch.randn(t, H, D)
    k, v = torch.randn(t, HKV, D), torch.randn(t, HKV, D)
    backend = backend_cls()
    backend.prepare(meta)
    out = backend.forward(q, k, v, kc, vc, meta, 0.3)
    for i in range(3):
        lo, hi = starts[i], starts[i + 1]
        want = prefill_attention(q[lo:hi], kc, vc, tables[i], seq_lens[i], 0.3)
        torch.testing.assert_close(out[lo:hi], want, atol=1e-5, rtol=1e-5)
    if backend_cls is TorchAttentionBackend:  # the reference's gather: trimmed, mask reused
        assert backend._decode_tables.shape == (2, 2)  # from 5 blocks to the decodes' 2
        mask = backend._decode_mask
        backend.forward(q, k, v, kc, vc, meta, 0.3)  # a second layer of the same step
        assert backend._decode_mask is mask
    # The precomputed mask changes nothing against the function building its own.
    rows = torch.tensor([starts[0], starts[2]])  # the decode rows' token positions
    lens = torch.tensor([5, 3])
    own = paged_decode_attention(q.index_select(0, rows), kc, vc, tables[[0, 2], :2], lens, 0.3)
    torch.testing.assert_close(out.index_select(0, rows), own)


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_all_decode_step_matches_per_sequence_reference(
    backend_cls: type[TorchAttentionBackend],
) -> None:
    """A step of decode rows only (a decode worker's every step) skips the row scatter; each
    row still gets its own sequence's attention, and K/V land in the cache."""
    torch.manual_seed(1)
    kc, vc = torch.randn(32, BS, HKV, D), torch.randn(32, BS, HKV, D)
    tables = torch.tensor([[3, 7, 9], [20, 0, 0]])  # contexts 10 (3 blocks) and 2 (1 block)
    seq_lens = [10, 2]
    q = torch.randn(2, H, D)
    k, v = torch.randn(2, HKV, D), torch.randn(2, HKV, D)
    slots = [9 * BS + 1, 20 * BS + 1]  # position 9 of sequence 0, position 1 of sequence 1
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=[0, 1, 2],
        query_lens=[1, 1],
        seq_lens=seq_lens,
        block_tables=tables,
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        decode_indices=[0, 1],
        prefill_indices=[],
    )
    backend = backend_cls()
    backend.prepare(meta)
    out = backend.forward(q, k, v, kc, vc, meta, 0.3)
    assert out.shape == q.shape
    torch.testing.assert_close(kc[9, 1], k[0], rtol=0, atol=0)
    torch.testing.assert_close(vc[20, 1], v[1], rtol=0, atol=0)
    for i in range(2):
        want = prefill_attention(q[i : i + 1], kc, vc, tables[i], seq_lens[i], 0.3)
        torch.testing.assert_close(out[i : i + 1], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_int8_cache_step_is_attention_over_the_dequantized_cache(
    backend_cls: type[TorchAttentionBackend], q_dtype: torch.dtype
) -> None:
    """On an int8 cache a mixed step writes the step's K/V quantized and attends over the
    dequantized cache in float32 (the step's own tokens included): the same numbers as a
    float32 cache holding `dequantize(quantize(.))` of every K/V, rounded to q's dtype."""
    from model_runtime.kv_cache import KVCache
    from model_runtime.kv_quant import dequantize, quantize
    from tests.fakes.model_configs import tiny_model_config

    g = torch.Generator().manual_seed(2)
    cfg = tiny_model_config(num_attention_heads=H, num_key_value_heads=HKV, head_dim=D)
    cache = KVCache(cfg, 32, BS, q_dtype, cache_dtype="int8")
    kc8, vc8, scales = cache.layer(0)
    assert scales is not None
    old_k, old_v = (
        torch.randn(32, BS, HKV, D, generator=g),
        torch.randn(32, BS, HKV, D, generator=g),
    )
    for vals, sc, x in ((kc8, scales[0], old_k), (vc8, scales[1], old_v)):
        q8, s = quantize(x)
        vals.copy_(q8)
        sc.copy_(s)
    ref_k, ref_v = dequantize(kc8, scales[0]), dequantize(vc8, scales[1])  # float32 cache
    meta = _mixed_step()
    q = torch.randn(22, H, D, generator=g).to(q_dtype)
    k = torch.randn(22, HKV, D, generator=g).to(q_dtype)
    v = torch.randn(22, HKV, D, generator=g).to(q_dtype)
    backend = backend_cls()
    backend.prepare(meta)
    out = backend.forward(q, k, v, kc8, vc8, meta, 0.3, kv_scales=scales)
    assert out.dtype == q_dtype
    # the float32 reference: the same quantized-then-dequantized K/V written at the slots
    k_dq, v_dq = dequantize(*quantize(k)), dequantize(*quantize(v))
    ref = TorchAttentionBackend()
    ref.prepare(meta)
    want = ref.forward(q.float(), k_dq, v_dq, ref_k, ref_v, meta, 0.3).to(q_dtype)
    torch.testing.assert_close(ref_k, dequantize(kc8, scales[0]), rtol=0, atol=0)
    torch.testing.assert_close(ref_v, dequantize(vc8, scales[1]), rtol=0, atol=0)
    tol = 1e-5 if q_dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
