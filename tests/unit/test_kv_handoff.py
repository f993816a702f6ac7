"""`worker.kv_handoff.KVHandoff`, the one place a worker pairs its KV transport with its
scheduler, on the real `Scheduler` over the simulator's transport (`SimTransport`: a transfer
ends when the test lands or cancels it), with fabricated tokens.

Scripted lifecycles with numbered steps: each hand-off step is whole (a refused `expect` or
`open` leaves nothing held), `abandon` works wherever a request stands, outcomes come by
request id for live hand-offs only, and a retry under the same request id is untouched by its
abandoned predecessor's result. Every script ends with every block free again (`check_integrity`
counts the abandoned transfers' blocks too).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvtransfer.types import TransferTicket
from model_runtime.scheduler import Receive, Scheduler
from proto.pdserve.v1 import worker_pb2
from tests.unit.test_scheduler import assert_all_free, make, req
from tests.unit.test_scheduler_receiving import prefilled
from tooling.planner.sim_transport import SimTransport, sim_layout
from worker.kv_handoff import KVHandoff, Outcome, TransferRefused

Ticket = worker_pb2.TransferTicket


class Engine:
    """The two things the hand-off owner needs of an engine (`HandoffEngine`)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def abort_request(self, request_id: str) -> object:
        return self.scheduler.abort(request_id)


class Refusing(SimTransport):
    """A transport whose `expect` and `open` raise, as a closed one's do."""

    def expect(self, ticket: TransferTicket) -> None:
        raise ValueError("transport closed")

    def open(self, ticket: TransferTicket, src_block_ids: Sequence[int]) -> None:
        raise ValueError("transport closed")


def side(name: str, transport: type[SimTransport] = SimTransport) -> KVHandoff:
    s = make()
    return KVHandoff(Engine(s), transport(name, sim_layout(s.config.block_size)), epoch=7)


def sched(h: KVHandoff) -> Scheduler:
    return h.engine.scheduler


def reserved(
    p_transport: type[SimTransport] = SimTransport,
) -> tuple[KVHandoff, KVHandoff, Ticket]:
    """A decode side with request "r" reserved (6 prompt tokens, 4 to generate), a prefill
    side, and the ticket."""
    d, p = side("d"), side("p", p_transport)
    ticket = d.reserve("r", 6, 4, 30.0)
    assert ticket is not None
    return d, p, ticket


def release(d: KVHandoff) -> None:
    """The decode side gives "r" up, its transfer's result comes: every block is free."""
    d.abandon("r")
    d.poll()
    assert_all_free(sched(d))


def send_step(p: KVHandoff, rid: str, ticket: worker_pb2.TransferTicket) -> None:
    """Queue `rid` on P and run its only step, opening its send as `PrefillRole` does."""
    s = sched(p)
    s.add(req(rid, ticket.num_tokens, max_tokens=1))
    out = s.schedule()
    (item,) = out.items
    p.open_send(rid, ticket, item.block_table)
    p.layer_sender([rid])(0)
    (final,) = s.update(out, [50])
    assert final.finished


def land(h: KVHandoff, ticket: worker_pb2.TransferTicket) -> list[tuple[str, Outcome]]:
    assert isinstance(h.transport, SimTransport)
    h.transport.land(ticket.transfer_id)
    outcomes, results = h.poll()
    assert len(results) == 1
    return [(o.request_id, o.outcome) for o in outcomes]


def test_one_request_through_both_sides() -> None:
    p, d = side("p"), side("d")
    ticket = d.reserve("r", 6, 4, 30.0)  # 1. D: blocks + a ticket the transport expects
    assert ticket is not None and d.receive_state("r") is Receive.RECEIVING
    assert ticket.transfer_id == "d/7/r/0" and ticket.request_id == "r"
    p.check_ticket("r", 6, ticket)
    send_step(p, "r", ticket)  # 2. P: the send opens in the sampling step, holds the blocks
    assert p.sending("r") and p.in_flight()
    assert land(d, ticket) == [("r", Outcome.RECEIVED)]  # 3. the KV landed on D
    assert land(p, ticket) == [("r", Outcome.SENT)]  # 4. P's blocks are freed
    assert_all_free(sched(p))
    assert d.admit(prefilled("r"), first_token=50) is None  # 5. D admits the request
    assert d.receive_state("r") is None and "r" in sched(d).requests
    d.abandon("r")  # 6. aborted while decoding: the engine frees its blocks
    assert_all_free(sched(d))


def test_a_refused_expect_holds_nothing() -> None:
    d = side("d", Refusing)
    with pytest.raises(TransferRefused, match="expect failed"):
        d.reserve("r", 6, 4, 30.0)
    assert d.receive_state("r") is None
    assert_all_free(sched(d))


def test_a_request_that_could_never_fit_is_a_value_error() -> None:
    d = side("d")
    with pytest.raises(ValueError, match="needs 33 KV blocks, the cache has 16"):
        d.reserve("r", 100, 32, 30.0)
    assert_all_free(sched(d))


def test_a_refused_open_holds_nothing_past_the_step() -> None:
    d, p, ticket = reserved(Refusing)
    s = sched(p)
    s.add(req("r", 6, max_tokens=1))
    out = s.schedule()
    with pytest.raises(TransferRefused, match="could not open"):
        p.open_send("r", ticket, out.items[0].block_table)
    assert not p.sending("r")
    s.update(out, [50])  # the step ends the request: nothing reads its blocks, freed
    assert_all_free(s)
    release(d)


def test_check_ticket_names_what_is_wrong() -> None:
    d, p, ticket = reserved()
    with pytest.raises(ValueError, match="num_tokens 6 != prompt length 5"):
        p.check_ticket("r", 5, ticket)
    with pytest.raises(ValueError, match="ticket is for request 'r', not 'x'"):
        p.check_ticket("x", 6, ticket)
    other = worker_pb2.TransferTicket()
    other.CopyFrom(ticket)
    other.layout.block_size = 8
    with pytest.raises(TransferRefused, match="block_size") as info:
        p.check_ticket("r", 6, other)
    assert info.value.layout
    release(d)


@pytest.mark.parametrize("received", [False, True])
def test_abandon_a_reservation(received: bool) -> None:
    d = side("d")
    ticket = d.reserve("r", 6, 4, 30.0)
    assert ticket is not None
    if received:  # 1. the KV landed: RECEIVED blocks are freed at once
        assert land(d, ticket) == [("r", Outcome.RECEIVED)]
        d.abandon("r")
        assert_all_free(sched(d))
        return
    d.abandon("r")  # 1. RECEIVING: cancelled, held until the result
    assert d.num_abandoned() == 1 and d.in_flight() and d.receive_state("r") is None
    again = d.reserve("r", 6, 4, 30.0)  # 2. the id is free at once: a retry reserves anew
    assert again is not None and again.transfer_id != ticket.transfer_id
    outcomes, results = d.poll()  # 3. the cancel's result frees only the first blocks
    assert outcomes == [] and [r.ok for r in results] == [False]
    assert d.receive_state("r") is Receive.RECEIVING
    assert land(d, again) == [("r", Outcome.RECEIVED)]  # 4. the retry is untouched
    d.abandon("r")
    assert_all_free(sched(d))


@pytest.mark.parametrize("stage", ["queued", "running", "sent"])
def test_abandon_a_prefill(stage: str) -> None:
    d, p, ticket = reserved()
    s = sched(p)
    if stage == "queued":
        s.add(req("r", 6, max_tokens=1))
    elif stage == "running":  # its send is open, its step not over
        s.add(req("r", 6, max_tokens=1))
        out = s.schedule()
        p.open_send("r", ticket, out.items[0].block_table)
    else:
        send_step(p, "r", ticket)
    p.abandon("r")  # 1. given up: the id is free at once
    assert "r" not in s.requests and not p.sending("r")
    if stage == "running":
        assert s.update(out, [50]) == []  # the step's result skips the aborted request
    outcomes, _ = p.poll()  # 2. the cancel's result frees what the transfer held
    assert outcomes == [] and p.num_abandoned() == 0 and not p.in_flight()
    assert_all_free(s)
    release(d)


def test_a_failed_transfer_comes_out_by_request_id() -> None:
    d, p, ticket = reserved()
    send_step(p, "r", ticket)
    assert isinstance(p.transport, SimTransport) and isinstance(d.transport, SimTransport)
    p.transport.cancel(ticket.transfer_id)  # the sender's transfer fails
    d.transport.cancel(ticket.transfer_id)  # and so does the receiver's
    (sent,), _ = p.poll()
    (got,), _ = d.poll()
    assert (sent.request_id, sent.outcome) == ("r", Outcome.SEND_FAILED)
    assert sent.result.error == "cancelled" and sent.result.transfer_id == ticket.transfer_id
    assert (got.request_id, got.outcome) == ("r", Outcome.RECEIVE_FAILED)
    assert_all_free(sched(p))
    assert_all_free(sched(d))
