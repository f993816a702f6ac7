"""The worker-side KV event publisher (`worker.kv_events`): numbering, the mirror set
behind snapshots, replay from the ring buffer, gaps when it overflows, heartbeats, and wake-ups
from another thread (the engine thread) — with a real `BlockPool` as the event source."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from model_runtime.block_pool import BlockPool, KVCacheEvent
from model_runtime.hashing import block_hash_chain
from worker.kv_events import KVEventPublisher, PublisherHeartbeat

Item = tuple[int, KVCacheEvent] | PublisherHeartbeat


def stored(*hashes: int) -> KVCacheEvent:
    return KVCacheEvent("stored", hashes)


async def take(stream: AsyncIterator[Item], n: int, timeout_s: float = 2.0) -> list[Item]:
    out = []
    async with asyncio.timeout(timeout_s):
        for _ in range(n):
            out.append(await anext(stream))
    return out


def seqs(items: list[Item]) -> list[int | str]:
    return [f"hb{i.seq}" if isinstance(i, PublisherHeartbeat) else i[0] for i in items]


def test_numbering_and_snapshot_follow_a_block_pool() -> None:
    pub = KVEventPublisher("w", epoch=5)
    pool = BlockPool(8, listener=pub.on_event)
    chain = block_hash_chain(list(range(16)), 4)
    blocks = pool.allocate(4)
    assert blocks is not None
    pool.cache_blocks(blocks, chain)  # seq 1: stored x4
    pool.free(blocks[::-1])
    more = pool.allocate(6)  # 4 free + 2 evicted (LRU: the tail blocks) -> seq 2: removed x2
    assert more is not None
    seq, hashes = pub.snapshot()
    assert seq == 2 and sorted(hashes) == sorted(chain[:2])
    pool.reset_prefix_cache()  # seq 3: cleared
    assert pub.snapshot() == (3, []) and pub.seq == 3


def test_stream_replays_then_goes_live_with_heartbeats() -> None:
    async def go() -> None:
        pub = KVEventPublisher("w", epoch=1)
        for h in range(1, 4):
            pub.on_event(stored(h))
        stream = pub.stream(from_seq=2, heartbeat_s=0.05)
        first = await take(stream, 3)
        assert seqs(first) == ["hb3", 2, 3]
        pub.on_event(stored(9))
        got = await take(stream, 2)
        assert seqs(got) == [4, "hb4"]  # live event, then idle -> heartbeat
        await stream.aclose()  # type: ignore[attr-defined]

    asyncio.run(go())


def test_from_seq_zero_or_ahead_means_live_only() -> None:
    async def go() -> None:
        pub = KVEventPublisher("w", epoch=1)
        pub.on_event(stored(1))
        for from_seq in (0, 7):
            stream = pub.stream(from_seq=from_seq, heartbeat_s=5.0)
            assert seqs(await take(stream, 1)) == [f"hb{pub.seq}"]  # nothing replayed
            pub.on_event(stored(from_seq + 10))
            assert seqs(await take(stream, 1)) == [pub.seq]
            await stream.aclose()  # type: ignore[attr-defined]

    asyncio.run(go())


def test_ring_overflow_shows_as_a_gap() -> None:
    async def go() -> None:
        pub = KVEventPublisher("w", epoch=1, buffer_size=3)
        for h in range(1, 7):
            pub.on_event(stored(h))
        stream = pub.stream(from_seq=2, heartbeat_s=5.0)
        assert seqs(await take(stream, 4)) == ["hb6", 4, 5, 6]  # 2 and 3 are gone: a gap
        await stream.aclose()  # type: ignore[attr-defined]

    asyncio.run(go())


def test_events_from_another_thread_wake_every_reader() -> None:
    async def go() -> None:
        pub = KVEventPublisher("w", epoch=1)
        streams = [pub.stream(0, heartbeat_s=5.0) for _ in range(2)]
        for s in streams:
            assert seqs(await take(s, 1)) == ["hb0"]
        readers = [asyncio.create_task(take(s, 200)) for s in streams]
        await asyncio.sleep(0.05)  # both readers wait

        def engine() -> None:  # never waits for the readers
            for h in range(200):
                pub.on_event(stored(h))

        thread = threading.Thread(target=engine)
        thread.start()
        results = await asyncio.gather(*readers)
        thread.join()
        for items in results:
            assert seqs(items) == list(range(1, 201))
        for s in streams:
            await s.aclose()  # type: ignore[attr-defined]

    asyncio.run(go())
