"""The shared-memory data plane's pieces, in one process: a cache moved into a memfd keeps its
contents, a receiver maps it only when everything checks out, and a layer copy is exact for
every arrangement of source and destination blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtransfer.shm import PeerCache, SharedCacheSegment, ShmUnavailable
from model_runtime.kv_cache import KVCache
from tests.fakes.model_configs import tiny_model_config


def _cache(num_blocks: int, seed: int | None = None) -> KVCache:
    cache = KVCache(tiny_model_config(), num_blocks, 4, torch.float32, model_name="m")
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen))
    return cache


def test_sharing_keeps_the_contents_and_a_receiver_reads_them_exactly():
    sender = _cache(16, seed=0)
    before = sender.kv.clone()
    segment = SharedCacheSegment(sender)
    assert torch.equal(sender.kv, before), "moving into shared memory changed the cache"
    receiver = _cache(24)  # a different block count is fine
    peer = PeerCache.for_receiver(segment.info.to_dict(), receiver)
    cases = [  # (source blocks, destination blocks)
        ([3, 9, 1], [5, 6, 7]),  # destination consecutive
        ([10, 11, 12], [20, 2, 8]),  # source consecutive
        ([15, 0, 4], [1, 23, 13]),  # both scattered
        ([7], [0]),  # one block
        ([4, 5, 6], [10, 11, 12]),  # both consecutive: one contiguous copy
    ]
    for layer in range(sender.num_layers):
        for src, dst in cases:
            peer.copy_layer(layer, src, receiver, dst)
            got = receiver.gather_layer(layer, dst)
            want = sender.gather_layer(layer, src)
            assert torch.equal(got, want), (layer, src, dst, (got - want).abs().max().item())
    # The receiver reads the live cache, not a snapshot: a later write shows.
    sender.kv[0, 3].fill_(7.0)
    peer.copy_layer(0, [3], receiver, [0])
    assert torch.equal(receiver.gather_layer(0, [0]), sender.gather_layer(0, [3]))


def test_a_segment_that_does_not_check_out_is_refused_with_the_reason():
    sender = _cache(8, seed=1)
    info = SharedCacheSegment(sender).info
    receiver = _cache(8)
    with pytest.raises(ShmUnavailable, match="token"):
        PeerCache(dataclasses.replace(info, token="00" * 16))
    with pytest.raises(ShmUnavailable, match="another host"):
        PeerCache(dataclasses.replace(info, boot_id="some-other-boot"))
    with pytest.raises(ShmUnavailable, match="bytes"):
        PeerCache(
            dataclasses.replace(info, shape=(info.shape[0], info.shape[1] + 1, *info.shape[2:]))
        )
    wrong_layers = dataclasses.replace(info, shape=(info.shape[0] + 1, *info.shape[1:]))
    with pytest.raises(ShmUnavailable, match="does not fit"):
        PeerCache.for_receiver(wrong_layers.to_dict(), receiver)
    with pytest.raises(ShmUnavailable, match="malformed"):
        PeerCache.for_receiver({"pid": 1}, receiver)


def test_header_source_blocks_are_validated():
    sender = _cache(8, seed=2)
    peer = PeerCache.for_receiver(SharedCacheSegment(sender).info.to_dict(), _cache(8))
    assert peer.source_blocks([0, 7], 2) == [0, 7]
    assert peer.source_blocks([0, 8], 2) is None  # past the sender's cache
    assert peer.source_blocks([0], 2) is None  # wrong count
    assert peer.source_blocks("0,1", 2) is None


def test_workers_labelled_on_different_nodes_never_share_memory():
    """Equal labels map (also the unlabelled default); different labels refuse, even on one
    host — a multi-node Ray cluster on one machine then moves KV as gloo bytes."""
    sender = _cache(8, seed=2)
    info = SharedCacheSegment(sender, node="node-a").info
    assert info.to_dict()["node"] == "node-a"
    receiver = _cache(8)
    assert PeerCache.for_receiver(info.to_dict(), receiver, node="node-a").num_blocks == 8
    with pytest.raises(ShmUnavailable, match="labels differ"):
        PeerCache.for_receiver(info.to_dict(), receiver, node="node-b")
    unlabelled = {k: v for k, v in dataclasses.replace(info, node="").to_dict().items()}
    unlabelled.pop("node")  # a record from before labels: read as ""
    assert PeerCache.for_receiver(unlabelled, receiver).num_blocks == 8
