"""Where the engine thread puts an RPC's answer and the asyncio handler picks it up.

Runs in every worker process. The engine thread calls `set` / `put` / `fail` (each returns at
once: it only schedules a callback on the event loop with ``call_soon_threadsafe``); the gRPC
handler on the loop awaits `UnarySink.wait()` or iterates a `StreamSink`. A sink is closed by
its first final answer (a value, a finished chunk or an error); later calls are ignored, so a
request that is aborted twice (Abort RPC racing its deadline) still answers once.

`delivered_together()`: inside it, answers given on the calling thread are collected and handed
to each event loop with one ``call_soon_threadsafe`` when it ends. The engine thread wraps a
step's token delivery in it: one loop wake-up (one self-pipe write) per step instead of one per
running request, and the loop starts sending only once the engine thread is done with the GIL
for this step's Python work, instead of contending for it chunk by chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

from proto.pdserve.v1 import worker_pb2
from proto.pdserve.v1.trailers import FAILED_PEER

log = logging.getLogger(__name__)


class WorkerError(Exception):
    """A request ended with a gRPC status other than OK; `message` says why, in words.

    `failed_peer`: the id of the *other* worker whose failure this is (a KV transfer's peer);
    it travels as trailing metadata (`proto.pdserve.v1.trailers.FAILED_PEER`) so the router
    blames that worker, not this one."""

    def __init__(self, code: grpc.StatusCode, message: str, failed_peer: str = "") -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.failed_peer = failed_peer

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """What the handler sends with the status (empty unless a peer is blamed)."""
        return ((FAILED_PEER, self.failed_peer),) if self.failed_peer else ()


_Callback = tuple[Callable[..., None], tuple[Any, ...]]
_collecting = threading.local()  # .pending: {loop: [callbacks]} inside `delivered_together`


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    pending: dict[asyncio.AbstractEventLoop, list[_Callback]] | None = getattr(
        _collecting, "pending", None
    )
    if pending is not None:
        pending.setdefault(loop, []).append((fn, args))
        return
    _hand_over(loop, _run_each, [(fn, args)])


def _hand_over(
    loop: asyncio.AbstractEventLoop, fn: Callable[..., None], callbacks: list[_Callback]
) -> None:
    try:
        loop.call_soon_threadsafe(fn, callbacks)
    except RuntimeError:
        # The loop is closed: the server stopped and nobody is waiting for these answers.
        log.debug("event loop closed; dropped %d answers for finished RPCs", len(callbacks))


def _run_each(callbacks: list[_Callback]) -> None:
    """On the loop: run the collected callbacks in the order they were given."""
    for fn, args in callbacks:
        fn(*args)


@contextlib.contextmanager
def delivered_together() -> Iterator[None]:
    """Collect the answers given on this thread inside the block; hand them to their loops,
    in order, with one ``call_soon_threadsafe`` per loop when the block ends (see the module
    doc). Not reentrant."""
    pending: dict[asyncio.AbstractEventLoop, list[_Callback]] = {}
    assert getattr(_collecting, "pending", None) is None, "delivered_together is not reentrant"
    _collecting.pending = pending
    try:
        yield
    finally:
        _collecting.pending = None
        for loop, callbacks in pending.items():
            _hand_over(loop, _run_each, callbacks)


class UnarySink:
    """The single answer of a unary RPC. Engine thread: `set` / `fail`; loop: `await wait()`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.created = time.monotonic()  # the RPC's arrival, before any engine-queue wait
        self._future: asyncio.Future[Any] = loop.create_future()
        self.closed = False  # engine-thread view: an answer was given

    def set(self, value: Any) -> None:
        if not self.closed:
            self.closed = True
            _call_soon(self._loop, self._resolve, value, None)

    def fail(self, error: WorkerError) -> None:
        if not self.closed:
            self.closed = True
            _call_soon(self._loop, self._resolve, None, error)

    def _resolve(self, value: Any, error: WorkerError | None) -> None:
        if self._future.done():  # the handler was cancelled meanwhile
            return
        if error is not None:
            self._future.set_exception(error)
        else:
            self._future.set_result(value)

    async def wait(self) -> Any:
        """The value given to `set`; raises the `WorkerError` given to `fail`."""
        return await self._future


class StreamSink:
    """The chunks of a streaming RPC. Engine thread: `put` / `fail`; loop: ``async for``.

    Iteration ends after a chunk with ``finished=True``; a `fail` raises its `WorkerError` in
    the consumer after the chunks already put (merged, see `__aiter__`).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.created = time.monotonic()  # the RPC's arrival, before any engine-queue wait
        self._queue: asyncio.Queue[worker_pb2.TokenChunk | WorkerError] = asyncio.Queue()
        self.closed = False
        self.num_chunks = 0  # chunks put so far (engine-thread view)

    def put(self, chunk: worker_pb2.TokenChunk) -> None:
        if not self.closed:
            self.closed = chunk.finished
            self.num_chunks += 1
            _call_soon(self._loop, self._queue.put_nowait, chunk)

    def fail(self, error: WorkerError) -> None:
        if not self.closed:
            self.closed = True
            _call_soon(self._loop, self._queue.put_nowait, error)

    async def __aiter__(self) -> AsyncIterator[worker_pb2.TokenChunk]:
        """The chunks in order. After the first, chunks that piled up while the consumer was
        busy (the loop lagging behind the engine) go out merged into one message — their
        tokens in order, the last one's end — so a loaded worker and router handle fewer,
        larger messages instead of falling further behind."""
        first = True
        while True:
            item = await self._queue.get()
            if isinstance(item, WorkerError):
                raise item
            error = None
            while not first and not item.finished and not self._queue.empty():
                more = self._queue.get_nowait()
                if isinstance(more, WorkerError):
                    error = more
                    break
                item.MergeFrom(more)  # repeated fields append; set scalars (the end) overwrite
            first = False
            yield item
            if error is not None:
                raise error
            if item.finished:
                return


Sink = UnarySink | StreamSink
