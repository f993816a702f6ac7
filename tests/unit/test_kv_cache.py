"""KVCache layout: block-major layers, zero-copy runs, gather/scatter, and writes through the
strided per-layer key/value views."""

from __future__ import annotations

import pytest
import torch

from model_runtime.attention.base import write_kv
from model_runtime.config import ModelConfig
from model_runtime.kv_cache import KVCache
from tests.fakes.model_configs import tiny_model_config


def tiny_config() -> ModelConfig:
    return tiny_model_config(vocab_size=64, intermediate_size=64, num_hidden_layers=3, head_dim=16)


def filled_cache(num_blocks: int = 8, block_size: int = 4) -> KVCache:
    cache = KVCache(tiny_config(), num_blocks, block_size, torch.float32)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(0)))
    return cache


def test_layer_views_are_the_halves_of_each_block() -> None:
    cache = filled_cache()
    k, v, _ = cache.layer(1)
    assert k.shape == (8, 4, 2, 16) and v.shape == k.shape
    assert torch.equal(k[5], cache.kv[1, 5, 0]) and torch.equal(v[5], cache.kv[1, 5, 1])
    assert k.data_ptr() == cache.kv[1].data_ptr()  # views, not copies


def test_a_run_of_consecutive_blocks_is_a_contiguous_view() -> None:
    cache = filled_cache()
    assert cache.run_start([3, 4, 5]) == 3
    run = cache.layer_slice(2, 3, 3)
    assert run.is_contiguous()
    assert run.shape == cache.message_shape(3)
    assert run.data_ptr() == cache.kv[2, 3].data_ptr()
    assert torch.equal(run, cache.gather_layer(2, [3, 4, 5]))
    assert cache.run_start([3, 5]) is None
    assert cache.run_start([4, 3]) is None
    assert cache.run_start([]) is None


def test_gather_scatter_round_trip_and_shape_check() -> None:
    src, dst = filled_cache(), KVCache(tiny_config(), 8, 4, torch.float32)
    data = src.gather_layer(0, [6, 1, 3])
    assert data.shape == src.message_shape(3)
    dst.scatter_layer(0, [2, 7, 0], data)
    assert torch.equal(dst.gather_layer(0, [2, 7, 0]), data)
    assert torch.count_nonzero(dst.kv[0, [1, 3, 4, 5, 6]]) == 0
    with pytest.raises(ValueError, match="scatter_layer"):
        dst.scatter_layer(0, [2, 7], data)


def test_copy_blocks_copies_every_layer() -> None:
    cache = filled_cache()
    cache.copy_blocks([1, 2], [6, 7])
    assert torch.equal(cache.kv[:, 6:8], cache.kv[:, 1:3])


def test_write_kv_into_strided_layer_views_lands_in_the_right_slots() -> None:
    cache = KVCache(tiny_config(), 6, 4, torch.float32)
    k_cache, v_cache, _ = cache.layer(1)
    slots = torch.tensor([0, 5, 23, 9])  # blocks 0, 1, 5, 2 at offsets 0, 1, 3, 1
    k = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(1))
    v = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(2))
    write_kv(k, v, k_cache, v_cache, slots)
    for i, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, 4)
        assert torch.equal(cache.kv[1, block, 0, offset], k[i])
        assert torch.equal(cache.kv[1, block, 1, offset], v[i])
    assert torch.count_nonzero(cache.kv[0]) == 0 and torch.count_nonzero(cache.kv[2]) == 0
    written = torch.count_nonzero(cache.kv[1].abs().sum(dim=(-1, -2)))
    assert written == 8  # 4 tokens x (K, V), nothing else touched


def int8_cache(num_blocks: int = 6, block_size: int = 4) -> KVCache:
    return KVCache(tiny_config(), num_blocks, block_size, torch.bfloat16, cache_dtype="int8")


def test_int8_block_holds_values_then_scales_in_one_run_of_bytes() -> None:
    """The layout `model_runtime.kv_cache` draws: per block of a layer, K values, V values, K
    scales, V scales, contiguous; the views point exactly there."""
    cache = int8_cache()
    bs, h, d = 4, 2, 16
    assert cache.kv.shape == (3, 6, 2 * bs * h * (d + 2)) and cache.kv.dtype == torch.int8
    assert cache.layout.cache_dtype == "int8" and cache.layout.dtype == "bfloat16"
    assert cache.model_dtype == torch.bfloat16 and cache.dtype == torch.int8
    assert cache.message_shape(3) == (3, cache.kv.shape[2])
    k, v, scales = cache.layer(2)
    assert scales is not None
    ks, vs = scales
    base = cache.kv[2, 0].data_ptr()
    assert k.shape == v.shape == (6, bs, h, d) and ks.shape == vs.shape == (6, bs, h)
    assert ks.dtype == vs.dtype == torch.float16
    offsets = [t.data_ptr() - base for t in (k, v, ks, vs)]
    assert offsets == [0, bs * h * d, 2 * bs * h * d, 2 * bs * h * d + 2 * bs * h]
    assert k.stride(0) == v.stride(0) == cache.kv.shape[2]  # one block to the next
    assert ks.stride(0) * 2 == cache.kv.shape[2]


def test_int8_block_bytes_and_capacity() -> None:
    cfg = tiny_config()
    bf16 = KVCache.bytes_per_block(cfg, 16, torch.bfloat16)
    i8 = KVCache.bytes_per_block(cfg, 16, torch.bfloat16, "int8")
    assert i8 == int8_cache(block_size=16).kv[:, 0].numel()
    assert i8 / bf16 == (16 + 2) / (2 * 16)  # head_dim 16: values + scale against bf16
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVCache.bytes_per_block(cfg, 16, torch.bfloat16, "fp4")


def test_write_kv_quantizes_into_int8_views() -> None:
    from model_runtime.kv_quant import dequantize, quantize

    cache = int8_cache()
    k_cache, v_cache, scales = cache.layer(1)
    slots = torch.tensor([0, 5, 23, 9])  # blocks 0, 1, 5, 2 at offsets 0, 1, 3, 1
    k = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    v = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(2)).bfloat16()
    write_kv(k, v, k_cache, v_cache, slots, kv_scales=scales)
    assert scales is not None
    for i, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, 4)
        for x, vals, sc in ((k, k_cache, scales[0]), (v, v_cache, scales[1])):
            q, s = quantize(x[i])
            assert torch.equal(vals[block, offset], q) and torch.equal(sc[block, offset], s)
            got = dequantize(vals[block, offset], sc[block, offset])
            assert (got - x[i].float()).abs().max() <= s.float().max()
    assert torch.count_nonzero(cache.kv[0]) == 0 and torch.count_nonzero(cache.kv[2]) == 0
    untouched = [b for b in range(6) if b not in (0, 1, 5, 2)]
    assert torch.count_nonzero(cache.kv[1, untouched]) == 0


def test_int8_blocks_move_whole_with_their_scales() -> None:
    """gather/scatter and copy_blocks carry values and scales together, byte for byte."""
    src, dst = int8_cache(), int8_cache()
    src.kv.copy_(torch.randint(-127, 128, src.kv.shape, generator=torch.Generator().manual_seed(0)))
    data = src.gather_layer(1, [4, 0, 2])
    dst.scatter_layer(1, [1, 5, 3], data)
    for s, d in ((4, 1), (0, 5), (2, 3)):
        for a, b in zip(src.layer(1).key[s], dst.layer(1).key[d], strict=True):
            assert torch.equal(a, b)
        scales_s, scales_d = src.layer(1).scales, dst.layer(1).scales
        assert scales_s is not None and scales_d is not None
        assert torch.equal(scales_s[1][s].view(torch.int16), scales_d[1][d].view(torch.int16))
    src.copy_blocks([0, 2], [5, 3])
    assert torch.equal(src.kv[:, 5], src.kv[:, 0]) and torch.equal(src.kv[:, 3], src.kv[:, 2])


@pytest.mark.parametrize(
    ("name", "overrides", "want"),
    [
        ("tiny", {"hidden_size": 128, "num_hidden_layers": 4, "head_dim": 32}, 1.8),
        (
            "smollm2-135m",
            {
                "hidden_size": 576,
                "num_hidden_layers": 30,
                "num_attention_heads": 9,
                "num_key_value_heads": 3,
                "head_dim": 64,
            },
            1.9,
        ),
    ],
)
def test_a_memory_budget_holds_about_twice_the_int8_blocks(
    name: str, overrides: dict[str, int], want: float
) -> None:
    """The engine derives `num_kv_blocks` from `kv_cache_memory_mb` with the cache dtype's
    block bytes: at the same memory an int8 cache holds >= 1.8x a bfloat16 cache's blocks
    (head_dim 32: 64 / 34 bytes per token and head; 64: 128 / 66), so the decode pool admits
    that many more requests."""
    from model_runtime.engine import num_kv_blocks_for
    from model_runtime.engine_config import EngineConfig

    cfg = tiny_model_config(**overrides)
    blocks = {
        kv: num_kv_blocks_for(
            EngineConfig(kv_cache_memory_mb=64, dtype="bfloat16", kv_cache_dtype=kv), cfg
        )
        for kv in ("auto", "int8")
    }
    ratio = blocks["int8"] / blocks["auto"]
    assert ratio >= want, f"{name}: {blocks} ({ratio:.3f}x)"
    per_block = KVCache.bytes_per_block(cfg, 16, torch.bfloat16, "int8")
    assert blocks["int8"] == 64 * 2**20 // per_block
