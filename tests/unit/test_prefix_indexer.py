"""The router's `Indexer` against an in-process fake worker cache (`tests.fakes.kv_events`)
and the in-memory index: sync, events, gaps, restarts, silence, death, index outages."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from router.indexer import Indexer, Indexers
from router.prefix_index.base import ApplyResult, IndexUnavailable, KVEvent, KVSnapshot
from router.prefix_index.breaker import CircuitBreaker
from router.prefix_index.guard import GuardedPrefixIndex
from router.prefix_index.memory import InMemoryPrefixIndex
from tests.fakes.kv_events import FakeKVWorker

HB = 0.05  # heartbeat period of the fake streams


class OutageIndex(InMemoryPrefixIndex):
    """The in-memory index with a switch that makes every write fail as a backend outage."""

    down = False

    async def apply(self, event: KVEvent) -> ApplyResult:
        if self.down:
            raise IndexUnavailable("outage")
        return await super().apply(event)

    async def resync(self, snapshot: KVSnapshot) -> bool:
        if self.down:
            raise IndexUnavailable("outage")
        return await super().resync(snapshot)

    async def refresh(self, worker_id: str, epoch: int) -> bool:
        if self.down:
            raise IndexUnavailable("outage")
        return await super().refresh(worker_id, epoch)


async def until(pred: Callable[[], bool], what: str, timeout_s: float = 3.0) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def following(
    worker: FakeKVWorker, index: InMemoryPrefixIndex, ttl_s: float = 30.0, open_s: float = 0.1
) -> AsyncIterator[Indexer]:
    guarded = GuardedPrefixIndex(index, CircuitBreaker(failure_threshold=1, open_s=open_s))
    indexer = Indexer(worker.source(), guarded, heartbeat_s=HB, ttl_s=ttl_s, retry_s=0.02)
    task = asyncio.create_task(indexer.run())
    try:
        yield indexer
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def in_step(worker: FakeKVWorker, index: InMemoryPrefixIndex) -> Callable[[], bool]:
    return lambda: index.hashes_of(worker.worker_id) == worker.cached


def prompt(group: int, n: int = 16) -> list[int]:
    return [group * 1000 + i for i in range(n)]


def test_syncs_then_follows_events() -> None:
    async def go() -> None:
        worker, index = FakeKVWorker("p0", num_blocks=8), InMemoryPrefixIndex()
        worker.run_prompt(prompt(1))  # cached before the router connects
        async with following(worker, index) as indexer:
            await until(in_step(worker, index), "initial sync")
            assert indexer.resyncs == 1
            chain = worker.run_prompt(prompt(2))
            await until(in_step(worker, index), "stored event")
            matches = await index.match(chain)
            assert [(m.worker_id, m.num_blocks) for m in matches] == [("p0", 4)]
            worker.run_prompt(prompt(3, 20))  # 5 blocks: evicts the LRU ones -> removed
            await until(in_step(worker, index), "removed event")
            worker.clear()
            await until(in_step(worker, index), "cleared event")
            assert index.hashes_of("p0") == frozenset()
            assert indexer.resyncs == 1 and indexer.events >= 4
            index.check_integrity()

    asyncio.run(go())


def test_gap_resyncs_from_a_snapshot() -> None:
    async def go() -> None:
        worker, index = FakeKVWorker("p0", num_blocks=8), InMemoryPrefixIndex()
        async with following(worker, index) as indexer:
            await until(lambda: indexer.resyncs == 1, "initial sync")
            worker.lose_next(1)
            worker.run_prompt(prompt(1))  # lost: never reaches the index by itself
            worker.run_prompt(prompt(2))  # seq gap -> resync
            await until(in_step(worker, index), "resync after the gap")
            assert indexer.resyncs == 2 and worker.snapshots == 2

    asyncio.run(go())


def test_restart_replaces_the_old_epoch() -> None:
    async def go() -> None:
        worker, index = FakeKVWorker("p0"), InMemoryPrefixIndex()
        async with following(worker, index) as indexer:
            old = worker.run_prompt(prompt(1))
            await until(in_step(worker, index), "first epoch")
            old_epoch = worker.epoch
            worker.restart()
            new = worker.run_prompt(prompt(2))
            await until(lambda: indexer.epoch == worker.epoch, "resync to the new epoch")
            await until(in_step(worker, index), "new epoch in step")
            assert await index.match(old) == []
            assert [m.epoch for m in await index.match(new)] == [worker.epoch] != [old_epoch]

    asyncio.run(go())


def test_short_break_replays_from_the_buffer() -> None:
    async def go() -> None:
        worker, index = FakeKVWorker("p0"), InMemoryPrefixIndex()
        async with following(worker, index) as indexer:
            await until(lambda: indexer.resyncs == 1, "initial sync")
            worker.silent = True  # no heartbeats: the indexer gives up after 3 periods
            worker.run_prompt(prompt(1))
            await until(lambda: indexer.connects >= 2, "reconnect after silence")
            worker.silent = False
            await until(in_step(worker, index), "replayed events")
            assert indexer.resyncs == 1  # same epoch, no gap: replay, no snapshot

    asyncio.run(go())


def test_dead_worker_expires_and_heartbeats_keep_live_ones() -> None:
    async def go() -> None:
        ttl = 0.3
        index = InMemoryPrefixIndex(ttl_s=ttl)
        live, dead = FakeKVWorker("live"), FakeKVWorker("dead")
        async with following(live, index, ttl_s=ttl), following(dead, index, ttl_s=ttl) as d:
            chain = live.run_prompt(prompt(1))
            dead.run_prompt(prompt(1))
            await until(lambda: len(index.hashes_of("dead")) == 4, "dead worker synced")
            await until(lambda: len(index.hashes_of("live")) == 4, "live worker synced")
            dead.kill()
            await asyncio.sleep(ttl * 3)  # well past the TTL: only heartbeats kept `live`
            assert [m.worker_id for m in await index.match(chain)] == ["live"]
            dead.revive()
            dead.run_prompt(prompt(1))
            await until(lambda: d.epoch == dead.epoch, "revived worker resynced")
            await until(in_step(dead, index), "revived worker in step")

    asyncio.run(go())


def test_index_outage_heals_by_resync() -> None:
    async def go() -> None:
        worker, index = FakeKVWorker("p0", num_blocks=8), OutageIndex()
        async with following(worker, index) as indexer:
            await until(lambda: indexer.resyncs == 1, "initial sync")
            index.down = True
            worker.run_prompt(prompt(1))
            worker.run_prompt(prompt(2))
            await until(lambda: indexer.dirty, "indexer notices the outage")
            assert index.hashes_of("p0") == frozenset()
            index.down = False  # Redis is back (empty or stale): the next probe resyncs
            await until(in_step(worker, index), "healed after the outage")
            assert indexer.resyncs >= 2 and not indexer.dirty

    asyncio.run(go())


def test_indexers_start_and_stop_tasks() -> None:
    async def go() -> None:
        index = InMemoryPrefixIndex()
        guarded = GuardedPrefixIndex(index)
        workers = [FakeKVWorker(f"p{i}") for i in range(3)]
        group = Indexers(guarded, heartbeat_s=HB, ttl_s=30)
        for w in workers:
            group.add(w.worker_id, w.source())
            w.run_prompt(prompt(7))
        assert group.add("p0", workers[0].source()) is group.by_address["p0"]
        await until(lambda: all(in_step(w, index)() for w in workers), "all synced")
        await group.remove("p1")
        assert sorted(group.by_address) == ["p0", "p2"]
        await group.stop()
        assert group.by_address == {}

    asyncio.run(go())
