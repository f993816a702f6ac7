"""The receiving side's shared state: one object per pair and per expected transfer, and the
expected transfer's lifecycle as an explicit state machine. Used in decode workers by the engine
thread (`kvtransfer.torch_dist`) and the receiving threads (`kvtransfer.dist_recv`); which
thread may touch which field is noted beside it.

A `RecvTransfer` moves only through `RecvTransfer.move`, along the edges of `RECV_MOVES`
(anything else raises `kvtransfer.transitions.IllegalTransition`). Its state is two things at
once — has the engine decided the result, and may receives posted straight into the
destination blocks still land there (`kvtransfer.recv_stream`, "direct") — so the states form
a grid. (E) = the engine thread, (H) = a helper thread (the transfer's thread, or the control
thread when it posts the receives itself); every move is made under
`RecvTransfer.lock`::

                  nothing lands in the blocks           receives into the blocks may land

    undecided   +-- OPEN ---- claimed the blocks (H) ----> RECEIVING ------------+
                |    |  ^                                   |     |              |
                |    |  '---------- settled (H) ------------'     |              |
                |    | cancel (E)                      cancel (E) |              |
                |    v                                            v              |
    cancelled   |   CANCELLED <------- settled (H) ----- CANCELLED_LANDING       |
                |    |                                            |              |
     finish (E) |    | finish (E)                      finish (E) |   finish (E) |
                v    v                                            v              |
    decided     DECIDED <------------- settled (H) --------------- LANDING <-----+

"Settled": every receive posted into the blocks was waited for (it completed — a live sender
completes its stream even after a deadline or cancel, with fillers — or a wait failed or ran
past the exchange bound, which closes the pair's connection), or posting them failed.
"Cancel": the engine cancelled; nothing more is written, and the result goes out at its next
poll. "Finish": the engine decided the result (`kvtransfer.dist_recv.Receiver.finish`); it
reports it at once from DECIDED, and from LANDING only once the transfer settles. The
transfer thread writes a layer (staged or notified) only while undecided, under the lock, so
nothing is written after a decision. DECIDED is final.

Kept as data, not states: `sender` (who claimed the transfer: set by the control thread under
the receiver's lock when a header or a cancel record is accepted, and reported in the result),
`src_ids` (which data plane: shared memory or bytes), `final_code` with `decided` (the verdict
and the event the transfer thread waits on for it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import Final

from torch._C._distributed_c10d import TCPStore

from kvtransfer import rendezvous as rdv
from kvtransfer.same_host import PeerKV
from kvtransfer.transitions import Edge, Mover, check_move
from kvtransfer.types import Code, TransferTicket


class RecvState(Enum):
    """Where an expected transfer is (see the module docstring's grid)."""

    OPEN = "open"  # undecided; no receive posted into the blocks
    RECEIVING = "receiving"  # undecided; receives posted straight into the blocks may land
    CANCELLED = "cancelled"  # the engine cancelled; nothing can land; result at the next poll
    CANCELLED_LANDING = "cancelled, landing"  # cancelled; receives into the blocks may land
    DECIDED = "decided"  # the engine decided; nothing can land: the result is out (final)
    LANDING = "landing"  # decided; receives into the blocks may land: the result waits

    __hash__ = object.__hash__  # by identity, as `kvtransfer.send_state.SendState`


_R = RecvState

# The legal moves: (from, to) -> who makes it, on what. All under `RecvTransfer.lock`.
RECV_MOVES: Final[dict[tuple[RecvState, RecvState], Edge]] = {
    (_R.OPEN, _R.RECEIVING): Edge("helper", "posts the receives straight into the blocks"),
    (_R.RECEIVING, _R.OPEN): Edge("helper", "settled before the engine decided"),
    (_R.OPEN, _R.CANCELLED): Edge("engine", "cancel"),
    (_R.RECEIVING, _R.CANCELLED_LANDING): Edge("engine", "cancel"),
    (_R.CANCELLED_LANDING, _R.CANCELLED): Edge("helper", "settled"),
    (_R.OPEN, _R.DECIDED): Edge("engine", "decided the result (done, failed, deadline, close)"),
    (_R.RECEIVING, _R.LANDING): Edge("engine", "decided the result"),
    (_R.CANCELLED, _R.DECIDED): Edge("engine", "the poll after the cancel"),
    (_R.CANCELLED_LANDING, _R.LANDING): Edge("engine", "the poll after the cancel"),
    (_R.LANDING, _R.DECIDED): Edge("helper", "settled: the result goes out"),
}

_UNDECIDED: Final = frozenset({_R.OPEN, _R.RECEIVING})
_CANCELLED: Final = frozenset({_R.CANCELLED, _R.CANCELLED_LANDING})
# From each state whose receives may land, the state once they settled.
_SETTLED: Final = {
    _R.RECEIVING: _R.OPEN,
    _R.CANCELLED_LANDING: _R.CANCELLED,
    _R.LANDING: _R.DECIDED,
}
# From each state the engine may decide in, the state it decides to.
_DECIDED: Final = {
    _R.OPEN: _R.DECIDED,
    _R.RECEIVING: _R.LANDING,
    _R.CANCELLED: _R.DECIDED,
    _R.CANCELLED_LANDING: _R.LANDING,
}


@dataclass
class RecvPair:
    """The decode side of one (sender, generation) pair; `ready` is set once built or failed."""

    sender: str
    gen: int
    ready: threading.Event = field(default_factory=threading.Event)
    group: rdv.PairGroup | None = None
    error: str | None = None
    store: TCPStore | None = None  # the connection the group was built on, kept with it
    peer_cache: PeerKV | None = None  # notified pair: the sender's cache, mapped


@dataclass
class RecvTransfer:
    """One expected transfer, shared by the engine thread and (once announced) its thread."""

    ticket: TransferTicket
    started: float
    deadline: float
    sender: str | None = None  # set under the receiver's lock when a header is accepted
    pair: RecvPair | None = None
    # With the header: until when the transfer's thread waits for the sender's part of the
    # exchange (`kvtransfer.wire.exchange_bound` of the sender's deadline, which the header
    # carries); past it the sender counts as frozen. Never earlier than the exchange bound of
    # this side's own deadline.
    exchange_until: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards the three below
    state: RecvState = RecvState.OPEN
    path: list[RecvState] = field(default_factory=lambda: [RecvState.OPEN])  # states so far
    layers_written: int = 0  # direct receives: counted once the trailer is in
    nbytes: int = 0
    src_ids: list[int] | None = None  # shared-memory pair: the sender's blocks (from the header)
    final_code: Code = Code.RECEIVER_FAILED
    decided: threading.Event = field(default_factory=threading.Event)

    @property
    def io_started(self) -> bool:
        return self.sender is not None

    @property
    def undecided(self) -> bool:
        """The engine has neither decided nor cancelled: the thread may write layers."""
        return self.state in _UNDECIDED

    @property
    def cancelled(self) -> bool:
        """Cancelled by the engine, whose next poll reports it (engine thread, no lock)."""
        return self.state in _CANCELLED

    def move(self, to: RecvState, by: Mover) -> None:
        """Move to `to` along an edge of `RECV_MOVES` that `by` may take, else raise
        `IllegalTransition` (naming both states and the transfer). The caller holds `lock`."""
        assert self.lock.locked(), f"recv transfer {self.ticket.transfer_id}: moved unlocked"
        check_move("recv", self.ticket.transfer_id, self.path, to, by, RECV_MOVES)
        self.state = to
        self.path.append(to)

    def cancel(self) -> None:
        """Engine thread, under `lock`: cancelled (a second cancel before the poll is a no-op)."""
        if self.state not in _CANCELLED:
            self.move(
                _R.CANCELLED_LANDING if self.state is _R.RECEIVING else _R.CANCELLED, "engine"
            )

    def decide(self) -> bool:
        """Engine thread, under `lock`: the result is decided. True when receives posted into
        the blocks may still land (the result then waits until they settle)."""
        self.move(_DECIDED.get(self.state, _R.DECIDED), "engine")
        return self.state is _R.LANDING

    def settle(self) -> None:
        """Helper thread, under `lock`: no receive posted into the blocks can land now."""
        self.move(_SETTLED.get(self.state, _R.OPEN), "helper")
