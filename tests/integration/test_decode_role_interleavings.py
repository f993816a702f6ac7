"""Scripted interleavings of the decode role's block ownership, one event at a time.

The test thread plays the engine thread: it calls `DecodeRole` the way `worker.engine_thread`
does (its typed RPC entry points (`reserve`, `decode`), `on_transfer_results` with what the receiving loopback transport's
`poll()` returns, `expire(now)`, `abort`, engine steps), and a second loopback transport plays
the prefill worker sending the KV. Nothing runs concurrently, so every order below is made,
not hoped for: cancel during a transfer, expiry with no transfer, a transfer that fails after
its reservation expired (both orders of the two events), a Decode after a cancel, a transfer
failure under a waiting Decode, and a Decode that waits for its transfer. Each script ends
with every block of the decode worker free, the role holding nothing and `check_integrity`
passing. (The RPC answers are read on an event loop that runs only when the test awaits one.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from decode_worker.decode import DecodeRole
from kvtransfer.loopback import LoopbackHub, LoopbackTransport
from kvtransfer.types import TransferTicket
from model_runtime.engine import LLMEngine
from model_runtime.engine_config import EngineConfig
from proto.pdserve.v1 import worker_pb2 as pb
from worker.convert import ticket_from_proto
from worker.roles import RoleContext
from worker.sinks import StreamSink, UnarySink, WorkerError

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
CANCELLED = WorkerError(grpc.StatusCode.CANCELLED, "the test cancelled it")


class Script:
    """A decode role over loopback, a sender transport, and an unstarted event loop."""

    def __init__(self, model_dir: Path) -> None:
        cfg = EngineConfig(block_size=4, num_kv_blocks=32)
        self.engine = LLMEngine.from_model_dir(model_dir, cfg)
        self.sender_engine = LLMEngine.from_model_dir(model_dir, cfg)
        hub = LoopbackHub()
        self.recv = LoopbackTransport(hub, "d", self.engine.runner.kv_cache)
        self.send = LoopbackTransport(hub, "p", self.sender_engine.runner.kv_cache)
        self.role = DecodeRole(RoleContext(self.engine, self.recv, "d", 1, 30.0, 60.0))
        self.loop = asyncio.new_event_loop()
        self.total = self.engine.block_pool.num_free
        self.layers = self.engine.runner.kv_cache.layout.num_layers

    # -- RPCs --------------------------------------------------------------------------------

    def reserve(self, rid: str, max_tokens: int = 4, life_s: float = 30.0) -> TransferTicket:
        sink = UnarySink(self.loop)
        req = pb.ReserveRequest(
            request_id=rid, num_prompt_tokens=len(PROMPT), max_tokens=max_tokens
        )
        self.role.reserve(req, sink, life_s)
        answer: pb.ReserveResponse = self.loop.run_until_complete(sink.wait())
        return ticket_from_proto(answer.ticket)

    def decode(self, ticket: TransferTicket, max_tokens: int = 4) -> StreamSink:
        sink = StreamSink(self.loop)
        req = pb.DecodeRequest(
            request_id=ticket.request_id,
            transfer_id=ticket.transfer_id,
            prompt_token_ids=PROMPT,
            first_token=20,
            sampling=pb.WorkerSampling(max_tokens=max_tokens, ignore_eos=True),
        )
        self.role.decode(req, sink, 60.0)
        return sink

    def decode_refused(self, ticket: TransferTicket) -> WorkerError:
        with pytest.raises(WorkerError) as info:
            self.decode(ticket)
        return info.value

    # -- the sender and the transport ----------------------------------------------------------

    def push(self, ticket: TransferTicket, layers: int | None = None) -> None:
        """The prefill side opens the transfer and sends `layers` layers (all by default)."""
        src = self.sender_engine.block_pool.allocate(ticket.num_blocks)
        assert src is not None
        self.src = src
        self.send.open(ticket, src)
        for layer in range(self.layers if layers is None else layers):
            self.send.send_layer(ticket.transfer_id, layer)

    def deliver(self) -> list[Any]:
        """One receiver `poll()` handed to the role (as the engine thread does); the sender's
        own results are read too (it frees its source blocks when it sees them)."""
        results = self.recv.poll()
        self.role.on_transfer_results(results)
        for r in self.send.poll():
            assert r.role == "send"
            self.sender_engine.block_pool.free(list(reversed(self.src)))
        return results

    def wait_past(self, deadline: float) -> None:
        """Until the monotonic clock is past `deadline` (a time-based state: the transport's
        and the reservation's deadlines are the thing under test)."""
        while time.monotonic() <= deadline:
            time.sleep(0.005)

    # -- reading answers -----------------------------------------------------------------------

    def chunks(self, sink: StreamSink) -> tuple[list[int], WorkerError | None]:
        async def read() -> tuple[list[int], WorkerError | None]:
            tokens: list[int] = []
            try:
                async for chunk in sink:
                    tokens += chunk.token_ids
            except WorkerError as exc:
                return tokens, exc
            return tokens, None

        return self.loop.run_until_complete(read())

    def run_to_end(self) -> None:
        for _ in range(100):
            if not self.engine.has_unfinished():
                return
            self.role.on_outputs(self.engine.step(), time.monotonic(), time.monotonic())
        raise AssertionError("the engine never finished")

    # -- the end of every script ---------------------------------------------------------------

    def all_free(self) -> None:
        assert self.role.num_active() == 0 and not self.role.transfers_in_flight()
        self.engine.check_integrity()
        assert self.engine.block_pool.num_free == self.total


@pytest.fixture
def script(tiny_model_dir: Path) -> Iterator[Script]:
    s = Script(tiny_model_dir)
    yield s
    s.loop.close()


def test_cancel_during_the_transfer_frees_at_its_result(script: Script) -> None:
    t = script.reserve("a")
    script.push(t, layers=1)  # 1. the transfer is under way
    assert script.role.abort("a", None, CANCELLED)  # 2. cancelled in flight
    assert script.engine.block_pool.num_free < script.total  # 3. the transport still owns them
    assert script.decode_refused(t).code == grpc.StatusCode.CANCELLED  # 4. a late Decode
    (result,) = script.deliver()  # 5. the transport reports the cancelled transfer
    assert not result.ok
    script.all_free()


def test_a_reservation_nobody_decodes_expires(script: Script) -> None:
    t = script.reserve("a", life_s=0.05)
    expires = time.monotonic() + 0.05
    script.wait_past(expires)
    script.role.expire(time.monotonic())  # 1. expiry cancels the expected transfer
    assert script.decode_refused(t).code == grpc.StatusCode.DEADLINE_EXCEEDED
    script.deliver()  # 2. its (cancelled) result frees the blocks
    script.all_free()


@pytest.mark.parametrize("expire_first", [True, False])
def test_transfer_failure_after_expiry_frees_once(script: Script, expire_first: bool) -> None:
    t = script.reserve("a", life_s=0.05)
    script.push(t, layers=1)  # the sender stalls after one layer
    script.wait_past(time.monotonic() + 0.06)  # both deadlines passed
    if expire_first:
        script.role.expire(time.monotonic())  # 1. the reservation expires, 2. the result
        script.deliver()
    else:
        (result,) = script.deliver()  # 1. the transfer's own deadline, 2. expiry: nothing left
        assert not result.ok
        script.role.expire(time.monotonic())
    assert script.decode_refused(t).code == grpc.StatusCode.DEADLINE_EXCEEDED
    script.all_free()


def test_decode_after_cancel_of_a_ready_reservation(script: Script) -> None:
    t = script.reserve("a")
    script.push(t)
    script.deliver()  # 1. the KV arrived: ready, blocks still the role's
    assert script.role.abort("a", None, CANCELLED)  # 2. cancelled before any Decode
    assert script.decode_refused(t).code == grpc.StatusCode.CANCELLED  # 3. Decode arrives
    script.all_free()


def test_transfer_failure_fails_the_waiting_decode(script: Script) -> None:
    t = script.reserve("a")
    script.push(t, layers=1)
    sink = script.decode(t)  # 1. Decode waits for the transfer
    script.send.cancel(t.transfer_id)  # 2. the sender gives up
    script.deliver()
    tokens, error = script.chunks(sink)
    assert tokens == [] and error is not None and error.code == grpc.StatusCode.UNAVAILABLE
    script.all_free()


def test_decode_waiting_for_its_transfer_runs_when_it_lands(script: Script) -> None:
    t = script.reserve("a")
    sink = script.decode(t)  # 1. Decode before any KV
    script.push(t)
    script.deliver()  # 2. the KV lands: admitted
    script.run_to_end()  # 3. decodes to max_tokens
    tokens, error = script.chunks(sink)
    assert error is None and len(tokens) == 3  # the first of 4 came from the prefill
    script.all_free()


def test_cancel_while_decoding_returns_the_blocks_to_the_pool(script: Script) -> None:
    t = script.reserve("a", max_tokens=8)
    script.push(t)
    script.deliver()
    sink = script.decode(t, max_tokens=8)
    script.role.on_outputs(script.engine.step(), time.monotonic(), time.monotonic())
    assert script.role.abort("a", None, CANCELLED)  # the engine owns the blocks now
    _, error = script.chunks(sink)
    assert error is not None and error.code == grpc.StatusCode.CANCELLED
    script.all_free()
