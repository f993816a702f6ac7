"""Checked state moves for the torch.distributed transport's per-transfer state machines
(`kvtransfer.send_state`, `kvtransfer.recv_state`). Runs in prefill and decode workers.

Each side lists its legal moves in one table, ``{(from, to): Edge(by, on)}``: who may make the
move (the engine thread, a helper thread, or either) and on what. Its one ``move`` method
checks each move against the table here and raises `IllegalTransition` for any other — a move
the table lacks, or one the table gives to the other thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Literal, NamedTuple, TypeVar

State = TypeVar("State", bound=Enum)
Mover = Literal["engine", "helper"]  # the engine thread, or a transport helper thread


class Edge(NamedTuple):
    """One legal move: who makes it (`by`) and on what (`on`, for the reader and errors)."""

    by: Literal["engine", "helper", "either"]
    on: str


class IllegalTransition(AssertionError):
    """A transfer was asked to make a move its state table does not allow.

    A bug in `kvtransfer` (a broken invariant, hence an `AssertionError`), never a peer's or a
    caller's fault. The message names the side, the transfer id, both states, the mover, the
    path so far and the moves that were legal.
    """

    def __init__(self, side: str, transfer_id: str, from_state: Enum, to_state: Enum, msg: str):
        super().__init__(msg)
        self.side = side
        self.transfer_id = transfer_id
        self.from_state = from_state
        self.to_state = to_state


def check_move(
    side: str,
    transfer_id: str,
    path: Sequence[State],
    to: State,
    by: Mover,
    moves: Mapping[tuple[State, State], Edge],
) -> None:
    """Raise `IllegalTransition` unless ``(path[-1], to)`` is in `moves` for mover `by`."""
    frm = path[-1]
    edge = moves.get((frm, to))
    if edge is not None and edge.by in (by, "either"):
        return
    legal = [f"{b.name} ({e.by})" for (a, b), e in moves.items() if a is frm] or ["none: final"]
    why = "" if edge is None else f", a move for the {edge.by} thread ({edge.on})"
    raise IllegalTransition(
        side,
        transfer_id,
        frm,
        to,
        f"{side} transfer {transfer_id}: illegal move {frm.name} -> {to.name} by the {by} "
        f"thread{why} (path so far: {' -> '.join(s.name for s in path)}; legal from "
        f"{frm.name}: {', '.join(legal)})",
    )
