"""Indexers: keep the prefix index in step with each worker's KV cache events.

Runs in the router process, on its event loop: one `Indexer` task per prefill (or colocated)
worker, owned by `Indexers`. An indexer follows the worker's event stream (`KVEventSource`) and
applies every event to the (guarded) index:

1. a stream starts with a `Heartbeat` naming the worker's id, epoch and last seq; a new epoch
   (the worker restarted) or an unsynced indexer resyncs: snapshot from the worker, then
   `index.resync` (the snapshot replaces everything the index held for that worker);
2. each event goes to `index.apply`; RESYNC (gap in seq, other epoch, worker unknown to the
   index — e.g. Redis restarted empty) resyncs as in 1; DUPLICATE (another router replica
   applied it first) is fine;
3. heartbeats restart the worker's TTL in the index (at most every `ttl_s / 4`); a refresh the
   index refuses (it lost the worker) resyncs;
4. the index failing (Redis down, slow, breaker open) marks the indexer *dirty*: events are
   dropped until a resync succeeds, tried at the next event or heartbeat once the breaker lets
   a call through — so the index heals when Redis returns, with no help from the worker;
5. the stream failing, or staying silent for 3 heartbeat periods, reconnects (after a backoff)
   from the next seq the indexer expects, so a short break replays the missed events.

Nothing here is on a request's path: indexers only write the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Protocol

from router.prefix_index.base import ApplyResult, IndexUnavailable, KVEvent, KVSnapshot
from router.prefix_index.guard import GuardedPrefixIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Heartbeat:
    """The worker's position: first message of every stream, then sent whenever it is idle."""

    worker_id: str
    epoch: int
    seq: int


KVMessage = KVEvent | Heartbeat


class SourceUnavailable(Exception):
    """The worker's event stream or snapshot could not be had (unreachable, died, refused)."""


class KVEventSource(Protocol):
    """One worker's KV cache events, as the router reads them.

    `events(from_seq, heartbeat_s)` yields a `Heartbeat` first, then the current epoch's
    buffered events with seq >= `from_seq` (0: none, live events only) — as many as the worker
    still buffers, so lost ones show as a seq gap — then live events, and a `Heartbeat` after
    each `heartbeat_s` without a message. `snapshot()` returns every hash the worker can serve
    and the seq it is current to. Both raise `SourceUnavailable` when the worker cannot answer.
    """

    name: str

    def events(self, from_seq: int, heartbeat_s: float) -> AsyncGenerator[KVMessage]: ...

    async def snapshot(self) -> KVSnapshot: ...


class Indexer:
    """Follows one worker's events into `index` (see the module docstring). `run()` loops
    until cancelled; it never raises for a worker or index failure."""

    def __init__(
        self,
        source: KVEventSource,
        index: GuardedPrefixIndex,
        heartbeat_s: float = 1.0,
        ttl_s: float = 10.0,
        retry_s: float = 0.2,
        max_retry_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.index = index
        self.heartbeat_s = heartbeat_s
        self.refresh_every_s = ttl_s / 4
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self._clock = clock
        self.worker_id = ""
        self.epoch: int | None = None  # the epoch the index was last synced to (None: never)
        self.next_seq = 0
        self.dirty = True  # the index may not match the worker: resync before trusting it
        self._last_refresh = 0.0
        self.connects = 0
        self.resyncs = 0
        self.events = 0
        self.synced = asyncio.Event()  # set after each successful resync (tests wait on it)

    async def run(self) -> None:
        """Follow the worker forever, reconnecting with a capped exponential backoff."""
        delay = self.retry_s
        while True:
            try:
                await self._follow()
                delay = self.retry_s
            except SourceUnavailable as exc:
                level = logging.INFO if self.connects <= 1 else logging.DEBUG
                log.log(level, "KV events of %s unavailable: %s", self.source.name, exc)
            except TimeoutError:
                log.info("KV event stream of %s went silent; reconnecting", self.source.name)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_retry_s)

    async def _follow(self) -> None:
        from_seq = 0 if self.dirty else self.next_seq
        stream = self.source.events(from_seq, self.heartbeat_s)
        self.connects += 1
        async with contextlib.aclosing(stream):
            while True:
                async with asyncio.timeout(3 * self.heartbeat_s):
                    try:
                        msg = await anext(stream)
                    except StopAsyncIteration:
                        return
                if isinstance(msg, Heartbeat):
                    await self._on_heartbeat(msg)
                else:
                    await self._on_event(msg)

    async def _on_heartbeat(self, hb: Heartbeat) -> None:
        self.worker_id = hb.worker_id
        if self.dirty or hb.epoch != self.epoch:
            await self._resync()
            return
        if self._clock() - self._last_refresh < self.refresh_every_s:
            return
        try:
            known = await self.index.refresh(hb.worker_id, hb.epoch)
        except IndexUnavailable:
            self.dirty = True
            return
        self._last_refresh = self._clock()
        if not known:
            log.info("prefix index lost worker %s; resyncing", hb.worker_id)
            await self._resync()

    async def _on_event(self, event: KVEvent) -> None:
        self.events += 1
        self.worker_id = event.worker_id
        if self.dirty or event.epoch != self.epoch:
            await self._resync()
            return
        try:
            result = await self.index.apply(event)
        except IndexUnavailable:
            self.dirty = True
            return
        self.next_seq = max(self.next_seq, event.seq + 1)
        if result is ApplyResult.RESYNC:
            await self._resync()
        else:
            self._last_refresh = self._clock()

    async def _resync(self) -> None:
        """Snapshot the worker into the index; on an index failure stay dirty (retried at the
        next message). A worker failure propagates (the stream reconnects)."""
        self.dirty = True
        if not self.index.available:
            return
        snapshot = await self.source.snapshot()
        try:
            await self.index.resync(snapshot)
        except IndexUnavailable as exc:
            log.debug("resync of %s failed: %s", snapshot.worker_id, exc)
            return
        self.resyncs += 1
        self.worker_id = snapshot.worker_id
        self.epoch = snapshot.epoch
        self.next_seq = snapshot.seq + 1
        self.dirty = False
        self._last_refresh = self._clock()
        self.synced.set()
        log.info(
            "prefix index resynced %s: epoch %d, seq %d, %d blocks",
            snapshot.worker_id,
            snapshot.epoch,
            snapshot.seq,
            len(snapshot.block_hashes),
        )


class Indexers:
    """One `Indexer` task per source, keyed by worker address; `stop()` cancels them all."""

    def __init__(self, index: GuardedPrefixIndex, heartbeat_s: float, ttl_s: float) -> None:
        self.index = index
        self._heartbeat_s = heartbeat_s
        self._ttl_s = ttl_s
        self.by_address: dict[str, Indexer] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def add(self, address: str, source: KVEventSource) -> Indexer:
        """Start following `source` (idempotent per address)."""
        if address not in self.by_address:
            indexer = Indexer(source, self.index, self._heartbeat_s, self._ttl_s)
            self.by_address[address] = indexer
            self._tasks[address] = asyncio.create_task(indexer.run(), name=f"indexer-{address}")
        return self.by_address[address]

    async def remove(self, address: str) -> None:
        """Stop following `address` (its index entries expire with their TTL)."""
        task = self._tasks.pop(address, None)
        self.by_address.pop(address, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def stop(self) -> None:
        """Cancel every indexer task."""
        for address in list(self._tasks):
            await self.remove(address)
