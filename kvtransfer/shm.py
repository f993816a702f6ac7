"""Same-host data plane of the torch.distributed KV transport: the receiver reads the sender's
KV cache through shared memory. Runs in prefill and decode workers (CPU caches only).

A sender built with ``shared_memory=True`` moves its KV tensor into an anonymous memfd
(`SharedCacheSegment`); the segment's first page holds a random token. Its ``join`` record
carries a `SegmentInfo` (pid, fd, size, token, boot id). A receiver on the same host opens
``/proc/<pid>/fd/<fd>`` read-only, checks the boot id, size and token (a different host or a
different pid namespace fails one of them), and maps it (`PeerCache`). The pair then carries a
tiny notification per layer instead of the layer's bytes, and the receiver copies the layer
straight from the sender's blocks into its own (one copy in all: no socket, no staging buffer).
Anything that does not check out falls back to sending the bytes over gloo, per pair.

Layout of a segment::

    offset 0      token (16 random bytes), then zeros up to HEADER_BYTES
    HEADER_BYTES  the KV tensor, [layers, blocks, 2, block_size, kv_heads, head_dim], C order
                  (an int8 cache: [layers, blocks, block bytes], values and scales per block,
                  so a copied block carries its scales)

Why it is safe: the mapping is read-only, so a receiver can never write into a sender's cache.
The sender keeps its source blocks until the transfer's acknowledgement (or its deadline), and
the receiver completes a transfer only when every layer was copied before the ticket's deadline
— which precedes the sender's — and the stream's trailer says OK (a cancelled sender's says
SENDER_CANCELLED), so bytes a sender may have reused never complete a transfer. An anonymous
memfd leaves nothing behind: its memory goes when the last process that maps it does.
"""

from __future__ import annotations

import math
import mmap
import os
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvtransfer.staging import as_int_array, copy_runs
from model_runtime.kv_cache import KVCache

HEADER_BYTES = 4096
TOKEN_BYTES = 16
_INT_OF_WIDTH = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


class ShmUnavailable(RuntimeError):
    """The sender's segment cannot be used from here (another host, namespace, or no memfd)."""


def boot_id() -> str:
    """This host's boot id ('' where the OS has none): equal only on the same running kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class SegmentInfo:
    """What a receiver needs to find and check a sender's shared cache (JSON-safe)."""

    pid: int
    fd: int
    boot_id: str
    token: str  # hex
    shape: tuple[int, ...]
    itemsize: int
    node: str = ""  # the sender's node label: the plane is used only between equal labels

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "memfd",
            "pid": self.pid,
            "fd": self.fd,
            "boot_id": self.boot_id,
            "token": self.token,
            "shape": list(self.shape),
            "itemsize": self.itemsize,
            "node": self.node,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SegmentInfo:
        return cls(
            pid=int(d["pid"]),
            fd=int(d["fd"]),
            boot_id=str(d["boot_id"]),
            token=str(d["token"]),
            shape=tuple(int(x) for x in d["shape"]),
            itemsize=int(d["itemsize"]),
            node=str(d.get("node", "")),
        )


class SharedCacheSegment:
    """Moves `cache`'s KV tensor (contents included) into an anonymous memfd and keeps it there.

    Call before the cache is used by a step (nothing may hold a view of the old tensor). The fd
    stays open for the life of the process: receivers open it through ``/proc``.
    """

    def __init__(self, cache: KVCache, node: str = "") -> None:
        if cache.device.type != "cpu":
            raise ShmUnavailable(f"a shared-memory cache must be on the CPU, not {cache.device}")
        if not hasattr(os, "memfd_create"):
            raise ShmUnavailable("this OS has no memfd_create")
        old = cache.kv
        nbytes = old.numel() * old.element_size()
        self._fd = os.memfd_create(f"pdserve-kv-{os.getpid()}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, HEADER_BYTES + nbytes)
            self._map = mmap.mmap(self._fd, HEADER_BYTES + nbytes)
        except OSError as exc:
            os.close(self._fd)
            raise ShmUnavailable(f"no {nbytes} bytes of shared memory: {exc}") from exc
        token = secrets.token_bytes(TOKEN_BYTES)
        self._map[:TOKEN_BYTES] = token
        kv = torch.frombuffer(self._map, dtype=old.dtype, count=old.numel(), offset=HEADER_BYTES)
        cache.adopt_kv(kv.view(old.shape))
        self.info = SegmentInfo(
            pid=os.getpid(),
            fd=self._fd,
            boot_id=boot_id(),
            token=token.hex(),
            shape=tuple(old.shape),
            itemsize=old.element_size(),
            node=node,
        )


class PeerCache:
    """A read-only map of another process's `SharedCacheSegment` (the receiving side)."""

    def __init__(self, info: SegmentInfo) -> None:
        here = boot_id()
        if not here or here != info.boot_id:
            raise ShmUnavailable("the sender runs on another host (boot ids differ)")
        path = f"/proc/{info.pid}/fd/{info.fd}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise ShmUnavailable(f"cannot open {path}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size != HEADER_BYTES + info.nbytes:
                raise ShmUnavailable(
                    f"{path} holds {size} bytes, the sender announced {HEADER_BYTES + info.nbytes}"
                )
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        if self._map[:TOKEN_BYTES].hex() != info.token:
            raise ShmUnavailable(f"{path} is not the sender's segment (token differs)")
        self.info = info
        flat = np.frombuffer(self._map, dtype=_INT_OF_WIDTH[info.itemsize], offset=HEADER_BYTES)
        self._kv: npt.NDArray[np.generic] = flat.reshape(info.shape)

    @classmethod
    def for_receiver(cls, record: Any, cache: KVCache, node: str = "") -> PeerCache:
        """Map the segment a ``join`` record offers (`SegmentInfo.to_dict`) for a receiver
        on node `node` whose cache is `cache`: same node label, same layers, block shape and
        item size (the block count may differ). ShmUnavailable says why not.

        The node labels decide first: workers the cluster places on different nodes never
        share memory, even when (as in a test cluster of several Ray nodes on one machine)
        the host would allow it — their KV then crosses as gloo bytes, as between hosts."""
        try:
            info = SegmentInfo.from_dict(record)
        except (KeyError, TypeError, ValueError) as exc:
            raise ShmUnavailable(f"malformed segment record: {exc!r}") from exc
        if info.node != node:
            raise ShmUnavailable(
                f"the sender is on node {info.node!r}, this receiver on {node!r} (labels differ)"
            )
        mine = tuple(cache.kv.shape)
        if len(info.shape) != len(mine) or info.shape[:1] + info.shape[2:] != mine[:1] + mine[2:]:
            raise ShmUnavailable(f"segment shape {info.shape} does not fit this cache's {mine}")
        if info.itemsize != cache.kv.element_size():
            raise ShmUnavailable(f"segment item size {info.itemsize} is not this cache's")
        return cls(info)

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
        """Copy blocks `src_ids` of the sender's `layer` into blocks `dst_ids` of `dst`'s: one
        copy in all (numpy, single-threaded, GIL-free, bit-exact), a contiguous one per run of
        blocks consecutive on both sides (`kvtransfer.staging.copy_runs`)."""
        copy_runs(as_int_array(dst.kv[layer]), dst_ids, self._kv[layer], src_ids)
