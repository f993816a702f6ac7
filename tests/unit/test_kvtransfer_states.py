"""The per-transfer state machines of the torch.distributed transport: every legal move of
`SEND_MOVES` / `RECV_MOVES` is taken (from a state reached by legal moves only), every other
move is refused with an `IllegalTransition` naming both states and the transfer, and the small
helpers that pick a move (`RecvTransfer.cancel/decide/settle`, `SendTransfer.source_released`)
agree with the tables. Pure: no threads, no network."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping
from enum import Enum
from typing import TypeVar

import pytest

import kvtransfer.recv_state as recv_state_module
import kvtransfer.send_state as send_state_module
from kvtransfer.recv_state import RECV_MOVES, RecvState, RecvTransfer
from kvtransfer.send_state import SEND_MOVES, SendState, SendTransfer
from kvtransfer.transitions import Edge, IllegalTransition, Mover
from kvtransfer.types import PeerEndpoint, TransferTicket, new_ticket
from model_runtime.kv_cache import KVLayout

S = TypeVar("S", bound=Enum)
LAYOUT = KVLayout("m", "float32", 4, 3, 2, 8, "float32")
MOVERS: tuple[Mover, ...] = ("engine", "helper")


def ticket(tid: str = "d0/t1") -> TransferTicket:
    return new_ticket(
        PeerEndpoint("d0", "127.0.0.1", 9), LAYOUT, "r", [0, 1], 5, 1.0, transfer_id=tid
    )


def mover(edge: Edge) -> Mover:
    return "engine" if edge.by == "engine" else "helper"


def route(moves: Mapping[tuple[S, S], Edge], start: S, goal: S) -> list[tuple[S, Mover]]:
    """The shortest list of legal (state, mover) moves from `start` to `goal` (BFS)."""
    prev: dict[S, tuple[S, Mover]] = {}
    todo, seen = deque([start]), {start}
    while todo:
        here = todo.popleft()
        for (a, b), edge in moves.items():
            if a is here and b not in seen:
                seen.add(b)
                prev[b] = (a, mover(edge))
                todo.append(b)
    assert goal in seen, f"{goal} cannot be reached from {start}"
    steps: list[tuple[S, Mover]] = []
    while goal is not start:
        a, by = prev[goal]
        steps.append((goal, by))
        goal = a
    return steps[::-1]


def send_at(state: SendState) -> SendTransfer:
    tr = SendTransfer(ticket(), (4, 5), 0.0, 1.0)
    for to, by in route(SEND_MOVES, SendState.JOINING, state):
        tr.move(to, by)
    assert tr.state is state and tr.path[-1] is state
    return tr


def recv_at(state: RecvState) -> RecvTransfer:
    tr = RecvTransfer(ticket(), 0.0, 1.0)
    with tr.lock:
        for to, by in route(RECV_MOVES, RecvState.OPEN, state):
            tr.move(to, by)
    assert tr.state is state and tr.path[-1] is state
    return tr


# ---- the send table -------------------------------------------------------------------------


@pytest.mark.parametrize(("frm", "to"), list(SEND_MOVES), ids=lambda s: s.name)
def test_every_legal_send_move_is_taken(frm: SendState, to: SendState):
    tr = send_at(frm)
    tr.move(to, mover(SEND_MOVES[frm, to]))
    assert tr.state is to and tr.path[-2:] == [frm, to]
    if SEND_MOVES[frm, to].by == "either":  # e.g. a post raised on either thread
        send_at(frm).move(to, "engine")


def test_every_other_send_move_is_refused_naming_both_states():
    for frm, to, by in itertools.product(SendState, SendState, MOVERS):
        edge = SEND_MOVES.get((frm, to))
        if edge is not None and edge.by in (by, "either"):
            continue
        tr = send_at(frm)
        before = list(tr.path)
        with pytest.raises(IllegalTransition) as info:
            tr.move(to, by)
        msg = str(info.value)
        assert f"{frm.name} -> {to.name}" in msg and "d0/t1" in msg and by in msg, msg
        assert (info.value.from_state, info.value.to_state) == (frm, to)
        assert info.value.transfer_id == "d0/t1" and info.value.side == "send"
        assert tr.state is frm and tr.path == before  # a refused move changes nothing


def test_send_table_has_no_dead_end_and_done_is_final():
    for state in SendState:
        assert route(SEND_MOVES, SendState.JOINING, state) is not None  # reachable
        if state is not SendState.DONE:
            assert (state, SendState.DONE) in SEND_MOVES, f"{state}: the thread cannot exit"
    assert not [b for a, b in SEND_MOVES if a is SendState.DONE]
    # The engine thread only gives up, or fails a post while streaming.
    engine = {k for k, e in SEND_MOVES.items() if e.by in ("engine", "either")}
    assert engine == {
        (SendState.JOINING, SendState.GIVEN_UP),
        (SendState.STREAMING, SendState.GIVEN_UP),
        (SendState.STREAMING, SendState.POST_FAILED),
    }


def test_a_refused_move_says_it_belongs_to_the_other_thread():
    tr = send_at(SendState.STREAMING)
    with pytest.raises(IllegalTransition, match=r"a move for the helper thread"):
        tr.move(SendState.SENT, "engine")


def test_send_helpers_follow_the_state():
    released = {SendState.DONE}
    for state, shm in itertools.product(SendState, (False, True)):
        tr = send_at(state)
        tr.shm = shm
        # A shared-memory receiver reads the source blocks until it acknowledges.
        want = state in released or (state is SendState.SENT and not shm)
        assert tr.source_released() is want, (state, shm)
        assert tr.takes_layers() is (state in (SendState.JOINING, SendState.STREAMING))
        tr.cancelled = True
        assert not tr.takes_layers()


# ---- the receive table ----------------------------------------------------------------------


@pytest.mark.parametrize(("frm", "to"), list(RECV_MOVES), ids=lambda s: s.name)
def test_every_legal_recv_move_is_taken(frm: RecvState, to: RecvState):
    tr = recv_at(frm)
    with tr.lock:
        tr.move(to, mover(RECV_MOVES[frm, to]))
    assert tr.state is to and tr.path[-2:] == [frm, to]


def test_every_other_recv_move_is_refused_naming_both_states():
    for frm, to, by in itertools.product(RecvState, RecvState, MOVERS):
        edge = RECV_MOVES.get((frm, to))
        if edge is not None and edge.by in (by, "either"):
            continue
        tr = recv_at(frm)
        with tr.lock, pytest.raises(IllegalTransition) as info:
            tr.move(to, by)
        msg = str(info.value)
        assert f"{frm.name} -> {to.name}" in msg and "d0/t1" in msg, msg
        assert info.value.side == "recv" and tr.state is frm


def test_recv_table_is_the_grid_and_decided_is_final():
    """Undecided / cancelled / decided x nothing lands / receives may land: the engine moves
    down the grid, the helper thread across it."""
    for state in RecvState:
        assert route(RECV_MOVES, RecvState.OPEN, state) is not None
        if state is not RecvState.DECIDED:
            assert route(RECV_MOVES, state, RecvState.DECIDED) is not None
    assert not [b for a, b in RECV_MOVES if a is RecvState.DECIDED]
    helper = {k for k, e in RECV_MOVES.items() if e.by == "helper"}
    assert helper == {
        (RecvState.OPEN, RecvState.RECEIVING),
        (RecvState.RECEIVING, RecvState.OPEN),
        (RecvState.CANCELLED_LANDING, RecvState.CANCELLED),
        (RecvState.LANDING, RecvState.DECIDED),
    }


_R = RecvState
# state -> the state after the engine's cancel / the engine's decision / the helper's settling
# (None: refused, the transfer is past that point).
AFTER_CANCEL = {
    _R.OPEN: _R.CANCELLED,
    _R.RECEIVING: _R.CANCELLED_LANDING,
    _R.CANCELLED: _R.CANCELLED,  # a second cancel before the poll
    _R.CANCELLED_LANDING: _R.CANCELLED_LANDING,
    _R.DECIDED: None,
    _R.LANDING: None,
}
AFTER_DECIDE = {
    _R.OPEN: _R.DECIDED,
    _R.RECEIVING: _R.LANDING,
    _R.CANCELLED: _R.DECIDED,
    _R.CANCELLED_LANDING: _R.LANDING,
    _R.DECIDED: None,
    _R.LANDING: None,
}
AFTER_SETTLE = {
    _R.OPEN: None,
    _R.RECEIVING: _R.OPEN,
    _R.CANCELLED: None,
    _R.CANCELLED_LANDING: _R.CANCELLED,
    _R.DECIDED: None,
    _R.LANDING: _R.DECIDED,
}


@pytest.mark.parametrize("state", list(RecvState), ids=lambda s: s.name)
@pytest.mark.parametrize(
    ("op", "after"),
    [("cancel", AFTER_CANCEL), ("decide", AFTER_DECIDE), ("settle", AFTER_SETTLE)],
    ids=["cancel", "decide", "settle"],
)
def test_recv_helpers_pick_the_table_move(
    state: RecvState, op: str, after: dict[RecvState, RecvState | None]
):
    tr = recv_at(state)
    with tr.lock:
        if after[state] is None:
            with pytest.raises(IllegalTransition, match=state.name):
                getattr(tr, op)()
            assert tr.state is state
            return
        got = getattr(tr, op)()
    assert tr.state is after[state]
    if op == "decide":  # True: the result waits until the receives settle
        assert got is (tr.state is _R.LANDING)


@pytest.mark.parametrize("state", list(RecvState), ids=lambda s: s.name)
def test_recv_predicates(state: RecvState):
    tr = recv_at(state)
    assert tr.undecided is (state in (_R.OPEN, _R.RECEIVING))
    assert tr.cancelled is (state in (_R.CANCELLED, _R.CANCELLED_LANDING))


def test_a_recv_move_needs_the_transfer_lock():
    tr = RecvTransfer(ticket(), 0.0, 1.0)
    with pytest.raises(AssertionError, match="unlocked"):
        tr.move(RecvState.RECEIVING, "helper")
    assert tr.state is RecvState.OPEN


@pytest.mark.parametrize("module", [send_state_module, recv_state_module], ids=["send", "recv"])
def test_the_diagrams_name_every_state(module: object):
    doc = module.__doc__ or ""
    states = SendState if module is send_state_module else RecvState
    assert all(s.name in doc for s in states), [s.name for s in states if s.name not in doc]
