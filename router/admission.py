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
    """`enter()` (decides at once) then `AdmissionPlace.wait()` / `.leave()`; or `acquire()`
    a running slot (waiting FIFO if needed) and `release()` it exactly once."""

    def __init__(self, max_inflight: int, max_queued: int) -> None:
        if max_inflight < 1 or max_queued < 0:
            raise ValueError(
                f"max_inflight must be >= 1 and max_queued >= 0, got {max_inflight}, {max_queued}"
            )
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self._running = 0
        self._queued = 0  # waiters whose future is not done yet
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def running(self) -> int:
        """Slots held now."""
        return self._running

    @property
    def queued(self) -> int:
        """Requests waiting for a slot now."""
        return self._queued

    def enter(self) -> AdmissionPlace:
        """Decide at once, without awaiting: a running slot now, a place in the queue, or
        `Overloaded` (the queue is full). The caller must `leave()` the place exactly once."""
        if self._running < self.max_inflight and not self._waiters:
            self._running += 1
            return AdmissionPlace(self, None)
        if self._queued >= self.max_queued:
            raise Overloaded(
                f"router queue full ({self.max_queued} waiting, {self._running} running)"
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._queued += 1
        return AdmissionPlace(self, fut)

    async def acquire(self) -> None:
        """Take a slot, waiting in FIFO order; raise `Overloaded` at once if the queue is full.

        Cancellation while waiting leaves no trace (a slot granted in the same instant is
        passed on to the next waiter).
        """
        place = self.enter()
        try:
            await place.wait()
        except asyncio.CancelledError:
            place.leave()
            raise

    def release(self) -> None:
        """Give a slot back: to the oldest live waiter, else to the pool."""
        assert self._running > 0, "release() without a matching acquire()"
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                self._queued -= 1
                fut.set_result(None)  # the slot moves to the waiter; _running is unchanged
                return
        self._running -= 1

    def _withdraw(self, fut: asyncio.Future[None]) -> None:
        """A queued place leaves before its slot came (its future is not done)."""
        self._waiters.remove(fut)
        self._queued -= 1
        fut.cancel()


class AdmissionPlace:
    """One request's place in an `Admission`: running (`fut` None or done) or queued."""

    def __init__(self, admission: Admission, fut: asyncio.Future[None] | None) -> None:
        self._admission = admission
        self._fut = fut
        self._left = False

    @property
    def running(self) -> bool:
        return self._fut is None or (self._fut.done() and not self._fut.cancelled())

    async def wait(self) -> None:
        """Until this place holds a running slot (FIFO); cancellable (then `leave()` it)."""
        if self._fut is not None:
            await asyncio.shield(self._fut)

    def leave(self) -> None:
        """Give the slot back, or the place in the queue; idempotent."""
        if self._left:
            return
        self._left = True
        if self.running:
            self._admission.release()
        else:
            assert self._fut is not None
            self._admission._withdraw(self._fut)
