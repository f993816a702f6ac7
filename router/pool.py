"""Connections to workers: grpc.aio channels and stubs, the status poller, in-flight counts.

Runs in the router process, on its event loop. One channel per worker address, opened at
`add` and closed at `stop`. A background task calls `Worker.GetStatus` on every registered
worker each `poll_interval_s` (each call bounded by `poll_timeout_s`) and reports the result to
the `WorkerRegistry` by the `PollHealth` rule: an answer is healthy; a poll that times out is
"slow", and only `status_poll_misses` of them in a row make the worker unhealthy (a live but
CPU-starved worker is not dead); any other failure (connection refused or reset, auth) marks it
unhealthy at once. A request path that sees a worker fail calls `report_failure`, which marks
it unhealthy at once (the next good poll makes it healthy again). `views(role)` builds the
`WorkerView` snapshots policies choose from, adding this router's live in-flight counts.
`last_answer(address)` is when the worker last answered a status call (the poll's or an
`answers` probe's): a request's freeze watch (`router.leg`) reads it to tell a frozen worker
from a busy one without a call of its own while the poll still hears from it; `answers`
probes one worker, one probe in flight per worker however many requests ask.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace

import grpc

from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router.policy import Role, WorkerView
from router.registry import WorkerRecord, WorkerRegistry
from security.channels import InternalAuth

log = logging.getLogger(__name__)

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    # Reconnect quickly to a worker that comes back (defaults back off for up to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_http_proxy", 0),
]


class Verdict(enum.Enum):
    """What one `GetStatus` outcome does to a worker's health."""

    HEALTHY = "healthy"  # it answered: healthy, with this status
    SLOW = "slow"  # it timed out, fewer than the allowed misses in a row: health unchanged
    DOWN = "down"  # unhealthy until its next answer


class PollHealth:
    """The poll health rule, per worker address (pure: no I/O, no clock).

    `observe(address, code)` takes one poll's outcome (`code` None for an answer, else the
    failed call's status code) and returns the `Verdict`. DEADLINE_EXCEEDED is a miss: the
    `misses`-th consecutive one is DOWN, earlier ones SLOW; any other code is DOWN at once; an
    answer is HEALTHY and resets the count. `forget(address)` drops a removed worker's count.
    """

    def __init__(self, misses: int) -> None:
        if misses < 1:
            raise ValueError(f"status_poll_misses must be >= 1, got {misses}")
        self._limit = misses
        self._misses: dict[str, int] = {}

    def observe(self, address: str, code: grpc.StatusCode | None) -> Verdict:
        """The verdict for `address` after one poll that ended with `code`."""
        if code is None:
            self._misses.pop(address, None)
            return Verdict.HEALTHY
        if code != grpc.StatusCode.DEADLINE_EXCEEDED:
            self._misses.pop(address, None)
            return Verdict.DOWN
        count = self._misses.get(address, 0) + 1
        self._misses[address] = count
        return Verdict.DOWN if count >= self._limit else Verdict.SLOW

    def forget(self, address: str) -> None:
        """Drop `address`'s miss count (it was deregistered)."""
        self._misses.pop(address, None)


class WorkerPool:
    """Owns one channel + stub per worker and keeps the registry's health up to date.

    `await on_change(views)` runs after every registry update with the views of every role, so
    the app can recompute its health status. `internal` says how to reach the workers: the
    cluster secret every call carries and the optional mutual TLS (default: neither).
    `poll_misses` is the `PollHealth` limit: consecutive poll timeouts before unhealthy.
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        poll_interval_s: float,
        poll_timeout_s: float,
        poll_misses: int = 3,
        on_change: Callable[[list[WorkerView]], Awaitable[None]] | None = None,
        internal: InternalAuth | None = None,
    ) -> None:
        self._registry = registry
        self._internal = internal or InternalAuth()
        self._interval = poll_interval_s
        self._timeout = poll_timeout_s
        self._health = PollHealth(poll_misses)
        self._on_change = on_change
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self._records: dict[str, WorkerRecord] = {}
        self._in_flight: dict[str, int] = {}
        # address -> [prompt tokens, tokens to compute] of this router's in-flight requests
        self._in_flight_tokens: dict[str, list[int]] = {}
        self._answered: dict[str, float] = {}  # address -> loop time of its last status answer
        self._probes: dict[str, asyncio.Future[bool]] = {}  # `answers` calls in flight
        self._task: asyncio.Task[None] | None = None

    async def add(self, address: str, role: Role) -> None:
        """Register `address` and open its channel (no I/O until the first call)."""
        await self._registry.register(address, role)
        if address not in self._channels:
            channel = self._internal.aio_channel(address, CHANNEL_OPTIONS)
            self._channels[address] = channel
            stub = worker_pb2_grpc.WorkerStub(channel)  # type: ignore[no-untyped-call]
            self._stubs[address] = self._internal.stub(stub)
            self._in_flight[address] = 0
            self._in_flight_tokens[address] = [0, 0]
        await self._refresh()

    async def remove(self, address: str) -> bool:
        """Deregister `address` and close its channel; False if it was unknown."""
        known = await self._registry.deregister(address)
        channel = self._channels.pop(address, None)
        self._stubs.pop(address, None)
        self._in_flight.pop(address, None)
        self._in_flight_tokens.pop(address, None)
        self._answered.pop(address, None)
        self._health.forget(address)
        if channel is not None:
            await channel.close()
        await self._refresh()
        return known

    async def start(self) -> None:
        """Poll every worker once (so health is known on return), then keep polling."""
        await self.poll_once()
        self._task = asyncio.create_task(self._poll_loop(), name="worker-status-poll")

    async def stop(self) -> None:
        """Stop polling and close every channel."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        """The stub of a registered worker; KeyError for an unknown address."""
        return self._stubs[address]

    def views(self, role: Role | None = None) -> list[WorkerView]:
        """Snapshots of the workers now in `role` (all roles when None), by address."""
        out = []
        for rec in self._records.values():
            if role is not None and rec.role != role:
                continue
            st = rec.status
            in_flight = self._in_flight.get(rec.address, 0)
            prompt_tokens, tokens = self._in_flight_tokens.get(rec.address, (0, 0))
            if st is None:
                view = WorkerView(rec.address, rec.address, rec.role, False, False)
                out.append(replace(view, in_flight=in_flight, error=rec.last_error))
                continue
            out.append(
                WorkerView(
                    worker_id=st.worker_id or rec.address,
                    address=rec.address,
                    role=rec.role,
                    healthy=rec.healthy,
                    draining=st.draining,
                    num_waiting=st.num_waiting,
                    num_receiving=st.num_receiving,
                    num_running=st.num_running,
                    waiting_tokens=st.waiting_tokens,
                    free_blocks=st.free_blocks,
                    total_blocks=st.total_blocks,
                    block_size=max(st.block_size, 1),
                    in_flight=in_flight,
                    in_flight_prompt_tokens=prompt_tokens,
                    in_flight_tokens=tokens,
                    epoch=st.epoch,
                    node=st.node,
                    error="" if rec.healthy else rec.last_error,
                )
            )
        return out

    @contextlib.contextmanager
    def track(self, address: str) -> Iterator[None]:
        """Count one router request as in flight on `address` for the `with` body."""
        self._in_flight[address] = self._in_flight.get(address, 0) + 1
        try:
            yield
        finally:
            if address in self._in_flight:  # absent if the worker was removed meanwhile
                self._in_flight[address] = max(0, self._in_flight[address] - 1)

    @contextlib.contextmanager
    def track_prefill(
        self, address: str, prompt_tokens: int, cached_tokens: int = 0
    ) -> Iterator[None]:
        """Count a prompt being prefilled on `address` for the `with` body: `prompt_tokens`
        of which `cached_tokens` are expected prefix-cache hits (policies see both)."""
        tokens = self._in_flight_tokens.setdefault(address, [0, 0])
        todo = max(0, prompt_tokens - cached_tokens)
        tokens[0] += prompt_tokens
        tokens[1] += todo
        try:
            yield
        finally:
            tokens[0] = max(0, tokens[0] - prompt_tokens)
            tokens[1] = max(0, tokens[1] - todo)

    async def report_failure(self, address: str, error: str) -> None:
        """A call to `address` failed as unreachable: mark it unhealthy until a good poll."""
        if address in self._channels:
            log.warning("worker %s marked unhealthy: %s", address, error)
            await self._registry.heartbeat(address, None, error)
            await self._refresh()

    @property
    def probe_timeout_s(self) -> float:
        """How long one status call (a poll, an `answers` probe) waits for its answer."""
        return self._timeout

    def last_answer(self, address: str) -> float:
        """Loop time at which `address` last answered a status call (-inf: never)."""
        return self._answered.get(address, -math.inf)

    async def answers(self, address: str) -> bool:
        """One `GetStatus` call to `address` (the poll's timeout): True when it answers;
        else the worker is marked unhealthy (until a good poll) and False. Callers asking
        while a probe of `address` is in flight share its outcome (one call per worker)."""
        probe = self._probes.get(address)
        if probe is None:
            probe = asyncio.ensure_future(self._probe(address))
            self._probes[address] = probe
            probe.add_done_callback(lambda _: self._probes.pop(address, None))
        return await asyncio.shield(probe)

    async def _probe(self, address: str) -> bool:
        stub = self._stubs.get(address)
        if stub is None:
            return False
        try:
            status = await stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            await self.report_failure(address, f"no status answer: {exc.code().name}")
            return False
        self._answered[address] = asyncio.get_running_loop().time()
        await self._registry.heartbeat(address, status)
        return True

    async def poll_once(self) -> None:
        """One `GetStatus` round over every registered worker, concurrently."""
        records = await self._registry.list()
        await asyncio.gather(*(self._poll(rec.address) for rec in records))
        await self._refresh()

    async def _poll(self, address: str) -> None:
        stub = self._stubs.get(address)
        if stub is None:
            return
        try:
            status = await stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            verdict = self._health.observe(address, exc.code())
            error = f"{exc.code().name}: {exc.details()}"
            if verdict is Verdict.DOWN:
                await self._registry.heartbeat(address, None, error)
            else:
                log.info("worker %s slow to answer GetStatus: %s", address, error)
            return
        self._health.observe(address, None)
        self._answered[address] = asyncio.get_running_loop().time()
        await self._registry.heartbeat(address, status)

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.poll_once()
            except KeyError:
                # A worker removed between list() and heartbeat(); the next round is consistent.
                log.debug("worker set changed during a poll round")
            except Exception:  # keep polling: a dead poller would freeze every worker's health
                log.exception("worker status poll round failed")

    async def _refresh(self) -> None:
        self._records = {rec.address: rec for rec in await self._registry.list()}
        if self._on_change is not None:
            await self._on_change(self.views())
