"""The sending side's shared state: one object per pair and per open transfer, and the open
transfer's lifecycle as an explicit state machine. Used in prefill workers by the engine thread
(`kvtransfer.torch_dist`, through `kvtransfer.dist_send.Sender`) and the transfer's thread
(`kvtransfer.dist_send`).

A `SendTransfer` moves only through `SendTransfer.move`, along the edges of `SEND_MOVES`
(anything else raises `kvtransfer.transitions.IllegalTransition`). (E) = the engine thread,
(H) = the transfer's helper thread; every move is made under `SendTransfer.cond`::

               announced (H)             every send and the trailer completed (H)
    JOINING ---------------> STREAMING --------------------------------------------> SENT
       |                      |     |                                                ^  |
       |                      |     | cancelled or deadline,                         |  | ack (H)
       |                      |     | a layer missing (H)       fillers and trailer  |  v
       |                      |     '-------------------> FILLING -------------------+  DONE
       | gave up (E)          | gave up (E)                 ^     completed (H)      |
       |                      v                             |                        |
       '-------------------> GIVEN_UP -- a layer not -------'                        |
                                |        handed over (H)                             |
                                '----------------------------------------------------'
                                  every layer had been handed over; sends completed (H)

    --> POST_FAILED (a post raised): from STREAMING (E or H), GIVEN_UP (H), FILLING (H).
    --> DONE (the thread exits: acknowledged, failed, cancelled before announcing, the
        deadline): from every state. DONE is final.

Who posts the stream's sends in each state: JOINING, the engine queues each handed-over layer
in `pending` (the thread posts them when it announces); STREAMING, the engine posts each layer
(and the OK trailer after the last); FILLING, the thread posts fillers and the SENDER_CANCELLED
trailer; every other state, nobody (a layer handed over then is dropped). "Gave up" (close, the
deadline, a failed result) only stops the engine's posts: the thread sends what was handed
over, then fills the rest, so the pair's other transfers go on (`kvtransfer.wire`: a transfer
ends alone); past the deadline before announcing it pushes a cancel record instead, and on
close it stops (the pairs are torn down). The source blocks may be read by a send until DONE;
on a pair that carries the bytes (not shared memory) they are free from SENT on
(`SendTransfer.source_released`).

Kept as data, not states: `cancelled` (the engine's cancel is a request that may come in any
state, which each answers in its own way: joining, the thread pushes a cancel record; streaming
or given up, it fills once a layer is missing; posted in full, it sends on and the result says
"cancelled by sender" — as states, it would double all but FILLING), `shm` (which data plane
the pair uses), `run_start` (zero-copy or copied), `post_error` (why a post raised).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import Final

import torch
from torch._C._distributed_c10d import TCPStore, Work

from kvtransfer import rendezvous as rdv
from kvtransfer.transitions import Edge, Mover, check_move
from kvtransfer.types import PeerEndpoint, TransferTicket


class SendState(Enum):
    """Where an open transfer's stream is (see the module docstring's diagram)."""

    JOINING = "joining"  # the thread joins / announces; the engine queues layers in `pending`
    STREAMING = "streaming"  # announced: the engine posts each layer as it is handed over
    GIVEN_UP = "given up"  # the engine posts no more; the thread sends what it has
    FILLING = "filling"  # cancelled after announcing: the thread posts fillers + trailer
    POST_FAILED = "post failed"  # posting a send raised (`post_error`): nobody posts
    SENT = "sent"  # every send and the trailer completed: buffers reusable; awaiting the ack
    DONE = "done"  # the thread is past its sends: none can read the source blocks (final)

    # Members are singletons compared by identity: hash them by identity too (a C slot; Enum's
    # own hash runs Python code, and every move and check looks states up in tables).
    __hash__ = object.__hash__


_S = SendState

# The legal moves: (from, to) -> who makes it, on what. All under `SendTransfer.cond`.
SEND_MOVES: Final[dict[tuple[SendState, SendState], Edge]] = {
    (_S.JOINING, _S.STREAMING): Edge("helper", "pushed the xfer record; the pair checked out"),
    (_S.JOINING, _S.GIVEN_UP): Edge("engine", "gave up (close, deadline, a failed result)"),
    (_S.JOINING, _S.DONE): Edge("helper", "failed or cancelled before announcing"),
    (_S.STREAMING, _S.GIVEN_UP): Edge("engine", "gave up"),
    (_S.STREAMING, _S.FILLING): Edge("helper", "cancelled or past the deadline; a layer missing"),
    (_S.STREAMING, _S.POST_FAILED): Edge("either", "posting a send raised"),
    (_S.STREAMING, _S.SENT): Edge("helper", "every send and the OK trailer completed"),
    (_S.STREAMING, _S.DONE): Edge("helper", "a wait failed or the deadline passed"),
    (_S.GIVEN_UP, _S.FILLING): Edge("helper", "a layer was not handed over"),
    (_S.GIVEN_UP, _S.POST_FAILED): Edge("helper", "posting a queued layer raised"),
    (_S.GIVEN_UP, _S.SENT): Edge("helper", "every layer had been handed over; sends completed"),
    (_S.GIVEN_UP, _S.DONE): Edge("helper", "the transport closed, or a wait failed"),
    (_S.FILLING, _S.POST_FAILED): Edge("helper", "posting a filler raised"),
    (_S.FILLING, _S.SENT): Edge("helper", "the fillers and the SENDER_CANCELLED trailer completed"),
    (_S.FILLING, _S.DONE): Edge("helper", "a wait failed"),
    (_S.POST_FAILED, _S.DONE): Edge("helper", "raised the post's error"),
    (_S.SENT, _S.DONE): Edge("helper", "acknowledged (OK or not), or the ack did not come"),
}

# The states in which the engine still hands layers over (queued, or posted at once).
_TAKES_LAYERS: Final = frozenset({_S.JOINING, _S.STREAMING})


@dataclass
class SendPair:
    """The prefill side of the pair with one receiver; replaced (never revived) once broken."""

    endpoint: PeerEndpoint
    lock: threading.Lock = field(default_factory=threading.Lock)  # connect + tag counter
    serial: threading.Lock = field(default_factory=threading.Lock)  # NCCL: one at a time
    store: TCPStore | None = None  # client of the receiver's store, once connected
    group: rdv.PairGroup | None = None
    gen: int = 0
    broken: bool = False
    next_tag: int = 0
    shm: bool = False  # the receiver reads this worker's cache in place (`kvtransfer.shm`)

    def connected(self) -> tuple[TCPStore, rdv.PairGroup]:
        assert self.store is not None and self.group is not None, "pair used before connecting"
        return self.store, self.group

    def take_tag(self) -> int:
        with self.lock:
            self.next_tag += 1
            return self.next_tag


@dataclass
class SendTransfer:
    """One open transfer, shared by the engine thread and its transfer thread.

    `cond` (a `threading.Condition` over an `RLock`) guards `state` and the fields both threads
    write: pending, works, keep, pooled, group, tag, shm, post_error, cancelled. The engine
    thread alone uses next_layer and nbytes; the transfer thread alone sets pair.
    """

    ticket: TransferTicket
    src: tuple[int, ...]
    started: float
    deadline: float
    cond: threading.Condition = field(default_factory=threading.Condition)
    state: SendState = SendState.JOINING
    path: list[SendState] = field(default_factory=lambda: [SendState.JOINING])  # states so far
    pending: list[int] = field(default_factory=list)  # layers handed over while JOINING
    works: list[Work] = field(default_factory=list)  # posted sends, in layer order
    keep: list[torch.Tensor] = field(default_factory=list)  # their buffers, kept alive
    pooled: list[torch.Tensor] = field(default_factory=list)  # copies' buffers, from the pool
    group: rdv.PairGroup | None = None  # set when announcing
    tag: int = 0  # set when announcing
    shm: bool = False  # announced on a shared-memory pair: the receiver reads the cache
    post_error: str | None = None  # why a post raised (state POST_FAILED)
    cancelled: bool = False  # the engine cancelled (see the module docstring)
    pair: SendPair | None = None
    run_start: int | None = None  # source blocks are one run from here: sent zero-copy
    views: tuple[torch.Tensor, ...] = ()  # zero-copy: each layer's view, made at the first post
    next_layer: int = 0  # engine thread only
    nbytes: int = 0  # engine thread only

    def move(self, to: SendState, by: Mover) -> None:
        """Move to `to` along an edge of `SEND_MOVES` that `by` may take, else raise
        `IllegalTransition` (naming both states and the transfer). Takes `cond` (re-entrant:
        callers may hold it)."""
        with self.cond:
            check_move("send", self.ticket.transfer_id, self.path, to, by, SEND_MOVES)
            self.state = to
            self.path.append(to)

    def takes_layers(self) -> bool:
        """The engine still hands layers over (read without the lock by the engine thread:
        `kvtransfer.dist_send.Sender.post_layer` checks again under it)."""
        return self.state in _TAKES_LAYERS and not self.cancelled

    def source_released(self) -> bool:
        """No send of this transfer can read its source blocks any more: the thread is past its
        sends, or they completed on a pair that carries the bytes (the receiver of a
        shared-memory pair reads the blocks until it acknowledges)."""
        state = self.state
        return state is SendState.DONE or (state is SendState.SENT and not self.shm)
