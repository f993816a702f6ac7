"""The worker roles' interleavings, scripted one event at a time over the loopback transport.

`PrefillRole` and `RemoteDecodeRole` run on two tiny random engines, each over its worker's
hand-off owner (`worker.kv_handoff.KVHandoff`); the test thread plays both engine threads
through the roles' typed entry points (`prefill`, `reserve`, `decode`) and the lifecycle calls
`worker.engine_thread` makes (`before_forward`/`on_outputs` around a step, `on_handoff` with
the outcomes each side's `KVHandoff.poll()` returns, `expire(now)`, `abort`). The
loopback transport (`kvtransfer.loopback`, the seam's same-process implementation, held to the
real transport by tests/integration/test_kvtransfer_contract.py) delivers layers during the
step and reports a result only when its side polls, so "the transfer is in flight" lasts as
long as a script wants; an open that raises is a transport closed beforehand, or a transfer id
still open; deadlines are reached by passing `expire` a later `now`, never by sleeping.

Every script ends with every block of both workers free, both roles holding nothing, no
transfer in flight and both engines' `check_integrity` (which counts each block's holders:
running requests, sends, reservations, abandoned transfers) passing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from decode_worker.decode import RemoteDecodeRole
from kvtransfer.loopback import LoopbackHub, LoopbackTransport
from model_runtime.engine import LLMEngine
from model_runtime.engine_config import EngineConfig
from model_runtime.scheduler import Receive
from prefill_worker.prefill import PrefillRole
from proto.pdserve.v1 import worker_pb2 as pb
from tests.fakes import sink_reader
from worker.kv_handoff import KVHandoff
from worker.roles import RoleContext
from worker.sinks import StreamSink, UnarySink, WorkerError

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
CANCELLED = WorkerError(grpc.StatusCode.CANCELLED, "the test cancelled it")
LATER = 3600.0  # seconds: an `expire(now)` this far ahead is past every deadline here
# Past a reservation's 30 s lifetime, within the 60 s a tombstone answers a late Decode.
LAPSED = 45.0


class Pair:
    """A prefill role and a decode role, each on its own engine, sharing a loopback hub."""

    def __init__(self, model_dir: Path) -> None:
        cfg = EngineConfig(block_size=4, num_kv_blocks=32)
        hub = LoopbackHub()
        self.p_engine = LLMEngine.from_model_dir(model_dir, cfg)
        self.d_engine = LLMEngine.from_model_dir(model_dir, cfg)
        self.p_tr = LoopbackTransport(hub, "p", self.p_engine.runner.kv_cache)
        self.d_tr = LoopbackTransport(hub, "d", self.d_engine.runner.kv_cache)
        self.p_handoff = KVHandoff(self.p_engine, self.p_tr, 1)
        self.d_handoff = KVHandoff(self.d_engine, self.d_tr, 1)
        self.p = PrefillRole(RoleContext(self.p_engine, self.p_handoff, "p", 30.0, 60.0))
        self.d = RemoteDecodeRole(RoleContext(self.d_engine, self.d_handoff, "d", 30.0, 60.0))
        self.loop = asyncio.new_event_loop()
        self.total = cfg.num_kv_blocks

    # -- RPCs through the typed entry points ------------------------------------------------

    def reserve(self, rid: str, max_tokens: int = 4, life_s: float = 30.0) -> pb.TransferTicket:
        sink = UnarySink(self.loop)
        req = pb.ReserveRequest(
            request_id=rid, num_prompt_tokens=len(PROMPT), max_tokens=max_tokens
        )
        self.d.reserve(req, sink, life_s)
        answer = self.answer(sink)
        assert isinstance(answer, pb.ReserveResponse), answer
        return answer.ticket

    def reserve_refused(self, rid: str, max_tokens: int = 4) -> WorkerError:
        req = pb.ReserveRequest(
            request_id=rid, num_prompt_tokens=len(PROMPT), max_tokens=max_tokens
        )
        with pytest.raises(WorkerError) as info:
            self.d.reserve(req, UnarySink(self.loop), 30.0)
        return info.value

    def prefill(self, rid: str, ticket: pb.TransferTicket, max_tokens: int = 4) -> UnarySink:
        sink = UnarySink(self.loop)
        req = pb.PrefillRequest(
            request_id=rid,
            prompt_token_ids=PROMPT,
            sampling=pb.WorkerSampling(max_tokens=max_tokens, ignore_eos=True),
            ticket=ticket,
        )
        self.p.prefill(req, sink, 60.0)
        return sink

    def decode(
        self, rid: str, ticket: pb.TransferTicket, first: int, max_tokens: int = 4
    ) -> StreamSink:
        sink = StreamSink(self.loop)
        req = pb.DecodeRequest(
            request_id=rid,
            transfer_id=ticket.transfer_id,
            prompt_token_ids=PROMPT,
            first_token=first,
            sampling=pb.WorkerSampling(max_tokens=max_tokens, ignore_eos=True),
        )
        self.d.decode(req, sink, 60.0)
        return sink

    def decode_refused(self, rid: str, ticket: pb.TransferTicket) -> WorkerError:
        with pytest.raises(WorkerError) as info:
            self.decode(rid, ticket, 20)
        return info.value

    # -- what the engine threads do ---------------------------------------------------------

    def step_prefill(self) -> None:
        """One prefill step: opens the transfers and sends every layer (loopback delivers)."""
        outputs = self.p_engine.step(self.p.before_forward)
        self.p.on_outputs(outputs, time.monotonic(), time.monotonic())

    def poll_d(self) -> list[bool]:
        outcomes, results = self.d_handoff.poll()
        self.d.on_handoff(outcomes)
        return [r.ok for r in results]

    def poll_p(self) -> list[bool]:
        outcomes, results = self.p_handoff.poll()
        self.p.on_handoff(outcomes)
        return [r.ok for r in results]

    def run_decode(self) -> None:
        for _ in range(100):
            if not self.d_engine.has_unfinished():
                return
            self.d.on_outputs(self.d_engine.step(), time.monotonic(), time.monotonic())
        raise AssertionError("the decode engine never finished")

    # -- answers --------------------------------------------------------------------------

    def answer(self, sink: UnarySink) -> object:
        return sink_reader.answer(self.loop, sink)

    def failed(self, sink: UnarySink) -> grpc.StatusCode:
        answer = self.answer(sink)
        assert isinstance(answer, WorkerError), answer
        return answer.code

    def chunks(self, sink: StreamSink) -> tuple[list[int], WorkerError | None]:
        return sink_reader.tokens(self.loop, sink)

    # -- the end of every script ------------------------------------------------------------

    def p_held(self) -> int:
        return self.total - self.p_engine.block_pool.num_free

    def all_free(self) -> None:
        for role, engine, handoff in (
            (self.p, self.p_engine, self.p_handoff),
            (self.d, self.d_engine, self.d_handoff),
        ):
            assert role.num_active() == 0 and not handoff.in_flight(), role.name
            assert not role.request_ids(), (role.name, role.request_ids())
            engine.check_integrity()
            assert engine.block_pool.num_free == self.total, (role.name, engine.block_pool.num_free)


@pytest.fixture
def pair(tiny_model_dir: Path) -> Iterator[Pair]:
    p = Pair(tiny_model_dir)
    yield p
    p.loop.close()


# ---- prefill side -------------------------------------------------------------------------


def test_the_whole_hand_off_then_decode(pair: Pair) -> None:
    t = pair.reserve("a")
    sink = pair.prefill("a", t)
    pair.step_prefill()  # 1. prefill + layers sent; the send holds the blocks
    assert pair.p_handoff.sending("a")
    assert not sink.closed and pair.p_held() > 0
    assert pair.poll_d() == [True]  # 2. the receiver writes and acknowledges
    assert pair.poll_p() == [True]  # 3. the sender's result frees its blocks, answers
    answer = pair.answer(sink)
    assert isinstance(answer, pb.PrefillResponse) and not answer.finished, answer
    stream = pair.decode("a", t, answer.first_token)  # 4. received: admitted at once
    pair.run_decode()
    tokens, error = pair.chunks(stream)
    assert error is None and len(tokens) == 3, (tokens, error)
    pair.all_free()


def test_open_raises_answers_and_frees_when_the_step_ends(pair: Pair) -> None:
    t = pair.reserve("a")
    sink = pair.prefill("a", t)
    pair.p_tr.close()  # 1. the sender's transport is gone: `open` raises in the step
    pair.step_prefill()  # 2. the step still runs; nothing reads the blocks, so they are freed
    assert pair.failed(sink) == grpc.StatusCode.INTERNAL
    assert not pair.p_engine.scheduler.sending and pair.p_held() == 0
    assert pair.d.abort("a", None, CANCELLED)  # 3. the router gives the reservation up
    assert pair.poll_d() == [False]  # 4. its cancelled result frees the decode blocks
    assert pair.poll_p() == []
    pair.all_free()


def test_abort_before_the_opening_step_frees_at_once(pair: Pair) -> None:
    t = pair.reserve("a")
    sink = pair.prefill("a", t)
    assert pair.p.abort("a", None, CANCELLED)  # 1. queued only: nothing opened, nothing held
    assert pair.failed(sink) == grpc.StatusCode.CANCELLED
    assert not pair.p_engine.has_unfinished() and pair.p_held() == 0
    pair.step_prefill()  # 2. an empty step opens nothing
    assert pair.d.abort("a", None, CANCELLED)  # 3. the router aborts the reservation too
    assert pair.poll_d() == [False]  # 4. the expected transfer's cancelled result
    pair.all_free()


@pytest.mark.parametrize("receiver_polls_first", [True, False])
def test_cancel_while_the_send_is_in_flight(pair: Pair, receiver_polls_first: bool) -> None:
    t = pair.reserve("a")
    sink = pair.prefill("a", t)
    pair.step_prefill()  # 1. the transfer is open; no side has polled yet
    assert pair.p.abort("a", None, CANCELLED)  # 2. cancelled in flight: answered at once
    assert pair.failed(sink) == grpc.StatusCode.CANCELLED
    assert pair.p_held() > 0  # 3. still held for the transport
    polls = [pair.poll_d, pair.poll_p]
    for poll in polls if receiver_polls_first else polls[::-1]:
        poll()  # 4. each side's result frees what it held
    assert pair.decode_refused("a", t).code == grpc.StatusCode.UNAVAILABLE
    pair.all_free()


def test_a_retry_with_the_same_ticket_while_the_cancelled_send_is_in_flight(pair: Pair) -> None:
    t = pair.reserve("a")
    first = pair.prefill("a", t)
    pair.step_prefill()  # 1. the transfer is open
    assert pair.p.abort("a", None, CANCELLED)  # 2. cancelled in flight: abandoned, held
    assert t.transfer_id in pair.p_engine.scheduler.abandoned
    assert pair.failed(first) == grpc.StatusCode.CANCELLED
    retry = pair.prefill("a", t)  # 3. the id is free again; the transfer id is still open
    pair.step_prefill()  # 4. its open raises ("already open"): answered, its blocks freed
    assert pair.failed(retry) == grpc.StatusCode.INTERNAL
    assert t.transfer_id in pair.p_engine.scheduler.abandoned  # untouched
    assert pair.p.num_active() == 0 and pair.p_handoff.num_abandoned() == 1  # still held
    queued = pair.prefill("a", t)  # 5. another retry, its deadline passes before its step:
    pair.p.expire(time.monotonic() + LATER)  # the predecessor's send is not its own
    error = pair.answer(queued)
    assert isinstance(error, WorkerError) and "while prefilling" in error.message, error
    assert t.transfer_id in pair.p_engine.scheduler.abandoned
    pair.poll_d()
    assert pair.poll_p() == [False]  # 6. the cancelled transfer's result frees them
    assert pair.d.abort("a", None, CANCELLED) in (True, False)  # the router's clean-up
    pair.poll_d()
    pair.all_free()


def test_a_duplicate_prefill_id_is_refused_while_the_first_is_live(pair: Pair) -> None:
    t = pair.reserve("a")
    sink = pair.prefill("a", t)
    with pytest.raises(WorkerError) as info:  # 1. same id, first call unanswered
        pair.prefill("a", t)
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
    pair.step_prefill()  # 2. the first one runs on untouched
    pair.poll_d()
    pair.poll_p()
    assert isinstance(pair.answer(sink), pb.PrefillResponse)
    assert pair.d.abort("a", None, CANCELLED)
    pair.all_free()


def test_abort_after_the_first_token_ended_the_request(pair: Pair) -> None:
    t = pair.reserve("a", max_tokens=1)
    sink = pair.prefill("a", t, max_tokens=1)
    pair.step_prefill()  # 1. the first token ends the request; the send still reads its blocks
    assert not pair.p_engine.has_unfinished() and pair.p_held() > 0
    assert pair.p.abort("a", None, CANCELLED)  # 2. aborted: answered now, freed at the result
    assert pair.failed(sink) == grpc.StatusCode.CANCELLED
    assert pair.p_held() > 0 and pair.p_handoff.num_abandoned() == 1
    assert not pair.p.abort("a", None, CANCELLED)  # 3. a second abort finds nothing
    assert pair.poll_d() == [False]  # 4. the receiver sees the cancel
    assert pair.poll_p() == [False]  # 5. the sender's result frees the blocks once
    pair.d.expire(time.monotonic() + LATER)  # 6. nobody decodes: the reservation lapses
    pair.all_free()


def test_prefill_deadline_in_flight_then_the_transfer_fails(pair: Pair) -> None:
    t = pair.reserve("a")
    sink = pair.prefill("a", t)
    pair.step_prefill()  # 1. the transfer is open
    pair.p.expire(time.monotonic() + LATER)  # 2. the deadline passes: cancelled, answered
    assert pair.failed(sink) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert pair.p_held() > 0
    assert pair.poll_d() == [False]  # 3. the decode reservation fails...
    assert pair.decode_refused("a", t).code == grpc.StatusCode.UNAVAILABLE  # 4. ...and says so
    assert pair.poll_p() == [False]  # 5. the failed result frees the prefill blocks
    pair.all_free()


# ---- decode side --------------------------------------------------------------------------


def test_cancel_during_the_transfer_then_a_late_decode(pair: Pair) -> None:
    t = pair.reserve("a")
    pair.prefill("a", t)
    pair.step_prefill()  # 1. layers delivered, not yet written (the receiver has not polled)
    assert pair.d.abort("a", None, CANCELLED)  # 2. cancelled while RECEIVING: abandoned
    assert t.transfer_id in pair.d_engine.scheduler.abandoned
    assert pair.d_engine.block_pool.num_free < pair.total  # the transport still writes them
    assert pair.decode_refused("a", t).code == grpc.StatusCode.CANCELLED  # 3. a late Decode
    assert pair.poll_d() == [False]  # 4. its result frees them once
    pair.poll_p()
    pair.all_free()


@pytest.mark.parametrize("expire_first", [True, False])
def test_transfer_failure_after_expiry(pair: Pair, expire_first: bool) -> None:
    t = pair.reserve("a")
    pair.prefill("a", t)
    pair.step_prefill()  # 1. in flight
    if expire_first:
        pair.d.expire(time.monotonic() + LAPSED)  # 2. no Decode in time: abandoned
        pair.p_tr.cancel(t.transfer_id)  # 3. then the sender fails the transfer
    else:
        pair.p_tr.cancel(t.transfer_id)  # 2. the sender fails the transfer, unseen yet
        pair.d.expire(time.monotonic() + LAPSED)  # 3. then the reservation expires
    assert pair.poll_d() == [False]  # 4. one result: freed once, nothing left to fail
    assert pair.decode_refused("a", t).code == grpc.StatusCode.DEADLINE_EXCEEDED
    pair.poll_p()
    pair.all_free()


def test_a_reservation_nobody_decodes_expires(pair: Pair) -> None:
    t = pair.reserve("a")
    pair.d.expire(time.monotonic() + LAPSED)  # 1. expiry cancels the expected transfer
    assert pair.decode_refused("a", t).code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert pair.poll_d() == [False]  # 2. its (cancelled) result frees the blocks
    pair.all_free()


def test_decode_after_cancel_of_a_received_reservation(pair: Pair) -> None:
    t = pair.reserve("a")
    pair.prefill("a", t)
    pair.step_prefill()
    pair.poll_d()  # 1. the KV arrived: RECEIVED, no Decode yet
    assert pair.d_handoff.receive_state("a") is Receive.RECEIVED
    pair.poll_p()
    assert pair.d.abort("a", None, CANCELLED)  # 2. cancelled before any Decode: freed now
    assert pair.decode_refused("a", t).code == grpc.StatusCode.CANCELLED  # 3. Decode arrives
    pair.all_free()


def test_transfer_failure_fails_the_waiting_decode(pair: Pair) -> None:
    t = pair.reserve("a")
    pair.prefill("a", t)
    stream = pair.decode("a", t, 20)  # 1. Decode waits for the transfer
    pair.step_prefill()
    pair.p_tr.cancel(t.transfer_id)  # 2. the sender gives up
    assert pair.poll_d() == [False]
    tokens, error = pair.chunks(stream)
    assert tokens == [] and error is not None and error.code == grpc.StatusCode.UNAVAILABLE
    pair.poll_p()
    pair.all_free()


def test_cancel_while_decoding_returns_the_blocks(pair: Pair) -> None:
    t = pair.reserve("a", max_tokens=8)
    pair.prefill("a", t, max_tokens=8)
    stream = pair.decode("a", t, 20, max_tokens=8)  # 1. Decode before any KV
    pair.step_prefill()
    pair.poll_d()  # 2. the KV lands: admitted, the engine request owns the blocks
    pair.poll_p()
    pair.d.on_outputs(pair.d_engine.step(), time.monotonic(), time.monotonic())
    assert pair.d.abort("a", None, CANCELLED)  # 3. aborted mid-decode
    _, error = pair.chunks(stream)
    assert error is not None and error.code == grpc.StatusCode.CANCELLED
    pair.all_free()


def test_a_failed_result_past_the_lifetime_reads_as_expiry(pair: Pair) -> None:
    t = pair.reserve("a", life_s=0.05)
    lapses = time.monotonic() + 0.05
    pair.prefill("a", t)
    pair.step_prefill()
    pair.p_tr.cancel(t.transfer_id)  # 1. the transfer fails, unseen yet
    while time.monotonic() <= lapses:  # 2. the reservation's lifetime passes (the state
        time.sleep(0.005)  # tested: it is a time), with no expire() call in between
    assert pair.poll_d() == [False]  # 3. the result is what notices: freed once
    assert pair.decode_refused("a", t).code == grpc.StatusCode.DEADLINE_EXCEEDED
    pair.d.expire(time.monotonic())  # 4. nothing left to expire
    pair.poll_p()
    pair.all_free()


def test_a_retried_reservation_is_not_touched_by_its_predecessor_result(pair: Pair) -> None:
    old = pair.reserve("a")
    pair.prefill("a", old)
    pair.step_prefill()
    assert pair.d.abort("a", None, CANCELLED)  # 1. cancelled in flight
    new = pair.reserve("a")  # 2. the router retries with the same id at once
    assert new.transfer_id != old.transfer_id
    assert pair.poll_d() == [False]  # 3. the old transfer's result: frees only its blocks
    assert pair.d.request_ids() == ["a"]
    assert pair.d_handoff.receive_state("a") is Receive.RECEIVING
    pair.poll_p()
    assert pair.d.abort("a", None, CANCELLED)
    pair.poll_d()
    pair.all_free()


def test_duplicate_reserve_and_duplicate_decode_are_refused(pair: Pair) -> None:
    t = pair.reserve("a")
    assert pair.reserve_refused("a").code == grpc.StatusCode.ALREADY_EXISTS  # 1.
    stream = pair.decode("a", t, 20)  # 2. Decode waits for the transfer
    assert pair.decode_refused("a", t).code == grpc.StatusCode.ALREADY_EXISTS  # 3.
    assert pair.d.abort("a", None, CANCELLED)  # 4. answers the waiting Decode too
    _, error = pair.chunks(stream)
    assert error is not None and error.code == grpc.StatusCode.CANCELLED
    pair.poll_d()
    pair.all_free()


def test_reserve_resource_exhausted_takes_nothing(pair: Pair) -> None:
    pair.reserve("big", max_tokens=60)  # 1. 18 of the 32 blocks
    free = pair.d_engine.block_pool.num_free
    error = pair.reserve_refused("more", max_tokens=60)  # 2. 18 more do not fit
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert pair.d_engine.block_pool.num_free == free and pair.d.request_ids() == ["big"]
    pair.d_engine.check_integrity()
    assert pair.d.abort("big", None, CANCELLED)  # 3. its transfer never started
    assert pair.poll_d() == [False]
    assert "big" not in pair.d_engine.scheduler.remote
    pair.reserve("more", max_tokens=60)  # 4. now it fits
    assert pair.d.abort("more", None, CANCELLED)
    pair.poll_d()
    pair.all_free()


def test_a_refused_expect_frees_the_reservation(pair: Pair) -> None:
    pair.d_tr.close()  # 1. `expect` raises: the reservation is released at once
    assert pair.reserve_refused("a").code == grpc.StatusCode.INTERNAL
    assert not pair.d_engine.scheduler.remote
    pair.all_free()


def test_a_first_token_that_ends_the_request_on_decode(pair: Pair) -> None:
    t = pair.reserve("a", max_tokens=1)
    pair.prefill("a", t, max_tokens=1)
    pair.step_prefill()
    pair.poll_d()
    pair.poll_p()
    stream = pair.decode("a", t, 20, max_tokens=1)  # 1. admitted and finished at once
    tokens, error = pair.chunks(stream)
    assert tokens == [] and error is None
    assert not pair.d.abort("a", None, CANCELLED)  # 2. nothing left to abort
    pair.all_free()


# ---- a Reserve waits for the blocks of doomed work (issue 39) -------------------------------
# PROMPT (10 tokens) + max_tokens 4 takes 4 blocks of 4 tokens: 8 reservations fill the pool.


def _reserve_sink(pair: Pair, rid: str, life_s: float = 30.0) -> UnarySink:
    """A Reserve whose answer may come later (`sink.closed` says whether it came)."""
    sink = UnarySink(pair.loop)
    req = pb.ReserveRequest(request_id=rid, num_prompt_tokens=len(PROMPT), max_tokens=4)
    pair.d.reserve(req, sink, life_s)
    return sink


def _release(pair: Pair, rids: list[str]) -> None:
    """Abort `rids` on D; their cancelled transfers' results free the blocks."""
    for rid in rids:
        assert pair.d.abort(rid, None, CANCELLED), rid
    pair.poll_d()


def test_a_reserve_waits_while_expiring_reservations_hold_its_blocks(pair: Pair) -> None:
    """A deadline storm's reservations (0.5 s lives) hold every block: a normal Reserve waits
    instead of failing, and takes its blocks once they expire."""
    doomed = [f"storm{i}" for i in range(8)]
    for rid in doomed:
        pair.reserve(rid, life_s=0.5)
    assert pair.d_engine.block_pool.num_free == 0
    sink = _reserve_sink(pair, "normal")  # 1. no free block: it waits, not refused
    assert not sink.closed
    pair.d.expire(time.monotonic() + 1.0)  # 2. the storm's reservations expire...
    assert not sink.closed  # ...their transfers' results (cancelled) are still to come
    pair.poll_d()  # 3. the results free their blocks: the Reserve takes them
    answer = pair.answer(sink)
    assert isinstance(answer, pb.ReserveResponse), answer
    assert pair.d.holds("normal") and not any(pair.d.holds(r) for r in doomed)
    _release(pair, ["normal"])
    pair.all_free()


def test_a_reserve_waits_for_blocks_an_abandoned_transfer_still_holds(pair: Pair) -> None:
    """Aborted while its KV was in flight, a reservation's blocks are freed only at the
    transfer's result: a Reserve waits for that result."""
    t = pair.reserve("aborted")
    live = [f"live{i}" for i in range(7)]
    for rid in live:
        pair.reserve(rid)
    prefill = pair.prefill("aborted", t)
    pair.step_prefill()  # the layers are on their way; the receiver has not polled
    assert pair.d.abort("aborted", None, CANCELLED)  # its blocks: abandoned until the result
    assert pair.d_engine.scheduler.abandoned and pair.d_engine.block_pool.num_free == 0
    sink = _reserve_sink(pair, "normal")
    assert not sink.closed
    pair.poll_d()  # the transfer's result frees the abandoned blocks: the Reserve takes them
    assert isinstance(pair.answer(sink), pb.ReserveResponse)
    pair.poll_p()
    assert isinstance(pair.answer(prefill), (pb.PrefillResponse, WorkerError))
    _release(pair, [*live, "normal"])
    pair.all_free()


def test_a_pool_full_of_live_work_still_refuses_at_once(pair: Pair) -> None:
    live = [f"live{i}" for i in range(8)]
    for rid in live:
        pair.reserve(rid)
    assert pair.reserve_refused("more").code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # a reservation that ends after the Reserve's own deadline is not worth waiting for
    _release(pair, live[:1])
    pair.reserve("late", life_s=20.0)
    with pytest.raises(WorkerError) as refused:
        _reserve_sink(pair, "short", life_s=2.0)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    _release(pair, [*live[1:], "late"])
    pair.all_free()


def test_a_reserve_that_can_never_fit_is_refused_and_a_cancelled_one_ends(pair: Pair) -> None:
    """When the doomed blocks could never be enough, the Reserve is refused at once, not at its
    deadline;
    and a waiting Reserve the router cancels ends at once, holding nothing."""
    live = [f"live{i}" for i in range(7)]
    for rid in live:
        pair.reserve(rid)
    pair.reserve("storm", life_s=0.5)
    # 8 blocks: the storm's 4 are not enough: refused at once
    assert pair.reserve_refused("big", max_tokens=20).code == grpc.StatusCode.RESOURCE_EXHAUSTED
    waiting = _reserve_sink(pair, "normal")
    assert not waiting.closed
    assert pair.d.abort("normal", waiting, CANCELLED)  # the router gave up on it
    assert pair.failed(waiting) == grpc.StatusCode.CANCELLED and not pair.d.holds("normal")
    pair.d.expire(time.monotonic() + 1.0)
    pair.poll_d()
    _release(pair, live)
    pair.all_free()
