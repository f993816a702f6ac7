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
    k, v = cache.layer(1)
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
    k_cache, v_cache = cache.layer(1)
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
