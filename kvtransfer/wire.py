"""What the torch.distributed transport's helper threads hand to the engine thread, and the
small control messages they exchange with the peer. Runs in prefill and decode workers.

Per transfer, on the pair's process group and the transfer's own tag::

    decode (rank 0)                         prefill (rank 1)
      <- control queue: xfer record -------   (TCPStore, not the group)
      <- layer 0  [n, 2, bs, H, D] --------   one message per layer, sent as each layer's
      <- ...                                  forward finishes; no round trip before the
      <- layer L-1 ------------------------   first one (a refused transfer is drained)
      <- trailer code [int64 x4] ----------   OK, or SENDER_CANCELLED: the last layers were
                                              filler (posted with the last layer: in-band,
                                              no store round trip before completing)
      -- ack code [int64 x4] -------------->  OK, or why not (`kvtransfer.types.Code`)

On a shared-memory pair (`kvtransfer.shm`) the xfer record also lists the source blocks and
each layer message is an int64 x4 notification (the layer index): the receiver copies the
layer out of the sender's cache itself, and the sender keeps its blocks until the ack.

Each side issues its operations in exactly this order, so the same sequence is valid for NCCL
(which matches point-to-point messages by order, not by tag) — but for one receive: on gloo the
sender posts the ack's receive before it waits for its sends. gloo moves a message only once
its receive is posted (the receive sends a "ready" note the other way; a send posted first
announces itself and waits for it), so posted early the ack goes out the moment the receiver
has it. For the same reason the receiver posts every layer's receive as the header arrives,
and the sender's layers go out after its pair check, by which time they mostly have been.

**A transfer ends alone.** Many transfers share one pair's connection, and a gloo wait that
times out closes that connection (and fails every operation on it, on both sides). So no wait is
ever bounded by a transfer's own deadline: a transfer that its engine gives up (deadline,
cancel) still runs its exchange to the end on the wire — the sender fills the missing layers and
sends the SENDER_CANCELLED trailer, the receiver takes them into the buffers it posted and
acknowledges — while its result goes out by the clock. Waits are bounded by `exchange_bound`:
the sender's deadline plus `PEER_SLACK_S`. A peer that has not finished the exchange by then is
frozen or gone, and only then is the pair's connection torn down (`tear_down`), which every
other transfer on it then shares: that is a peer failure, not one request's.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
from torch._C._distributed_c10d import Work

from kvtransfer.rendezvous import PairGroup
from kvtransfer.types import Code

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 0.5  # how long close() waits for helper threads still finishing, per side
# How long past the sender's deadline a live peer may take to finish a transfer's exchange
# (fillers, trailer, acknowledgement: no model work, only posting and moving bytes); a peer
# slower than that counts as failed and the pair's connection is torn down.
PEER_SLACK_S = 2.0
_TEAR_DOWN_TAG = 2**31 - 1  # never a transfer's tag (those count up from 1 per pair)
EventKind = Literal["recv_done", "recv_failed", "send_done"]


@dataclass(frozen=True)
class Event:
    """One thing a helper thread learned, delivered to the engine thread through a queue.

    ``recv_done``: every layer was written into the destination blocks (`nbytes` in all).
    ``recv_failed``: the receiving thread gave up (`error`).
    ``send_done``: the sending thread got its acknowledgement (`error` None) or failed.
    A helper thread that finds the pair's connection broken drops the pair itself (any thread
    may): the event only reports the transfer.
    """

    kind: EventKind
    transfer_id: str
    epoch: int
    nbytes: int = 0
    error: str | None = None


class EventQueue:
    """Helper threads -> engine thread. ``put`` also calls the engine's waker (if set), so an
    engine waiting for work wakes as soon as ``poll()`` has something to report."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.waker: Callable[[], None] | None = None

    def put(self, event: Event) -> None:
        self._queue.put(event)
        waker = self.waker
        if waker is not None:
            waker()

    def get_nowait(self) -> Event:
        """The oldest event; `queue.Empty` when there is none."""
        return self._queue.get_nowait()


def control_tensor(code: Code | int, device: torch.device) -> torch.Tensor:
    """A 4 x int64 control message (only element 0, the code, is used today), to send.

    One shared tensor per (code, device), made once: sends only read it, so never write
    into it (`empty_control` gives a buffer to receive into)."""
    return _control(int(code), device)


@functools.cache
def _control(code: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([code, 0, 0, 0], dtype=torch.int64, device=device)


def empty_control(device: torch.device) -> torch.Tensor:
    return torch.zeros(4, dtype=torch.int64, device=device)


def read_code(message: torch.Tensor) -> Code | None:
    """The code in a received control message, or None when it is not a known code."""
    value = int(message.tolist()[0])
    try:
        return Code(value)
    except ValueError:
        return None


def remaining(deadline: float) -> float:
    """Seconds left until a `time.monotonic()` deadline (never below 1 ms)."""
    return max(deadline - time.monotonic(), 0.001)


def td(seconds: float) -> timedelta:
    return timedelta(seconds=max(seconds, 0.001))


def wait_until(work: Work, bound: float) -> None:
    """Wait for `work` until `bound` at the latest (a `time.monotonic()` deadline, and at
    least 1 ms); raises `RuntimeError` as `Work.wait` does when it fails or times out."""
    work.wait(timedelta(seconds=max(bound - time.monotonic(), 0.001)))


def exchange_bound(sender_deadline: float) -> float:
    """Until when a transfer's helper thread waits for the peer's part of the exchange (see
    the module docstring): the sender's deadline plus `PEER_SLACK_S`. A wait that runs out then
    closes the pair's connection: the peer is frozen or gone."""
    return sender_deadline + PEER_SLACK_S


def tear_down(group: PairGroup, peer_rank: int, device: torch.device) -> None:
    """Close a pair's connection now: every operation posted on it, on both sides, fails at
    once (their waits raise), and nothing more lands in any buffer posted on it. For a pair
    whose peer failed, and on close, so helper threads blocked in waits on it return.

    gloo has no call that does this (`abort` leaves posted operations waiting), but a wait that
    times out closes the connection, so this waits 1 ms for a receive nobody sends. NCCL
    groups are left to their own timeout.
    """
    if device.type == "cuda":
        return
    try:
        group.recv([empty_control(device)], peer_rank, _TEAR_DOWN_TAG).wait(td(0.001))
    except RuntimeError:
        return  # timed out (the connection is closed now), or it was closed already


class HelperThreads:
    """Runs the transport's helper jobs on reused daemon threads, and lets ``close()`` wait for
    the jobs in progress (boundedly), so a worker that closes its transport and exits does not
    tear down gloo or store objects under a job still finishing its last acknowledgement.

    A job goes to an idle thread when there is one, else to a new thread: starting a thread
    costs ~0.1-0.3 ms on a busy host, on the critical path of every transfer. Threads idle for
    `IDLE_S` exit; ``join`` also tells idle ones to exit. A job's exception is logged, and
    its thread goes on serving.
    """

    IDLE_S = 30.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._jobs: queue.SimpleQueue[tuple[str, Callable[..., None], tuple[object, ...]] | None]
        self._jobs = queue.SimpleQueue()
        self._idle = 0  # threads waiting for a job that no `start` has claimed
        self._pending = 0  # jobs started and not yet finished

    def start(self, name: str, target: Callable[..., None], *args: object) -> None:
        with self._lock:
            self._pending += 1
            self._jobs.put((name, target, args))
            if self._idle > 0:
                self._idle -= 1  # that thread takes the job
                return
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._lock:
                    try:
                        job = self._jobs.get_nowait()  # claimed for this thread just now
                    except queue.Empty:
                        self._idle -= 1
                        return
            if job is None:  # join() sends idle threads home
                return
            name, target, args = job
            threading.current_thread().name = name
            try:
                target(*args)
            except Exception:
                log.exception("kvtransfer: helper job %s failed", name)
            finally:
                # An idle thread must not keep the job's objects (groups, stores) alive.
                job = target = args = None  # type: ignore[assignment]
                with self._lock:
                    self._pending -= 1
                    self._idle += 1
                    self._changed.notify_all()

    def join(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the jobs in progress; True when none is left. Idle
        threads are told to exit."""
        end = time.monotonic() + timeout_s
        with self._lock:
            while self._pending > 0 and time.monotonic() < end:
                self._changed.wait(end - time.monotonic())
            done = self._pending == 0
            for _ in range(self._idle):
                self._jobs.put(None)
            self._idle = 0
        return done
