"""`worker.sinks`: answers given on the engine thread reach the event loop in order; inside
`delivered_together` a whole step's answers cost the loop one wake-up."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from proto.pdserve.v1 import worker_pb2
from worker.sinks import StreamSink, UnarySink, WorkerError, delivered_together


class CountingLoop(asyncio.SelectorEventLoop):
    """An event loop that counts `call_soon_threadsafe` calls (each is one self-pipe write)."""

    def __init__(self) -> None:
        super().__init__()
        self.handovers = 0

    def call_soon_threadsafe(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.handovers += 1
        return super().call_soon_threadsafe(*args, **kwargs)


def _on_thread(fn: object) -> None:
    assert callable(fn)
    t = threading.Thread(target=fn)
    t.start()
    t.join(10)


def test_delivered_together_hands_a_step_over_once_in_order() -> None:
    loop = CountingLoop()
    try:
        streams = [StreamSink(loop) for _ in range(3)]
        unary = UnarySink(loop)

        def step() -> None:
            with delivered_together():
                for k in range(2):
                    for i, s in enumerate(streams):
                        s.put(worker_pb2.TokenChunk(token_ids=[10 * i + k], finished=k == 1))
                unary.set("reserved")

        _on_thread(step)
        assert loop.handovers == 1

        async def consume() -> list[list[int]]:
            got = []
            for s in streams:
                got.append([t for c in [c async for c in s] for t in c.token_ids])
            return got

        assert loop.run_until_complete(consume()) == [[0, 1], [10, 11], [20, 21]]
        assert loop.run_until_complete(unary.wait()) == "reserved"
        _on_thread(lambda: unary.set("ignored: already answered"))  # closed sinks stay closed
        assert loop.handovers == 1
    finally:
        loop.close()


def test_without_the_block_each_answer_is_its_own_handover_and_errors_still_arrive() -> None:
    loop = CountingLoop()
    try:
        sink = StreamSink(loop)

        def answers() -> None:
            sink.put(worker_pb2.TokenChunk(token_ids=[1]))
            sink.fail(WorkerError(grpc.StatusCode.ABORTED, "aborted"))

        _on_thread(answers)
        assert loop.handovers == 2

        async def consume() -> list[int]:
            return [t async for c in sink for t in c.token_ids]

        with pytest.raises(WorkerError, match="aborted"):
            loop.run_until_complete(consume())
    finally:
        loop.close()
