"""Same-device data plane of the torch.distributed KV transport for CUDA caches: the receiver
maps the sender's KV cache through a CUDA IPC handle and copies device to device. Runs in
prefill and decode workers whose caches are on a CUDA device.

The CUDA twin of `kvtransfer.shm` (same design, same safety argument). NCCL cannot run two
ranks on one device, so two workers sharing a GPU (one host, one device) could not move KV at
all; with this plane they need no NCCL: a sender built with ``shared_memory=True`` moves its
KV tensor into a fresh device allocation (`SharedCudaCache`) whose first bytes hold a random
token, and exports the allocation's IPC handle (``UntypedStorage._share_cuda_``, as
``torch.multiprocessing`` does). Its ``join`` record carries a `CudaSegmentInfo` (handle,
offsets, device UUID, token, boot id; sealed with the cluster secret when there is one, like
the memfd offer). A receiver whose cache is on the same physical device (equal UUID) and the
same host opens the handle (``UntypedStorage._new_shared_cuda``), checks the token, and keeps
the mapping (`CudaPeerCache`). The pair's process group is then gloo (CPU control messages
only: a notification per layer, the trailer, the acknowledgement), and the receiver copies
each layer straight from the sender's blocks into its own on the device. Anything that does
not check out — another host or device, a different layout — leaves the pair on NCCL (bytes).

Layout of the allocation::

    offset 0      token (16 random bytes), then zeros up to HEADER_BYTES
    HEADER_BYTES  the KV tensor, [layers, blocks, 2, block_size, kv_heads, head_dim], C order
                  (an int8 cache: [layers, blocks, block bytes], values and scales per block,
                  so a copied block carries its scales)

Ordering on the device: the sender synchronizes its stream before it notifies a layer (so the
layer's K/V is written when the receiver reads it; `kvtransfer.dist_send`), and the receiver
synchronizes after each layer's copy (so the bytes are in its cache before it counts the layer
and acknowledges; after the acknowledgement the sender may reuse its blocks).

Why it is safe: the receiver only reads the mapping; the sender keeps its source blocks until
the acknowledgement or its deadline, and the receiver completes a transfer only when every
layer was copied before the ticket's deadline (`kvtransfer.dist_recv`). The mapping lives as
long as the receiver's pair; the sender's allocation as long as its process.
"""

from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtransfer.shm import ShmUnavailable, boot_id
from model_runtime.kv_cache import KVCache

HEADER_BYTES = 4096
TOKEN_BYTES = 16
KIND = "cuda_ipc"


def device_uuid(device: torch.device) -> str:
    """The physical GPU's UUID (the same in every process, whatever CUDA_VISIBLE_DEVICES
    numbers it)."""
    return str(torch.cuda.get_device_properties(device).uuid)


@dataclass(frozen=True)
class CudaSegmentInfo:
    """What a receiver needs to open and check a sender's CUDA cache (JSON-safe: bytes as
    hex). The IPC fields are ``UntypedStorage._share_cuda_``'s, in its order, minus the device
    index (the receiver uses its own index for the device with `device_uuid`)."""

    pid: int
    boot_id: str
    device_uuid: str
    handle: str  # hex: cudaIpcMemHandle of the allocation holding the storage
    storage_size: int  # bytes of the storage (HEADER_BYTES + the KV tensor)
    storage_offset: int  # bytes from the allocation's start to the storage's
    ref_counter_handle: str  # hex: torch's shared reference counter (a file name)
    ref_counter_offset: int
    event_handle: str  # hex: the producer's IPC event ('' when none)
    event_sync_required: bool
    token: str  # hex
    shape: tuple[int, ...]
    itemsize: int
    node: str = ""  # the sender's node label: the plane is used only between equal labels

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": KIND,
            "pid": self.pid,
            "boot_id": self.boot_id,
            "device_uuid": self.device_uuid,
            "handle": self.handle,
            "storage_size": self.storage_size,
            "storage_offset": self.storage_offset,
            "ref_counter_handle": self.ref_counter_handle,
            "ref_counter_offset": self.ref_counter_offset,
            "event_handle": self.event_handle,
            "event_sync_required": self.event_sync_required,
            "token": self.token,
            "shape": list(self.shape),
            "itemsize": self.itemsize,
            "node": self.node,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CudaSegmentInfo:
        if d.get("kind") != KIND:
            raise ValueError(f"not a {KIND} record: kind {d.get('kind')!r}")
        return cls(
            pid=int(d["pid"]),
            boot_id=str(d["boot_id"]),
            device_uuid=str(d["device_uuid"]),
            handle=str(d["handle"]),
            storage_size=int(d["storage_size"]),
            storage_offset=int(d["storage_offset"]),
            ref_counter_handle=str(d["ref_counter_handle"]),
            ref_counter_offset=int(d["ref_counter_offset"]),
            event_handle=str(d["event_handle"]),
            event_sync_required=bool(d["event_sync_required"]),
            token=str(d["token"]),
            shape=tuple(int(x) for x in d["shape"]),
            itemsize=int(d["itemsize"]),
            node=str(d.get("node", "")),
        )


def _hex(b: bytes | None) -> str:
    return b.hex() if b else ""


class SharedCudaCache:
    """Moves `cache`'s KV tensor (contents included) into a fresh device allocation and
    exports it for CUDA IPC (sender side). Call before the cache serves a step (nothing may
    hold a view of the old tensor); the allocation lives as long as the cache holds it."""

    def __init__(self, cache: KVCache, node: str = "") -> None:
        if cache.device.type != "cuda":
            raise ShmUnavailable(f"a CUDA IPC cache must be on a CUDA device, not {cache.device}")
        old = cache.kv
        nbytes = old.numel() * old.element_size()
        token = secrets.token_bytes(TOKEN_BYTES)
        with torch.cuda.device(cache.device):
            try:
                buf = torch.zeros(HEADER_BYTES + nbytes, dtype=torch.uint8, device=cache.device)
            except torch.OutOfMemoryError as exc:
                raise ShmUnavailable(f"no {nbytes} bytes of device memory: {exc}") from exc
            buf[:TOKEN_BYTES].copy_(torch.frombuffer(bytearray(token), dtype=torch.uint8))
            kv = buf[HEADER_BYTES:].view(old.dtype).view(old.shape)
            cache.adopt_kv(kv)
            (_dev, handle, size, offset, ref_handle, ref_offset, ev_handle, ev_sync) = (
                buf.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
            )
            torch.cuda.synchronize(cache.device)  # token and copied contents are in place
        self._buf = buf
        self.info = CudaSegmentInfo(
            pid=os.getpid(),
            boot_id=boot_id(),
            device_uuid=device_uuid(cache.device),
            handle=_hex(handle),
            storage_size=int(size),
            storage_offset=int(offset),
            ref_counter_handle=_hex(ref_handle),
            ref_counter_offset=int(ref_offset),
            event_handle=_hex(ev_handle),
            event_sync_required=bool(ev_sync),
            token=token.hex(),
            shape=tuple(old.shape),
            itemsize=old.element_size(),
            node=node,
        )


def check_offer(info: CudaSegmentInfo, cache: KVCache, node: str, here_uuid: str) -> None:
    """Raise ShmUnavailable unless `info` can be opened by a receiver whose cache is `cache`
    on node `node`, device `here_uuid`: same node label, same host (boot id), same physical
    device, same layers / block shape / item size (the block count may differ), and a storage
    size that fits the announced tensor. Pure: no CUDA call (unit-tested on CPU)."""
    if info.node != node:
        raise ShmUnavailable(
            f"the sender is on node {info.node!r}, this receiver on {node!r} (labels differ)"
        )
    here = boot_id()
    if not here or here != info.boot_id:
        raise ShmUnavailable("the sender runs on another host (boot ids differ)")
    if info.device_uuid != here_uuid:
        raise ShmUnavailable(
            f"the sender's cache is on device {info.device_uuid}, this one on {here_uuid} "
            "(different devices move bytes over NCCL)"
        )
    mine = tuple(cache.kv.shape)
    if len(info.shape) != len(mine) or info.shape[:1] + info.shape[2:] != mine[:1] + mine[2:]:
        raise ShmUnavailable(f"segment shape {info.shape} does not fit this cache's {mine}")
    if info.itemsize != cache.kv.element_size():
        raise ShmUnavailable(f"segment item size {info.itemsize} is not this cache's")
    if info.storage_size != HEADER_BYTES + info.nbytes:
        raise ShmUnavailable(
            f"the storage holds {info.storage_size} bytes, the tensor needs "
            f"{HEADER_BYTES + info.nbytes}"
        )


class CudaPeerCache:
    """Another process's `SharedCudaCache`, opened through its IPC handle (receiving side)."""

    def __init__(self, info: CudaSegmentInfo, device: torch.device, dtype: torch.dtype) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(index):
            try:
                storage = torch.UntypedStorage._new_shared_cuda(
                    index,
                    bytes.fromhex(info.handle),
                    info.storage_size,
                    info.storage_offset,
                    bytes.fromhex(info.ref_counter_handle),
                    info.ref_counter_offset,
                    bytes.fromhex(info.event_handle) if info.event_handle else None,
                    info.event_sync_required,
                )
            except RuntimeError as exc:
                raise ShmUnavailable(f"cannot open the sender's CUDA IPC handle: {exc}") from exc
            buf = torch.empty(0, dtype=torch.uint8, device=device).set_(
                storage, 0, (info.storage_size,), (1,)
            )
            if bytes(buf[:TOKEN_BYTES].cpu().tolist()).hex() != info.token:
                raise ShmUnavailable("the IPC handle is not the sender's cache (token differs)")
        self.info = info
        self._device = device
        self._storage = storage  # keeps the mapping open
        self._kv = buf[HEADER_BYTES : HEADER_BYTES + info.nbytes].view(dtype).view(info.shape)
        self._stream: torch.cuda.Stream | None = None  # made with the first plan
        self._plan: _CopyPlan | None = None  # the last transfer's (`copy_layer`)

    @classmethod
    def for_receiver(cls, record: Any, cache: KVCache, node: str = "") -> CudaPeerCache:
        """Open the cache a ``join`` record offers (`CudaSegmentInfo.to_dict`) for a receiver
        on node `node` whose cache is `cache` (`check_offer` decides first, without CUDA
        calls). ShmUnavailable says why not."""
        try:
            info = CudaSegmentInfo.from_dict(record)
        except (KeyError, TypeError, ValueError) as exc:
            raise ShmUnavailable(f"malformed CUDA IPC record: {exc!r}") from exc
        if cache.device.type != "cuda":
            raise ShmUnavailable(f"this receiver's cache is on {cache.device}, not a GPU")
        check_offer(info, cache, node, device_uuid(cache.device))
        return cls(info, cache.device, cache.kv.dtype)

    @property
    def num_blocks(self) -> int:
        return self.info.shape[1]

    def source_blocks(self, src: Any, n_blocks: int) -> list[int] | None:
        """A header's source block list if it is `n_blocks` ids of this cache, else None."""
        if not isinstance(src, list) or len(src) != n_blocks:
            return None
        if not all(isinstance(b, int) and 0 <= b < self.num_blocks for b in src):
            return None
        return [int(b) for b in src]

    def copy_layer(self, layer: int, src_ids: list[int], dst: KVCache, dst_ids: list[int]) -> None:
        """Copy blocks `src_ids` of the sender's `layer` into blocks `dst_ids` of `dst`'s, on
        the device, and wait until the bytes are in `dst` (bit-exact).

        The copies run on this peer's own stream (not the engine's: waiting for them does not
        wait for steps the engine queues later), ordered (on the GPU, no host wait) after the
        work the engine's stream held when the transfer's first layer came, which may still
        read the destination blocks' previous contents. Per transfer (the same id lists layer after
        layer; `_CopyPlan`) the runs of blocks consecutive on both sides are found once, and
        the gather-scatter indices, when there are more than `MAX_SLICE_RUNS` runs, are put on
        the device once; each layer is then one slice copy per run (or one gather-scatter)
        and one stream synchronization, which the receiver's per-layer deadline check needs
        (`kvtransfer.dist_recv`: a layer counts only once its bytes are in)."""
        plan = self._plan
        fresh = plan is None or not plan.matches(src_ids, dst_ids, dst.kv)
        if plan is None or fresh:
            plan = self._plan = self._make_plan(src_ids, dst_ids, dst.kv)
        if fresh or layer == 0:  # a transfer's first layer: after the engine's queued work
            plan.stream.wait_stream(torch.cuda.current_stream(self._device))
        src, out = self._kv[layer], dst.kv[layer]
        with torch.cuda.stream(plan.stream):
            if plan.index is None:
                for s0, d0, n in plan.runs:
                    out[d0 : d0 + n].copy_(src[s0 : s0 + n])
            else:
                s_idx, d_idx = plan.index
                out.index_copy_(0, d_idx, src.index_select(0, s_idx))
        plan.stream.synchronize()

    def _make_plan(self, src_ids: list[int], dst_ids: list[int], dst_kv: torch.Tensor) -> _CopyPlan:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
        stream = self._stream
        runs = block_runs(src_ids, dst_ids)
        index = None
        if len(runs) > MAX_SLICE_RUNS:
            with torch.cuda.stream(stream):
                s_idx = torch.tensor(src_ids, dtype=torch.long).to(self._device)
                d_idx = torch.tensor(dst_ids, dtype=torch.long).to(self._device)
            index = (s_idx, d_idx)
        return _CopyPlan(list(src_ids), list(dst_ids), dst_kv, stream, runs, index)


MAX_SLICE_RUNS = 4  # more runs than this: one gather-scatter per layer instead of slice copies


@dataclass(frozen=True)
class _CopyPlan:
    """How one transfer's blocks are copied, layer after layer (`CudaPeerCache.copy_layer`):
    the id lists it was made for (copies: it is reused only for equal lists and the same
    destination tensor), the peer's stream, the runs, and the device indices (None: runs)."""

    src_ids: list[int]
    dst_ids: list[int]
    dst_kv: torch.Tensor
    stream: torch.cuda.Stream
    runs: list[tuple[int, int, int]]
    index: tuple[torch.Tensor, torch.Tensor] | None

    def matches(self, src_ids: list[int], dst_ids: list[int], dst_kv: torch.Tensor) -> bool:
        return dst_kv is self.dst_kv and src_ids == self.src_ids and dst_ids == self.dst_ids


def block_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the maximal runs consecutive on both sides."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source ids, {len(dst_ids)} destination ids")
    if not src_ids:
        return []
    s = np.asarray(src_ids, dtype=np.int64)
    d = np.asarray(dst_ids, dtype=np.int64)
    cont = (s[1:] == s[:-1] + 1) & (d[1:] == d[:-1] + 1)
    starts = np.concatenate(([0], np.flatnonzero(~cont) + 1))
    lengths = np.diff(np.concatenate((starts, [len(s)])))
    return list(zip(s[starts].tolist(), d[starts].tolist(), lengths.tolist(), strict=True))
