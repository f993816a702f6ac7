"""`KVEventSource` over a worker's `StreamKVEvents` / `GetKVSnapshot` RPCs. Runs in the router
process, on its event loop; uses the worker pool's channel to that worker.

Wire format (`worker.proto`): block hashes travel as 16-byte big-endian strings
(`model_runtime.hashing.hash_to_bytes`); kind "heartbeat" becomes an `indexer.Heartbeat`. Any
RPC failure — the worker unreachable, restarting, or not implementing the RPCs — is a
`SourceUnavailable` (the indexer retries with a backoff). A malformed message (unknown kind,
wrong hash length) is a worker bug: it also ends the stream, logged as an error.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable

import grpc

from model_runtime.hashing import hash_from_bytes
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router.indexer import Heartbeat, KVMessage, SourceUnavailable
from router.prefix_index.base import KV_EVENT_KINDS, KVEvent, KVSnapshot

log = logging.getLogger(__name__)


def _event(msg: worker_pb2.KVEvent) -> KVMessage:
    if msg.kind == "heartbeat":
        return Heartbeat(msg.worker_id, msg.epoch, msg.seq)
    if msg.kind not in KV_EVENT_KINDS:
        raise ValueError(f"unknown KV event kind {msg.kind!r}")
    hashes = tuple(hash_from_bytes(h) for h in msg.block_hashes)
    return KVEvent(msg.worker_id, msg.epoch, msg.seq, msg.kind, hashes)


class GrpcKVEventSource:
    """One worker's events through `stub()` (looked up per call: the pool owns the channel)."""

    def __init__(
        self,
        address: str,
        stub: Callable[[], worker_pb2_grpc.WorkerStub],
        snapshot_timeout_s: float = 5.0,
    ) -> None:
        self.name = address
        self._stub = stub
        self._snapshot_timeout_s = snapshot_timeout_s

    def _get_stub(self) -> worker_pb2_grpc.WorkerStub:
        try:
            return self._stub()
        except KeyError:
            raise SourceUnavailable(f"worker {self.name} is not registered") from None

    async def events(self, from_seq: int, heartbeat_s: float) -> AsyncGenerator[KVMessage]:
        """The worker's event stream (no deadline: it lives as long as the worker)."""
        call = self._get_stub().StreamKVEvents(
            worker_pb2.StreamKVEventsRequest(from_seq=from_seq, heartbeat_s=heartbeat_s)
        )
        try:
            async for msg in call:
                try:
                    item = _event(msg)
                except ValueError as exc:
                    log.error("bad KV event from %s: %s", self.name, exc)
                    raise SourceUnavailable(f"bad KV event from {self.name}: {exc}") from exc
                yield item
        except grpc.aio.AioRpcError as exc:
            raise SourceUnavailable(f"{exc.code().name}: {exc.details()}") from exc
        finally:
            call.cancel()

    async def snapshot(self) -> KVSnapshot:
        """`GetKVSnapshot`, bounded by `snapshot_timeout_s`."""
        try:
            snap = await self._get_stub().GetKVSnapshot(
                worker_pb2.GetKVSnapshotRequest(), timeout=self._snapshot_timeout_s
            )
            hashes = tuple(hash_from_bytes(h) for h in snap.block_hashes)
        except grpc.aio.AioRpcError as exc:
            raise SourceUnavailable(f"{exc.code().name}: {exc.details()}") from exc
        except ValueError as exc:
            raise SourceUnavailable(f"bad KV snapshot from {self.name}: {exc}") from exc
        return KVSnapshot(snap.worker_id, snap.epoch, snap.seq, hashes)
