"""KV cache event publisher of a worker process: numbers the block pool's prefix-cache events
and serves them to the router's `StreamKVEvents` / `GetKVSnapshot` calls. Torch-free.

Two threads touch it, and the engine thread never waits for a reader:

- engine thread: `on_event` is the `BlockPool` listener. Under a lock held for O(event size) it
  gives the event the next seq, updates the mirror set of cached hashes and appends it to a
  bounded ring buffer (the oldest events fall off: a slow or absent reader sees a seq gap and
  resyncs from a snapshot instead of holding memory). It then wakes the readers' loop with one
  `call_soon_threadsafe` (coalesced: at most one pending wake-up);
- gRPC loop: `stream(from_seq, heartbeat_s)` yields (seq, event) pairs and heartbeats (see
  `worker.proto` for the order); `snapshot()` copies the mirror set with its seq under the lock.

Layout::

    _ring:   deque[(seq, KVCacheEvent)]   maxlen = buffer_size, seqs consecutive
    _cached: set[BlockHash]               every hash the pool can serve as of `seq`
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from model_runtime.block_pool import KVCacheEvent
from model_runtime.hashing import BlockHash


@dataclass(frozen=True)
class PublisherHeartbeat:
    """The publisher's position: `seq` is the latest event's seq (0: none yet)."""

    seq: int


class KVEventPublisher:
    """See the module docstring. One per worker process; `epoch` = the process's epoch."""

    def __init__(self, worker_id: str, epoch: int, buffer_size: int = 8192) -> None:
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        self.worker_id = worker_id
        self.epoch = epoch
        self._lock = threading.Lock()
        self._seq = 0
        self._ring: deque[tuple[int, KVCacheEvent]] = deque(maxlen=buffer_size)
        self._cached: set[BlockHash] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake_pending = False
        self._changed: asyncio.Event | None = None

    @property
    def seq(self) -> int:
        """Seq of the latest event (0: none yet)."""
        return self._seq

    # ---- engine thread -----------------------------------------------------------------------

    def on_event(self, event: KVCacheEvent) -> None:
        """`BlockPool` listener (engine thread): number, mirror, buffer, wake the readers."""
        with self._lock:
            self._seq += 1
            if event.kind == "stored":
                self._cached.update(event.block_hashes)
            elif event.kind == "removed":
                self._cached.difference_update(event.block_hashes)
            else:
                self._cached.clear()
            self._ring.append((self._seq, event))
            loop, wake = self._loop, not self._wake_pending and self._loop is not None
            self._wake_pending = self._wake_pending or wake
        if wake and loop is not None:
            try:
                loop.call_soon_threadsafe(self._notify)
            except RuntimeError:  # the loop is closed (shutdown): nobody is reading
                with self._lock:
                    self._wake_pending = False

    # ---- gRPC loop ---------------------------------------------------------------------------

    def _notify(self) -> None:
        with self._lock:
            self._wake_pending = False
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _bind(self) -> asyncio.Event:
        """The event the next change sets (created on the running loop)."""
        with self._lock:
            self._loop = asyncio.get_running_loop()
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def snapshot(self) -> tuple[int, list[BlockHash]]:
        """(seq, every cached hash as of that seq), consistent with each other."""
        with self._lock:
            return self._seq, list(self._cached)

    def _since(self, next_seq: int) -> list[tuple[int, KVCacheEvent]]:
        with self._lock:
            if not self._ring or next_seq > self._seq:
                return []
            first = self._ring[0][0]
            start = max(0, next_seq - first)  # before the oldest buffered: from the oldest
            return [self._ring[i] for i in range(start, len(self._ring))]

    async def stream(
        self, from_seq: int, heartbeat_s: float
    ) -> AsyncIterator[tuple[int, KVCacheEvent] | PublisherHeartbeat]:
        """A heartbeat, buffered events with seq >= `from_seq` (0, or beyond the latest seq:
        none), live events, and a heartbeat after each idle `heartbeat_s`. Runs until closed."""
        changed = self._bind()
        with self._lock:
            now = self._seq
        yield PublisherHeartbeat(now)
        next_seq = from_seq if 0 < from_seq <= now + 1 else now + 1
        while True:
            events = self._since(next_seq)
            for seq, event in events:
                yield seq, event
                next_seq = seq + 1
            if events:
                continue
            changed = self._bind()
            if self._seq >= next_seq:  # an event landed between `_since` and `_bind`
                continue
            try:
                await asyncio.wait_for(changed.wait(), heartbeat_s)
            except TimeoutError:
                yield PublisherHeartbeat(self._seq)
