"""Unit tests of `router.admission.Admission` (one event loop, no I/O)."""

from __future__ import annotations

import asyncio

import pytest

from router.admission import Admission, Overloaded


def test_runs_up_to_max_inflight_then_queues_then_refuses() -> None:
    async def scenario() -> None:
        adm = Admission(max_inflight=2, max_queued=1)
        await adm.acquire()
        await adm.acquire()
        assert (adm.running, adm.queued) == (2, 0)
        waiter = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        assert adm.queued == 1 and not waiter.done()
        with pytest.raises(Overloaded, match="queue full"):
            await adm.acquire()  # refused at once, not after a wait
        adm.release()  # the slot moves to the waiter
        await asyncio.wait_for(waiter, 1)
        assert (adm.running, adm.queued) == (2, 0)
        adm.release()
        adm.release()
        assert adm.running == 0

    asyncio.run(scenario())


def test_fifo_order_and_no_overtaking() -> None:
    async def scenario() -> None:
        adm = Admission(max_inflight=1, max_queued=3)
        await adm.acquire()
        order: list[int] = []

        async def take(i: int) -> None:
            await adm.acquire()
            order.append(i)

        tasks = [asyncio.create_task(take(i)) for i in range(3)]
        await asyncio.sleep(0)
        for _ in range(3):
            adm.release()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2]
        assert adm.running == 1
        adm.release()
        assert adm.running == 0

    asyncio.run(scenario())


def test_cancelled_waiter_leaves_no_trace() -> None:
    async def scenario() -> None:
        adm = Admission(max_inflight=1, max_queued=2)
        await adm.acquire()
        gone = asyncio.create_task(adm.acquire())
        stays = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        assert adm.queued == 1
        adm.release()
        await asyncio.wait_for(stays, 1)
        adm.release()
        assert (adm.running, adm.queued) == (0, 0)

    asyncio.run(scenario())


def test_slot_granted_to_a_waiter_cancelled_in_the_same_instant_is_passed_on() -> None:
    async def scenario() -> None:
        adm = Admission(max_inflight=1, max_queued=2)
        await adm.acquire()
        first = asyncio.create_task(adm.acquire())
        second = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        adm.release()  # grants `first` ...
        first.cancel()  # ... which is cancelled before it runs
        await asyncio.wait_for(second, 1)
        assert first.cancelled()
        assert adm.running == 1
        adm.release()
        assert adm.running == 0

    asyncio.run(scenario())


def test_bad_limits_and_unbalanced_release() -> None:
    with pytest.raises(ValueError, match="max_inflight"):
        Admission(0, 1)
    with pytest.raises(AssertionError):
        Admission(1, 0).release()
