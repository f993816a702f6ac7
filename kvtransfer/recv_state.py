"""The receiving side's shared state: one object per pair and per expected transfer. Used in
decode workers by the engine thread (`kvtransfer.torch_dist`) and the receiving threads
(`kvtransfer.dist_recv`); which thread may touch which field is noted beside it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from torch._C._distributed_c10d import TCPStore

from kvtransfer import rendezvous as rdv
from kvtransfer.shm import PeerCache
from kvtransfer.types import Code, TransferTicket


@dataclass
class RecvPair:
    """The decode side of one (sender, generation) pair; `ready` is set once built or failed."""

    sender: str
    gen: int
    ready: threading.Event = field(default_factory=threading.Event)
    group: rdv.PairGroup | None = None
    error: str | None = None
    store: TCPStore | None = None  # the connection the group was built on, kept with it
    peer_cache: PeerCache | None = None  # shared-memory pair: the sender's cache, mapped


@dataclass
class RecvTransfer:
    """One expected transfer, shared by the engine thread and (once announced) its thread."""

    ticket: TransferTicket
    started: float
    deadline: float
    sender: str | None = None  # set under the receiver's lock when a header is accepted
    pair: RecvPair | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards the three below
    finished: bool = False  # set by the engine when it decides the result (or cancels)
    layers_written: int = 0
    # Receives posted straight into the blocks may still write (`kvtransfer.recv_stream`):
    # the result is reported only once this is False again.
    receiving: bool = False
    cancelled: bool = False  # engine thread only; the result goes out at the next poll
    nbytes: int = 0
    src_ids: list[int] | None = None  # shared-memory pair: the sender's blocks (from the header)
    final_code: Code = Code.RECEIVER_FAILED
    decided: threading.Event = field(default_factory=threading.Event)

    @property
    def io_started(self) -> bool:
        return self.sender is not None
