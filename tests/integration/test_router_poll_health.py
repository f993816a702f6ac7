"""The router's `WorkerPool` applying the poll health rule to a real gRPC worker (in-process fake).

The test drives `poll_once` by hand; the fake's `GetStatus` is held (it never answers), so each
poll is a miss by construction, not because the machine is slow.
"""

from __future__ import annotations

import asyncio

from router.pool import WorkerPool
from router.registry import InMemoryWorkerRegistry
from tests.fakes.fake_worker import FakeWorker, FakeWorkerConfig


def test_pool_keeps_a_silent_worker_healthy_until_the_third_missed_poll() -> None:
    async def scenario() -> None:
        worker = FakeWorker(FakeWorkerConfig(role="decode"))
        address = await worker.start()
        pool = WorkerPool(
            InMemoryWorkerRegistry(ttl_s=3600.0),
            poll_interval_s=3600.0,  # never started: the test polls by hand
            # A held poll misses however long this is; an answered one must fit in it on a
            # loaded machine too (the first poll, the one after `hang.clear()`).
            poll_timeout_s=2.0,
            poll_misses=3,
        )
        try:
            await pool.add(address, "decode")
            await pool.poll_once()
            assert pool.views("decode")[0].healthy

            worker.hang.add("GetStatus")  # held: every poll times out
            for _ in range(2):
                await pool.poll_once()
                (view,) = pool.views("decode")
                assert view.healthy and view.error == ""
            await pool.poll_once()
            (view,) = pool.views("decode")
            assert not view.healthy and view.error.startswith("DEADLINE_EXCEEDED")

            worker.hang.clear()
            await pool.poll_once()
            assert pool.views("decode")[0].healthy

            await worker.stop()  # refused: down on the first failed poll
            await pool.poll_once()
            (view,) = pool.views("decode")
            assert not view.healthy and view.error.startswith("UNAVAILABLE")
        finally:
            await pool.stop()
            await worker.stop()

    asyncio.run(scenario())
