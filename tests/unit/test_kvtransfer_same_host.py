"""The same-host plane's choices and the CUDA IPC offer, without a GPU: which offer a receiver
maps (memfd / CUDA IPC / none), the pair's backend and control device, the offer's JSON round
trip, the checks a receiver makes before it opens a handle, and the block runs of a copy."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from kvtransfer.cuda_ipc import (
    HEADER_BYTES,
    KIND,
    CudaPeerCache,
    CudaSegmentInfo,
    SharedCudaCache,
    block_runs,
    check_offer,
)
from kvtransfer.same_host import (
    MEMFD,
    control_device,
    map_offer,
    offer_kind,
    pair_backend,
    plane_for,
    share_cache,
)
from kvtransfer.shm import PeerCache, ShmUnavailable, boot_id
from model_runtime.kv_cache import KVCache
from tests.fakes.model_configs import tiny_model_config

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _cache(num_blocks: int = 8) -> KVCache:
    return KVCache(tiny_model_config(), num_blocks, 4, torch.float32, model_name="m")


def _offer(cache: KVCache, **changes: object) -> CudaSegmentInfo:
    """An offer as a sender of `cache`'s layout on this host would make (fields per change)."""
    shape = tuple(cache.kv.shape)
    info = CudaSegmentInfo(
        pid=1234,
        boot_id=boot_id(),
        device_uuid="GPU-aaaa",
        handle="ab" * 32,
        storage_size=HEADER_BYTES + cache.kv.numel() * 4,
        storage_offset=512,
        ref_counter_handle="cd" * 8,
        ref_counter_offset=16,
        event_handle="",
        event_sync_required=False,
        token="ef" * 16,
        shape=shape,
        itemsize=4,
        node="n1",
    )
    return dataclasses.replace(info, **changes)  # type: ignore[arg-type]


def test_each_cache_device_maps_only_its_own_kind_of_offer():
    assert plane_for(CPU, MEMFD) == MEMFD
    assert plane_for(CUDA, KIND) == KIND
    assert plane_for(CPU, KIND) is None  # a CPU receiver cannot use a GPU's cache
    assert plane_for(CUDA, MEMFD) is None  # nor a GPU receiver a memfd (it would copy H2D)
    assert offer_kind({"pid": 1}) == MEMFD  # offers from before the kind key
    assert offer_kind({"kind": KIND}) == KIND


def test_a_notified_pair_is_gloo_with_cpu_control_messages_on_any_device():
    assert pair_backend(CUDA, notified=True) == "gloo"  # two workers on one GPU: no NCCL
    assert pair_backend(CUDA, notified=False) == "nccl"  # different GPUs: bytes over NCCL
    assert pair_backend(CPU, notified=False) == "gloo"
    assert control_device(CUDA, notified=True) == CPU
    assert control_device(CUDA, notified=False) == CUDA
    assert control_device(CPU, notified=False) == CPU


def test_cuda_offer_round_trips_through_json():
    info = _offer(_cache())
    record = json.loads(json.dumps(info.to_dict()))
    assert record["kind"] == KIND
    assert offer_kind(record) == KIND
    assert CudaSegmentInfo.from_dict(record) == info
    with pytest.raises(ValueError, match="not a cuda_ipc record"):
        CudaSegmentInfo.from_dict({**record, "kind": MEMFD})


def test_memfd_offer_names_its_kind_and_a_cpu_receiver_maps_it():
    sender = _cache()
    offer = share_cache(sender, node="n1")
    assert offer is not None
    record = json.loads(json.dumps(offer.to_dict()))
    assert offer_kind(record) == MEMFD
    assert isinstance(map_offer(record, _cache(12), node="n1"), PeerCache)


def test_a_cpu_receiver_refuses_a_cuda_offer_without_touching_cuda():
    with pytest.raises(ShmUnavailable, match="cannot be mapped by a cache on cpu"):
        map_offer(_offer(_cache()).to_dict(), _cache(), node="n1")
    with pytest.raises(ShmUnavailable, match="not a GPU"):
        CudaPeerCache.for_receiver(_offer(_cache()).to_dict(), _cache(), node="n1")


def test_a_cpu_cache_cannot_be_exported_through_cuda_ipc():
    with pytest.raises(ShmUnavailable, match="must be on a CUDA device"):
        SharedCudaCache(_cache())


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"node": "n2"}, "labels differ"),
        ({"boot_id": "another-host"}, "another host"),
        ({"device_uuid": "GPU-bbbb"}, "different devices move bytes over NCCL"),
        ({"itemsize": 2}, "item size"),
        ({"storage_size": 10}, "the storage holds 10 bytes"),
    ],
)
def test_check_offer_refuses_what_does_not_fit(changes: dict[str, object], why: str):
    cache = _cache()
    check_offer(_offer(cache), cache, "n1", "GPU-aaaa")  # the unchanged offer fits
    with pytest.raises(ShmUnavailable, match=why):
        check_offer(_offer(cache, **changes), cache, "n1", "GPU-aaaa")


def test_check_offer_allows_another_block_count_but_not_another_block_shape():
    cache = _cache(8)
    shape = list(cache.kv.shape)
    more = (shape[0], 20, *shape[2:])
    size = HEADER_BYTES + int(torch.Size(more).numel()) * 4
    check_offer(_offer(cache, shape=more, storage_size=size), cache, "n1", "GPU-aaaa")
    other = (shape[0], shape[1], shape[2], shape[3] * 2, *shape[4:])
    with pytest.raises(ShmUnavailable, match="does not fit"):
        check_offer(_offer(cache, shape=other), cache, "n1", "GPU-aaaa")


def test_an_int8_cache_offers_whole_blocks_to_int8_receivers_only():
    """An int8 cache's CUDA IPC offer is its [layers, blocks, block bytes] int8 tensor (values
    and scales; the receiver's plan copies whole blocks of it): an int8 receiver with another
    block count takes it, a bfloat16 receiver of the same model does not; the memfd plane
    maps an int8 sender's segment the same way."""

    def int8(num_blocks: int) -> KVCache:
        return KVCache(tiny_model_config(), num_blocks, 4, torch.bfloat16, cache_dtype="int8")

    sender = int8(8)
    shape = tuple(sender.kv.shape)
    assert len(shape) == 3 and sender.kv.element_size() == 1
    more = (shape[0], 20, shape[2])
    offer = _offer(sender, shape=more, itemsize=1, storage_size=HEADER_BYTES + math.prod(more))
    check_offer(offer, sender, "n1", "GPU-aaaa")
    bf16 = KVCache(tiny_model_config(), 20, 4, torch.bfloat16)
    with pytest.raises(ShmUnavailable, match="does not fit"):
        check_offer(offer, bf16, "n1", "GPU-aaaa")
    segment = share_cache(sender, node="n1")
    assert segment is not None
    assert isinstance(map_offer(segment.to_dict(), int8(12), node="n1"), PeerCache)
    with pytest.raises(ShmUnavailable, match="does not fit"):
        map_offer(segment.to_dict(), bf16, node="n1")


def test_block_runs_are_maximal_on_both_sides():
    assert block_runs([4, 5, 6], [10, 11, 12]) == [(4, 10, 3)]
    assert block_runs([4, 5, 9], [10, 11, 12]) == [(4, 10, 2), (9, 12, 1)]
    assert block_runs([4, 5, 6], [10, 12, 13]) == [(4, 10, 1), (5, 12, 2)]
    assert block_runs([], []) == []


def test_block_runs_equal_a_plain_scan_on_random_lists():
    import random

    def scan(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
        runs: list[tuple[int, int, int]] = []
        for s, d in zip(src, dst, strict=True):
            if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((s, d, 1))
        return runs

    rng = random.Random(7)
    for n in (1, 2, 5, 40, 300):
        for _ in range(20):
            src = (
                sorted(rng.sample(range(2 * n), n))
                if rng.random() < 0.5
                else rng.sample(range(2 * n), n)
            )
            dst = list(range(n)) if rng.random() < 0.5 else rng.sample(range(3 * n), n)
            assert block_runs(src, dst) == scan(src, dst)
    with pytest.raises(ValueError):
        block_runs([1, 2], [1])
