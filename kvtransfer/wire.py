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
(which matches point-to-point messages by order, not by tag).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch

from kvtransfer.types import Code

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 0.5  # how long close() waits for helper threads still finishing, per side
EventKind = Literal["recv_done", "recv_failed", "send_done"]


@dataclass(frozen=True)
class Event:
    """One thing a helper thread learned, delivered to the engine thread through a queue.

    ``recv_done``: every layer was written into the destination blocks (`nbytes` in all).
    ``recv_failed``: the receiving thread gave up (`error`).
    ``send_done``: the sending thread got its acknowledgement (`error` None) or failed.
    `pair_broken` says the pair's connection is unusable and must be re-created.
    """

    kind: EventKind
    transfer_id: str
    epoch: int
    nbytes: int = 0
    error: str | None = None
    pair_broken: bool = False


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
    """A 4 x int64 control message (only element 0, the code, is used today)."""
    return torch.tensor([int(code), 0, 0, 0], dtype=torch.int64, device=device)


def empty_control(device: torch.device) -> torch.Tensor:
    return torch.zeros(4, dtype=torch.int64, device=device)


def read_code(message: torch.Tensor) -> Code | None:
    """The code in a received control message, or None when it is not a known code."""
    value = int(message[0].item())
    try:
        return Code(value)
    except ValueError:
        return None


def remaining(deadline: float) -> float:
    """Seconds left until a `time.monotonic()` deadline (never below 1 ms)."""
    return max(deadline - time.monotonic(), 0.001)


def td(seconds: float) -> timedelta:
    return timedelta(seconds=max(seconds, 0.001))


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
