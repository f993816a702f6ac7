"""Contract suite of the prefix-index seam (`router.prefix_index.base`), run against the
in-memory index and a real redis-server (started on a free port, stopped by PID).

Each case uses fresh worker ids and, for Redis, its own key prefix, so cases never interfere.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence

import pytest

from model_runtime.hashing import block_hash_chain
from router.prefix_index.base import (
    ApplyResult,
    KVEvent,
    KVEventKind,
    KVSnapshot,
    PrefixIndex,
    PrefixMatch,
)
from router.prefix_index.memory import InMemoryPrefixIndex
from tooling.redis_server import SKIP_REASON, RedisServer, redis_server_path

MakeIndex = Callable[[float], PrefixIndex]
TTL = 0.4

CHAIN = block_hash_chain(list(range(40)), 4)  # 10 block hashes, one prompt
OTHER = block_hash_chain(list(range(1000, 1040)), 4)  # another prompt, no shared prefix
_counter = itertools.count(1)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if redis_server_path() is None:
        pytest.skip(SKIP_REASON)
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["memory", "redis"])
def make_index(request: pytest.FixtureRequest) -> MakeIndex:
    """`make(ttl_s)` -> a fresh index of the parametrized kind (own Redis key prefix)."""
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    server: RedisServer | None = (
        request.getfixturevalue("redis_server") if request.param == "redis" else None
    )

    def make(ttl_s: float = 30.0) -> PrefixIndex:
        if server is None:
            return InMemoryPrefixIndex(ttl_s=ttl_s)
        from router.prefix_index.redis_index import RedisPrefixIndex

        return RedisPrefixIndex(server.url, key_prefix=prefix, ttl_s=ttl_s)

    return make


def run(
    make_index: MakeIndex, body: Callable[[PrefixIndex], Awaitable[None]], ttl_s: float = 30.0
) -> None:
    """Run `body(index)` on a fresh event loop with a fresh index, closed afterwards."""

    async def go() -> None:
        index = make_index(ttl_s)
        try:
            await body(index)
        finally:
            await index.close()

    asyncio.run(go())


def worker() -> str:
    return f"w{next(_counter)}"


def ev(
    w: str, seq: int, kind: KVEventKind = "stored", hashes: Sequence[int] = (), epoch: int = 7
) -> KVEvent:
    return KVEvent(w, epoch, seq, kind, tuple(hashes))


async def synced(index: PrefixIndex, w: str, hashes: Sequence[int] = (), epoch: int = 7) -> None:
    """Make `w` known to the index at `epoch`, seq 0, holding `hashes`."""
    assert await index.resync(KVSnapshot(w, epoch, 0, tuple(hashes))) is True


def counts(matches: list[PrefixMatch]) -> dict[str, int]:
    return {m.worker_id: m.num_blocks for m in matches}


def test_publish_then_match(make_index: MakeIndex) -> None:
    async def body(index: PrefixIndex) -> None:
        a = worker()
        await synced(index, a)
        assert await index.match(CHAIN) == []
        assert await index.apply(ev(a, 1, hashes=CHAIN[:4])) is ApplyResult.APPLIED
        assert await index.match(CHAIN) == [PrefixMatch(a, 7, 4)]
        assert await index.state(a) == (7, 1)
        assert await index.match([]) == []
        assert await index.match(OTHER) == []

    run(make_index, body)


def test_match_counts_leading_blocks_per_worker(make_index: MakeIndex) -> None:
    async def body(index: PrefixIndex) -> None:
        a, b, c, d = worker(), worker(), worker(), worker()
        for w in (a, b, c, d):
            await synced(index, w)
        await index.apply(ev(a, 1, hashes=CHAIN[:10]))
        await index.apply(ev(b, 1, hashes=CHAIN[:3]))
        await index.apply(ev(c, 1, hashes=CHAIN[1:6]))  # no block 0: no leading run
        await index.apply(ev(d, 1, hashes=[CHAIN[0], CHAIN[1], CHAIN[3]]))  # hole at block 2
        assert counts(await index.match(CHAIN)) == {a: 10, b: 3, d: 2}
        assert counts(await index.match(CHAIN[:2])) == {a: 2, b: 2, d: 2}
        partial = [*CHAIN[:3], OTHER[3], *CHAIN[4:]]  # the chain diverges at block 3
        assert counts(await index.match(partial)) == {a: 3, b: 3, d: 2}
        got = await index.match(CHAIN)
        assert [m.worker_id for m in got] == sorted(m.worker_id for m in got)

    run(make_index, body)


def test_remove_and_clear(make_index: MakeIndex) -> None:
    async def body(index: PrefixIndex) -> None:
        a, b = worker(), worker()
        await synced(index, a)
        await synced(index, b)
        await index.apply(ev(a, 1, hashes=CHAIN[:6]))
        await index.apply(ev(b, 1, hashes=CHAIN[:6]))
        assert await index.apply(ev(a, 2, "removed", [CHAIN[4], OTHER[0]])) is ApplyResult.APPLIED
        assert counts(await index.match(CHAIN)) == {a: 4, b: 6}
        assert await index.apply(ev(a, 3, "cleared")) is ApplyResult.APPLIED
        assert counts(await index.match(CHAIN)) == {b: 6}
        assert await index.state(a) == (7, 3)  # cleared, but still known and in step
        assert await index.apply(ev(a, 4, hashes=CHAIN[:1])) is ApplyResult.APPLIED
        assert counts(await index.match(CHAIN)) == {a: 1, b: 6}

    run(make_index, body)


def test_duplicate_events_are_idempotent(make_index: MakeIndex) -> None:
    async def body(index: PrefixIndex) -> None:
        a = worker()
        await synced(index, a)
        events = [ev(a, 1, hashes=CHAIN[:5]), ev(a, 2, "removed", CHAIN[3:5])]
        for e in events:
            assert await index.apply(e) is ApplyResult.APPLIED
        for e in events:  # a second router replica applying the same stream
            assert await index.apply(e) is ApplyResult.DUPLICATE
        assert counts(await index.match(CHAIN)) == {a: 3}
        assert await index.state(a) == (7, 2)

    run(make_index, body)


def test_unknown_worker_and_gap_need_resync(make_index: MakeIndex) -> None:
    async def body(index: PrefixIndex) -> None:
        a = worker()
        assert await index.apply(ev(a, 1, hashes=CHAIN)) is ApplyResult.RESYNC
        assert await index.match(CHAIN) == []
        await synced(index, a, CHAIN[:2])
        assert await index.apply(ev(a, 3, hashes=CHAIN)) is ApplyResult.RESYNC  # seq 2 is missing
        assert counts(await index.match(CHAIN)) == {a: 2}
        assert await index.state(a) == (7, 0)
        # the resync from the worker's snapshot replaces everything, old hashes included
        assert await index.resync(KVSnapshot(a, 7, 3, tuple(CHAIN[5:]) + tuple(OTHER[:4])))
        assert await index.match(CHAIN) == []
        assert counts(await index.match(OTHER)) == {a: 4}
        assert await index.apply(ev(a, 4, hashes=CHAIN[:1])) is ApplyResult.APPLIED

    run(make_index, body)


def test_epoch_change(make_index: MakeIndex) -> None:
    async def body(index: PrefixIndex) -> None:
        a = worker()
        await synced(index, a, CHAIN, epoch=1)
        await index.apply(ev(a, 1, "removed", CHAIN[9:], epoch=1))
        assert await index.apply(ev(a, 1, hashes=OTHER, epoch=2)) is ApplyResult.RESYNC
        assert counts(await index.match(CHAIN)) == {a: 9}  # unchanged until the resync
        assert await index.resync(KVSnapshot(a, 2, 0, tuple(OTHER[:2])))
        assert await index.match(CHAIN) == []  # the old epoch's blocks are gone
        assert await index.match(OTHER) == [PrefixMatch(a, 2, 2)]
        assert await index.apply(ev(a, 2, hashes=CHAIN, epoch=1)) is ApplyResult.RESYNC  # stale
        assert await index.match(CHAIN) == []
        assert await index.state(a) == (2, 0)

    run(make_index, body)


def test_resync_never_goes_back(make_index: MakeIndex) -> None:
    async def body(index: PrefixIndex) -> None:
        a = worker()
        await synced(index, a)
        for seq in (1, 2, 3):
            await index.apply(ev(a, seq, hashes=CHAIN[seq - 1 : seq]))
        # a replica's older snapshot arrives late: ignored (answers False), nothing changes
        assert await index.resync(KVSnapshot(a, 7, 2, tuple(CHAIN[:2]))) is False
        assert await index.resync(KVSnapshot(a, 7, 3, ())) is False
        assert counts(await index.match(CHAIN)) == {a: 3}
        assert await index.resync(KVSnapshot(a, 7, 5, tuple(CHAIN[:5]))) is True
        assert counts(await index.match(CHAIN)) == {a: 5}
        assert await index.apply(ev(a, 5, hashes=OTHER)) is ApplyResult.DUPLICATE

    run(make_index, body)


def test_ttl_expiry_and_refresh(make_index: MakeIndex) -> None:
    async def body(index: PrefixIndex) -> None:
        live, dead = worker(), worker()
        await synced(index, live, CHAIN[:4])
        await synced(index, dead, CHAIN[:6])
        assert counts(await index.match(CHAIN)) == {live: 4, dead: 6}
        for _ in range(3):  # `live` keeps refreshing past its TTL; `dead` went silent
            await asyncio.sleep(TTL / 2)
            assert await index.refresh(live, 7) is True
        assert counts(await index.match(CHAIN)) == {live: 4}
        assert await index.state(dead) is None
        assert await index.refresh(dead, 7) is False
        assert await index.apply(ev(dead, 1, hashes=CHAIN)) is ApplyResult.RESYNC
        assert await index.refresh(live, 8) is False  # another epoch: not this worker
        await asyncio.sleep(TTL * 1.5)
        assert await index.match(CHAIN) == []

    run(make_index, body, ttl_s=TTL)


def test_events_restart_the_ttl(make_index: MakeIndex) -> None:
    async def body(index: PrefixIndex) -> None:
        a = worker()
        await synced(index, a, CHAIN[:1])
        for seq in range(1, 4):
            await asyncio.sleep(TTL / 2)
            assert await index.apply(ev(a, seq, hashes=CHAIN[seq : seq + 1])) is ApplyResult.APPLIED
        assert counts(await index.match(CHAIN)) == {a: 4}

    run(make_index, body, ttl_s=TTL)


def test_drop_worker(make_index: MakeIndex) -> None:
    async def body(index: PrefixIndex) -> None:
        a, b = worker(), worker()
        await synced(index, a, CHAIN)
        await synced(index, b, CHAIN[:2])
        assert await index.drop_worker(a) is True
        assert await index.drop_worker(a) is False
        assert counts(await index.match(CHAIN)) == {b: 2}
        assert await index.state(a) is None
        assert await index.apply(ev(a, 1, hashes=CHAIN)) is ApplyResult.RESYNC

    run(make_index, body)


def test_many_workers_and_long_chain(make_index: MakeIndex) -> None:
    async def body(index: PrefixIndex) -> None:
        chain = block_hash_chain(list(range(16 * 256)), 16)  # 256 blocks
        ws = [worker() for _ in range(8)]
        for i, w in enumerate(ws):
            await synced(index, w, chain[: 32 * (i + 1)])
        assert counts(await index.match(chain)) == {w: 32 * (i + 1) for i, w in enumerate(ws)}

    run(make_index, body)


def test_memory_index_integrity_after_a_lifecycle() -> None:
    async def go() -> None:
        index = InMemoryPrefixIndex(ttl_s=30)
        await index.resync(KVSnapshot("a", 1, 0, tuple(CHAIN)))
        await index.resync(KVSnapshot("b", 1, 0, tuple(CHAIN[:3])))
        await index.apply(KVEvent("a", 1, 1, "removed", tuple(CHAIN[2:4])))
        await index.resync(KVSnapshot("b", 2, 0, tuple(OTHER)))
        await index.apply(KVEvent("a", 1, 2, "cleared"))
        index.check_integrity()
        assert await index.match(OTHER) == [PrefixMatch("b", 2, len(OTHER))]

    asyncio.run(go())
