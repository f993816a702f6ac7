"""Which data plane a pair of workers uses, and the same-host offer behind it. Runs in prefill
and decode workers (the transport's constructor and the receiver's join handling).

Three planes, decided per pair at ``join`` (sender cache / receiver cache: offer in the join
record -> when the receiver can map it -> the pair's group and layer message):

- CPU / CPU: memfd (`kvtransfer.shm`) -> same host and node label -> gloo, a notification;
- CUDA / CUDA: CUDA IPC (`kvtransfer.cuda_ipc`) -> same host, node label and physical GPU
  -> gloo, a notification;
- anything else (no offer, or one that does not map): the layer's bytes, over gloo between
  CPU caches and NCCL between CUDA caches.

A notified pair's group is gloo whatever the device (its messages are CPU control tensors), so
two workers on one GPU never need two NCCL ranks on one device, which NCCL refuses.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from kvtransfer import rendezvous as rdv
from kvtransfer.cuda_ipc import KIND as CUDA_IPC
from kvtransfer.cuda_ipc import CudaPeerCache, CudaSegmentInfo, SharedCudaCache
from kvtransfer.shm import PeerCache, SegmentInfo, SharedCacheSegment, ShmUnavailable
from model_runtime.kv_cache import KVCache

log = logging.getLogger(__name__)

MEMFD = "memfd"
CPU = torch.device("cpu")


class PeerKV(Protocol):
    """A sender's cache as a receiver sees it on a notified pair."""

    @property
    def num_blocks(self) -> int: ...

    def source_blocks(self, src: Any, n_blocks: int) -> list[int] | None: ...

    def copy_layer(
        self, layer: int, src_ids: list[int], dst: KVCache, dst_ids: list[int]
    ) -> None: ...


Offer = SegmentInfo | CudaSegmentInfo


def offer_kind(record: Any) -> str:
    """The plane a join record's offer asks for (a memfd offer predates the `kind` key)."""
    return str(record.get("kind", MEMFD)) if isinstance(record, dict) else "?"


def plane_for(cache_device: torch.device, kind: str) -> str | None:
    """The offer kind a receiver whose cache is on `cache_device` can map (None: none)."""
    if cache_device.type == "cpu" and kind == MEMFD:
        return MEMFD
    if cache_device.type == "cuda" and kind == CUDA_IPC:
        return CUDA_IPC
    return None


def share_cache(cache: KVCache, node: str = "") -> Offer | None:
    """Make `cache` mappable by same-host peers (memfd for a CPU cache, a CUDA IPC export for
    a CUDA one) and return the offer; None (bytes only) where that cannot be done. Call before
    the cache serves a step: it moves the cache's tensor."""
    try:
        if cache.device.type == "cuda":
            return SharedCudaCache(cache, node).info
        if cache.device.type == "cpu":
            return SharedCacheSegment(cache, node).info
    except ShmUnavailable as exc:
        log.warning("kvtransfer: same-host plane off: %s", exc)
        return None
    log.warning("kvtransfer: no same-host plane for a cache on %s", cache.device)
    return None


def map_offer(record: Any, cache: KVCache, node: str = "") -> PeerKV:
    """The sender's cache behind a join record's offer, mapped for this receiver; raises
    ShmUnavailable (with the reason) when this receiver cannot use it."""
    kind = offer_kind(record)
    plane = plane_for(cache.device, kind)
    if plane == MEMFD:
        return PeerCache.for_receiver(record, cache, node)
    if plane == CUDA_IPC:
        return CudaPeerCache.for_receiver(record, cache, node)
    raise ShmUnavailable(f"a {kind!r} offer cannot be mapped by a cache on {cache.device}")


def pair_backend(cache_device: torch.device, notified: bool) -> rdv.Backend:
    """The process-group backend of one pair: gloo for a notified pair (CPU control messages
    only), else what the cache's device moves bytes with (`rendezvous.backend_for`)."""
    return "gloo" if notified else rdv.backend_for(cache_device)


def control_device(cache_device: torch.device, notified: bool) -> torch.device:
    """Where a pair's control messages live: the CPU on a notified (gloo) pair, else the
    cache's device (NCCL sends device tensors)."""
    return CPU if notified else cache_device
