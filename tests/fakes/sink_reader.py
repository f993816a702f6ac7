"""Reading a worker's answers from the test thread: what a role put into its sinks, taken off
the event loop the sinks deliver to (a test's own loop, not running between the calls).

Used by the tests that drive roles or engine threads on the test thread
(`test_role_interleavings`, `test_role_contract`).
"""

from __future__ import annotations

import asyncio

from worker.sinks import StreamSink, UnarySink, WorkerError


def answer(loop: asyncio.AbstractEventLoop, sink: UnarySink) -> object:
    """The unary answer, or the `WorkerError` it failed with."""

    async def get() -> object:
        try:
            return await sink.wait()
        except WorkerError as exc:
            return exc

    return loop.run_until_complete(get())


def tokens(
    loop: asyncio.AbstractEventLoop, sink: StreamSink
) -> tuple[list[int], WorkerError | None]:
    """The tokens a stream carried, and the `WorkerError` it ended with (None: finished)."""

    async def read() -> tuple[list[int], WorkerError | None]:
        out: list[int] = []
        try:
            async for chunk in sink:
                out += chunk.token_ids
        except WorkerError as exc:
            return out, exc
        return out, None

    return loop.run_until_complete(read())
