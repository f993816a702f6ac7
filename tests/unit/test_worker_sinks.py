"""Unit tests of `worker.sinks.StreamSink`: order, the end, errors, and chunks that piled up
while the consumer was busy going out merged (never into the first one)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from proto.pdserve.v1 import worker_pb2 as pb
from worker.sinks import StreamSink, WorkerError


def _chunk(*tokens: int, finished: bool = False, reason: str = "") -> pb.TokenChunk:
    return pb.TokenChunk(token_ids=list(tokens), finished=finished, finish_reason=reason)


def test_piled_up_chunks_go_out_merged_after_the_first() -> None:
    async def scenario() -> list[pb.TokenChunk]:
        sink = StreamSink(asyncio.get_running_loop())
        first = _chunk(1)
        first.admission_ms = 2.5
        for c in (first, _chunk(2), _chunk(3), _chunk(4, finished=True, reason="length")):
            sink.put(c)
        await asyncio.sleep(0)  # the engine thread's call_soon callbacks land
        return [c async for c in sink]

    out = asyncio.run(scenario())
    assert [list(c.token_ids) for c in out] == [[1], [2, 3, 4]]
    assert out[0].admission_ms == 2.5 and not out[0].finished
    assert out[1].finished and out[1].finish_reason == "length" and out[1].admission_ms == 0


def test_an_error_after_piled_up_chunks_comes_after_them() -> None:
    async def scenario() -> tuple[list[list[int]], WorkerError]:
        sink = StreamSink(asyncio.get_running_loop())
        for c in (_chunk(1), _chunk(2), _chunk(3)):
            sink.put(c)
        sink.fail(WorkerError(grpc.StatusCode.UNAVAILABLE, "gone"))
        await asyncio.sleep(0)
        got: list[list[int]] = []
        with pytest.raises(WorkerError) as err:
            async for c in sink:
                got.append(list(c.token_ids))
        return got, err.value

    got, err = asyncio.run(scenario())
    assert got == [[1], [2, 3]] and err.code == grpc.StatusCode.UNAVAILABLE
