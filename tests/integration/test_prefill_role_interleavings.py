"""Scripted interleavings of a prefill role and a decode role over loopback, one event at a time.

The test thread plays both engine threads: the prefill role's step opens the transfer and sends
its layers (loopback hands them over during the step), and each side learns the transfer's
result only when the test polls its transport. So "the transfer is in flight" is a state the
script holds for as long as it likes: the prefill request is cancelled there, or its deadline
passes there. Each script ends with every block of both workers free, neither role holding
anything and both engines' `check_integrity` passing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from decode_worker.decode import DecodeRole
from kvtransfer.loopback import LoopbackHub, LoopbackTransport
from model_runtime.engine import LLMEngine
from model_runtime.engine_config import EngineConfig
from prefill_worker.prefill import PrefillRole
from proto.pdserve.v1 import worker_pb2 as pb
from worker.roles import RoleContext, RoleHandler
from worker.sinks import UnarySink, WorkerError

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
CANCELLED = WorkerError(grpc.StatusCode.CANCELLED, "the test cancelled it")


class Pair:
    """A prefill and a decode role, each on its own engine, sharing a loopback hub."""

    def __init__(self, model_dir: Path) -> None:
        cfg = EngineConfig(block_size=4, num_kv_blocks=32)
        hub = LoopbackHub()
        self.p_engine = LLMEngine.from_model_dir(model_dir, cfg)
        self.d_engine = LLMEngine.from_model_dir(model_dir, cfg)
        self.p_tr = LoopbackTransport(hub, "p", self.p_engine.runner.kv_cache)
        self.d_tr = LoopbackTransport(hub, "d", self.d_engine.runner.kv_cache)
        self.p = PrefillRole(RoleContext(self.p_engine, self.p_tr, "p", 1, 30.0, 60.0))
        self.d = DecodeRole(RoleContext(self.d_engine, self.d_tr, "d", 1, 30.0, 60.0))
        self.loop = asyncio.new_event_loop()
        self.totals = (self.p_engine.block_pool.num_free, self.d_engine.block_pool.num_free)

    def reserve(self, rid: str) -> pb.TransferTicket:
        sink = UnarySink(self.loop)
        req = pb.ReserveRequest(request_id=rid, num_prompt_tokens=len(PROMPT), max_tokens=4)
        self.d.reserve(req, sink, 30.0)
        answer: pb.ReserveResponse = self.loop.run_until_complete(sink.wait())
        return answer.ticket

    def prefill(self, rid: str, ticket: pb.TransferTicket, timeout_s: float = 60.0) -> UnarySink:
        sink = UnarySink(self.loop)
        req = pb.PrefillRequest(
            request_id=rid,
            prompt_token_ids=PROMPT,
            sampling=pb.WorkerSampling(max_tokens=4, ignore_eos=True),
            ticket=ticket,
        )
        self.p.prefill(req, sink, timeout_s)
        return sink

    def step_prefill(self) -> None:
        """One prefill step: opens the transfer and sends every layer (loopback delivers)."""
        outputs = self.p_engine.step(self.p.before_forward)
        self.p.on_outputs(outputs, time.monotonic(), time.monotonic())

    def poll(self, role: RoleHandler, transport: LoopbackTransport) -> int:
        results = transport.poll()
        role.on_transfer_results(results)
        return len(results)

    def answer(self, sink: UnarySink) -> object:
        async def get() -> object:
            try:
                return await sink.wait()
            except WorkerError as exc:
                return exc

        return self.loop.run_until_complete(get())

    def all_free(self) -> None:
        for role, engine, total in ((self.p, self.p_engine, self.totals[0]),
                                    (self.d, self.d_engine, self.totals[1])):  # fmt: skip
            assert role.num_active() == 0 and not role.transfers_in_flight(), role.name
            engine.check_integrity()
            assert engine.block_pool.num_free == total, (role.name, engine.block_pool.num_free)


@pytest.fixture
def pair(tiny_model_dir: Path) -> Iterator[Pair]:
    p = Pair(tiny_model_dir)
    yield p
    p.loop.close()


def test_the_whole_hand_off_frees_both_sides(pair: Pair) -> None:
    t = pair.reserve("a")
    sink = pair.prefill("a", t)
    pair.step_prefill()  # 1. prefill + layers sent; the answer waits for the result
    assert not sink.closed
    assert pair.poll(pair.d, pair.d_tr) == 1  # 2. the receiver writes and acknowledges
    assert pair.poll(pair.p, pair.p_tr) == 1  # 3. the sender sees it: blocks released
    answer = pair.answer(sink)
    assert isinstance(answer, pb.PrefillResponse), answer
    assert pair.d.abort("a", None, CANCELLED)  # 4. no Decode in this script: let it go
    pair.all_free()


@pytest.mark.parametrize("receiver_polls_first", [True, False])
def test_cancel_while_the_transfer_is_in_flight(pair: Pair, receiver_polls_first: bool) -> None:
    t = pair.reserve("a")
    sink = pair.prefill("a", t)
    pair.step_prefill()  # 1. the transfer is open; no side has polled yet
    assert pair.p.abort("a", None, CANCELLED)  # 2. cancelled in flight: answered at once
    assert isinstance(pair.answer(sink), WorkerError)
    assert pair.p_engine.block_pool.num_free < pair.totals[0]  # 3. still held for the transport
    sides = [(pair.d, pair.d_tr), (pair.p, pair.p_tr)]
    for role, transport in sides if receiver_polls_first else sides[::-1]:
        pair.poll(role, transport)  # 4. each side's result frees what it held
    pair.all_free()


def test_prefill_deadline_passing_in_flight_frees_at_the_result(pair: Pair) -> None:
    t = pair.reserve("a")
    sink = pair.prefill("a", t, timeout_s=0.05)
    deadline = time.monotonic() + 0.05
    pair.step_prefill()  # 1. the transfer is open
    while time.monotonic() <= deadline:  # 2. the request's deadline passes (the state tested)
        time.sleep(0.005)
    pair.p.expire(time.monotonic())  # 3. expiry cancels the transfer, answers the RPC
    error = pair.answer(sink)
    assert isinstance(error, WorkerError) and error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    pair.poll(pair.d, pair.d_tr)  # 4. both results: the decode reservation fails, P releases
    pair.poll(pair.p, pair.p_tr)
    pair.all_free()


def test_cancel_before_the_step_frees_at_once(pair: Pair) -> None:
    t = pair.reserve("a")
    sink = pair.prefill("a", t)
    assert pair.p.abort("a", None, CANCELLED)  # 1. queued only: nothing opened
    assert isinstance(pair.answer(sink), WorkerError)
    assert pair.d.abort("a", None, CANCELLED)  # 2. the router aborts the reservation too
    pair.poll(pair.d, pair.d_tr)  # 3. the expected transfer's cancelled result
    pair.all_free()
