"""Is a worker a request waits on frozen? One watch beside each phase of a request's leg.

Runs in the router process, on its event loop, beside one worker call of a leg
(`router.leg`): a unary call (`Reserve` on D; `Prefill` on P, whose KV push goes into D) or a
worker stream (`Decode` on D; `Generate` on a colocated worker or a hybrid decode worker
prefilling locally), from its start to its end. `watched` names the workers the phase waits
on: the worker called, and for a `Prefill` also the decode worker receiving its KV.

The rule: a watched worker is *frozen* when, for `stall_timeout_s`, neither the phase (its
start, or its latest message) nor any status call (the pool's poll, or a probe of the watch's
own) has heard from it. The watch sleeps while the poll keeps hearing from the workers
(`WorkerPool.last_answer`: no call of its own); once a worker has been silent for
`stall_timeout_s` less one status call's timeout, it probes it (`WorkerPool.answers`: one call
per worker, however many requests ask). An answer keeps the phase (a long prefill, a queue, a
KV transfer still landing: busy, not frozen) and the watch goes on; no answer makes the verdict
(`frozen`) and cancels the call, whose reader turns the cancel into `WorkerFrozen`. So a phase
waiting on a worker that stopped (SIGSTOP, a hung host) ends no later than `stall_timeout_s`
after the worker went silent — or after the phase started, if the worker was silent already —
whatever the request's deadline, and the leg moves the request to other workers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator, Sequence
from typing import Any, Protocol, TypeVar

import grpc

T_co = TypeVar("T_co", covariant=True)


class StatusProbe(Protocol):
    """What the watch asks of the worker pool (`router.pool.WorkerPool`)."""

    @property
    def probe_timeout_s(self) -> float:
        """How long one status call waits for its answer."""
        ...

    def last_answer(self, address: str) -> float:
        """Loop time at which `address` last answered a status call (-inf: never)."""
        ...

    async def answers(self, address: str) -> bool:
        """One status call to `address`: True when it answers (False marks it unhealthy)."""
        ...


class Cancellable(Protocol):
    """A worker call the watch can end (`grpc.aio.Call`)."""

    def cancel(self) -> bool: ...


class UnaryCall(Cancellable, Protocol[T_co]):
    """A unary worker call: awaited for its answer (`grpc.aio.UnaryUnaryCall`)."""

    def __await__(self) -> Generator[Any, None, T_co]: ...


class WorkerFrozen(Exception):
    """A worker the phase waited on was silent for the stall timeout and did not answer a
    status call: frozen (module docstring). `address` is that worker."""

    def __init__(self, address: str, why: str) -> None:
        super().__init__(why)
        self.address = address
        self.why = why


class FreezeWatch:
    """One task beside one phase (module docstring). `progress()` on each message of a
    stream; `stop()` when the phase ends, whatever happened; after a cancel of the call,
    `frozen` says whether this watch made it (then the call's reader raises it)."""

    def __init__(
        self,
        probe: StatusProbe,
        call: Cancellable,
        watched: Sequence[str],
        stall_timeout_s: float,
        name: str,
    ) -> None:
        self._probe, self._call, self._watched = probe, call, tuple(dict.fromkeys(watched))
        self._stall = stall_timeout_s
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()  # the phase's start, then its latest message
        self.frozen: WorkerFrozen | None = None
        self._task = asyncio.create_task(self._watch(), name=f"freeze-watch-{name}")

    def progress(self) -> None:
        """The phase heard from its worker (a stream's message)."""
        self._last = self._loop.time()

    def stop(self) -> None:
        self._task.cancel()

    def _heard(self, address: str) -> float:
        """When the phase or a status call last heard from `address`."""
        return max(self._last, self._probe.last_answer(address))

    async def _watch(self) -> None:
        # Probe a status call's timeout before the stall timeout, so the verdict comes by it.
        lead = min(self._probe.probe_timeout_s, self._stall / 2)
        while True:
            now = self._loop.time()
            heard = {a: self._heard(a) for a in self._watched}
            due = [a for a, t in heard.items() if t + self._stall - lead <= now]
            if not due:
                await asyncio.sleep(min(heard.values()) + self._stall - lead - now)
                continue
            answered = await asyncio.gather(*(self._probe.answers(a) for a in due))
            silent = [a for a, ok in zip(due, answered, strict=True) if not ok]
            if silent:
                address = silent[0]
                quiet = self._loop.time() - heard[address]
                self.frozen = WorkerFrozen(
                    address,
                    f"worker {address} sent nothing for {quiet:.1f} s and did not answer a "
                    "status call: frozen",
                )
                self._call.cancel()
                return

    def cancelled_by_me(self) -> WorkerFrozen | None:
        """Inside a reader's `except asyncio.CancelledError`: the verdict, when this watch
        cancelled the call; None when the reader's own task is being cancelled (a deadline,
        the client went away), which must propagate."""
        task = asyncio.current_task()
        if self.frozen is None or (task is not None and task.cancelling()):
            return None
        return self.frozen


async def watched_call(
    probe: StatusProbe,
    call: UnaryCall[T_co],
    watched: Sequence[str],
    stall_timeout_s: float,
    name: str,
) -> T_co:
    """Await the unary worker call `call` (a `grpc.aio.UnaryUnaryCall`) under a `FreezeWatch`
    on `watched`: its answer, or `WorkerFrozen` when a watched worker froze (the call is then
    cancelled), or the call's own `grpc.aio.AioRpcError`."""
    watch = FreezeWatch(probe, call, watched, stall_timeout_s, name)
    try:
        return await call
    except asyncio.CancelledError:
        frozen = watch.cancelled_by_me()
        if frozen is None:
            raise
        raise frozen from None
    except grpc.aio.AioRpcError as exc:
        if watch.frozen is not None:  # the cancel raced the call's own failure
            raise watch.frozen from exc
        raise
    finally:
        watch.stop()
