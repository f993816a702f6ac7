"""Unit tests of `router.client_stream.ClientStream` (one event loop, the tiny model's
tokenizer, a fake `send`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from model_runtime.tokenizer import Tokenizer
from proto.pdserve.v1 import inference_pb2
from router.client_stream import ClientStream, FinalFacts


def test_what_piles_up_while_a_write_is_in_flight_goes_out_as_one(tiny_model_dir: Path) -> None:
    """While one write is in flight, later pushes go out as one message (tokens and text
    joined, in order); the final message is written before `push` returns True."""
    tok = Tokenizer.from_model_dir(tiny_model_dir)

    async def scenario() -> list[inference_pb2.GenerateResponse]:
        written: list[inference_pb2.GenerateResponse] = []
        gate = asyncio.Event()

        async def send(resp: inference_pb2.GenerateResponse) -> None:
            await gate.wait()  # a slow client: the first write is held until released
            written.append(resp)

        c = ClientStream("r", send, tok, (), 0.0, FinalFacts(prompt_tokens=3))
        assert not await c.push([5], False)
        await asyncio.sleep(0)  # the writer takes the first message and waits in `send`
        assert not await c.push([6], False) and not await c.push([7, 8], False)
        gate.set()
        assert await c.push([9], True, "length")
        return written

    out = asyncio.run(scenario())
    assert [list(r.token_ids) for r in out] == [[5], [6, 7, 8, 9]]
    assert out[1].final.finish_reason == "length" and out[1].final.usage.completion_tokens == 5
    assert "".join(r.text for r in out) == tok.decode([5, 6, 7, 8, 9])


def test_close_stops_a_writer_that_waits_for_more(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_model_dir(tiny_model_dir)

    async def scenario() -> list[list[int]]:
        written: list[list[int]] = []

        async def send(resp: inference_pb2.GenerateResponse) -> None:
            written.append(list(resp.token_ids))

        c = ClientStream("r", send, tok, (), 0.0, FinalFacts(prompt_tokens=3))
        await c.push([5, 6], False)
        await asyncio.sleep(0.01)
        c.close()
        await asyncio.sleep(0)
        assert c._writer is not None and c._writer.done()
        return written

    assert asyncio.run(scenario()) == [[5, 6]]


def test_a_failed_write_after_the_client_left_is_not_an_unretrieved_task_error(
    tiny_model_dir: Path,
) -> None:
    """The client went away: the writer's send fails, nobody pushes again, the request is
    closed. The writer's exception must not reach the loop's "Task exception was never
    retrieved" (logged at ERROR)."""
    import gc

    tok = Tokenizer.from_model_dir(tiny_model_dir)
    reported: list[dict[str, object]] = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: reported.append(ctx))
        failed = asyncio.Event()

        async def send(resp: inference_pb2.GenerateResponse) -> None:
            failed.set()
            raise RuntimeError("the client's connection is gone")

        c = ClientStream("r", send, tok, (), 0.0, FinalFacts(prompt_tokens=3))
        await c.push([5, 6], finished=False)
        await failed.wait()
        await asyncio.sleep(0)  # the writer task finishes with its error
        c.close()
        del c
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(scenario())
    gc.collect()
    assert not [r for r in reported if "never retrieved" in str(r.get("message"))], reported
