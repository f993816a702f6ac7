"""An in-process worker KV cache that publishes events like a real worker, for indexer tests.

Runs in the test process, on the test's event loop. `FakeKVWorker` owns a real `BlockPool`
(prefix caching on) whose listener numbers every `KVCacheEvent` (seq 1, 2, ... per epoch),
keeps the last `buffer` of them for replay, mirrors the set of cached hashes for snapshots, and
pushes each event to every open stream. `source()` is its `router.indexer.KVEventSource`.

Faults: `restart()` (new epoch, empty cache, open streams break), `kill()` / `revive()` (streams
break and new ones are refused), `lose_next(n)` (the next n events skip the buffer and the live
streams: a gap), `silent = True` (open streams stop sending anything, heartbeats included).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncGenerator, Sequence

from model_runtime.block_pool import BlockPool, KVCacheEvent
from model_runtime.hashing import BlockHash, block_hash_chain
from router.indexer import Heartbeat, KVMessage, SourceUnavailable
from router.prefix_index.base import KVEvent, KVSnapshot

_epochs = itertools.count(1000)


class _Broken:
    """Sentinel pushed into open streams when the worker dies or restarts."""


class FakeKVWorker:
    """See the module docstring."""

    def __init__(
        self, worker_id: str, num_blocks: int = 64, block_size: int = 4, buffer: int = 256
    ) -> None:
        self.worker_id = worker_id
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.buffer_size = buffer
        self.alive = True
        self.silent = False
        self.snapshots = 0
        self._lose = 0
        self._streams: list[asyncio.Queue[KVEvent | _Broken]] = []
        self._reset()

    def _reset(self) -> None:
        self.epoch = next(_epochs)
        self.seq = 0
        self.cached: set[BlockHash] = set()
        self.log: deque[KVEvent] = deque(maxlen=self.buffer_size)
        self.pool = BlockPool(self.num_blocks, listener=self._on_pool_event)

    # -- the worker side ---------------------------------------------------------------------

    def _on_pool_event(self, e: KVCacheEvent) -> None:
        self.seq += 1
        event = KVEvent(self.worker_id, self.epoch, self.seq, e.kind, e.block_hashes)
        if e.kind == "stored":
            self.cached.update(e.block_hashes)
        elif e.kind == "removed":
            self.cached.difference_update(e.block_hashes)
        else:
            self.cached.clear()
        if self._lose:
            self._lose -= 1
            return
        self.log.append(event)
        for q in self._streams:
            q.put_nowait(event)

    def run_prompt(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Compute a prompt: take blocks (evicting LRU ones), cache its full blocks, free them
        (they stay cached, evictable). Returns the prompt's block hashes."""
        hashes = block_hash_chain(token_ids, self.block_size)
        hits = self.pool.lookup(hashes)
        self.pool.acquire(hits)
        new = self.pool.allocate(len(hashes) - len(hits))
        assert new is not None, "fake worker out of blocks"
        blocks = hits + new
        self.pool.cache_blocks(blocks, hashes)
        self.pool.free(list(reversed(blocks)))
        return hashes

    def prefill(self, token_ids: Sequence[int]) -> int:
        """Run a prompt as a prefill would; return its prefix-cache hit in tokens (the block
        holding the last token never counts, as in the real scheduler)."""
        reusable = (len(token_ids) - 1) // self.block_size
        chain = block_hash_chain(token_ids[: reusable * self.block_size], self.block_size)
        cached = len(self.pool.lookup(chain)) * self.block_size
        self.run_prompt(token_ids)
        return cached

    def clear(self) -> None:
        self.pool.reset_prefix_cache()

    def lose_next(self, n: int) -> None:
        self._lose += n

    def restart(self) -> None:
        """A new process: new epoch, empty cache; open streams break."""
        self._break_streams()
        self._reset()

    def kill(self) -> None:
        self.alive = False
        self._break_streams()

    def revive(self) -> None:
        """Back after `kill`, as a new process."""
        self._reset()
        self.alive = True

    def _break_streams(self) -> None:
        for q in self._streams:
            q.put_nowait(_Broken())
        self._streams = []

    # -- what the router sees ----------------------------------------------------------------

    def source(self) -> FakeKVSource:
        return FakeKVSource(self)


class FakeKVSource:
    """`KVEventSource` over a `FakeKVWorker`."""

    def __init__(self, worker: FakeKVWorker) -> None:
        self.worker = worker
        self.name = worker.worker_id

    async def events(self, from_seq: int, heartbeat_s: float) -> AsyncGenerator[KVMessage]:
        w = self.worker
        if not w.alive:
            raise SourceUnavailable(f"{w.worker_id} is down")
        queue: asyncio.Queue[KVEvent | _Broken] = asyncio.Queue()
        w._streams.append(queue)
        try:
            yield Heartbeat(w.worker_id, w.epoch, w.seq)
            last = 0
            if from_seq > 0:
                for event in list(w.log):
                    if event.seq >= from_seq:
                        last = event.seq
                        yield event
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), heartbeat_s)
                except TimeoutError:
                    item = None
                while w.silent:
                    await asyncio.sleep(0.01)
                if isinstance(item, _Broken):
                    raise SourceUnavailable(f"{w.worker_id}: connection lost")
                if item is None:
                    yield Heartbeat(w.worker_id, w.epoch, w.seq)
                elif item.seq > last:
                    yield item
        finally:
            if queue in w._streams:
                w._streams.remove(queue)

    async def snapshot(self) -> KVSnapshot:
        w = self.worker
        if not w.alive:
            raise SourceUnavailable(f"{w.worker_id} is down")
        w.snapshots += 1
        return KVSnapshot(w.worker_id, w.epoch, w.seq, tuple(sorted(w.cached)))
