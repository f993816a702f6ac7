"""Bounded FIFO admission: at most `max_inflight` requests run, at most `max_queued` wait.

Runs in the router process, on its event loop (not thread-safe, no locks needed). A request that
finds the queue full is refused at once (`Overloaded` -> RESOURCE_EXHAUSTED): overload sheds
instead of building an unbounded backlog. Slots pass directly from a finishing request to the
oldest waiter, so a newcomer can never overtake the queue.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Overloaded(Exception):
    """The admission queue is full."""


class Admission:
    """`acquire()` a running slot (waiting FIFO if needed), `release()` it exactly once."""

    def __init__(self, max_inflight: int, max_queued: int) -> None:
        if max_inflight < 1 or max_queued < 0:
            raise ValueError(
                f"max_inflight must be >= 1 and max_queued >= 0, got {max_inflight}, {max_queued}"
            )
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self._running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def running(self) -> int:
        """Slots held now."""
        return self._running

    @property
    def queued(self) -> int:
        """Requests waiting for a slot now."""
        return sum(1 for w in self._waiters if not w.done())

    async def acquire(self) -> None:
        """Take a slot, waiting in FIFO order; raise `Overloaded` at once if the queue is full.

        Cancellation while waiting leaves no trace (a slot granted in the same instant is
        passed on to the next waiter).
        """
        if self._running < self.max_inflight and not self._waiters:
            self._running += 1
            return
        if self.queued >= self.max_queued:
            raise Overloaded(
                f"router queue full ({self.max_queued} waiting, {self._running} running)"
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted and cancelled at once: hand the slot on
            elif fut in self._waiters:
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        """Give a slot back: to the oldest live waiter, else to the pool."""
        assert self._running > 0, "release() without a matching acquire()"
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot moves to the waiter; _running is unchanged
                return
        self._running -= 1
