"""Receiving half of the torch.distributed KV transport (decode side). Runs in decode workers.

Threads (the per-pair and per-transfer ones are jobs on reused helper threads,
`kvtransfer.wire.HelperThreads`):

- the **control thread** serves the control queue of this worker's `TCPStore`: ``join``
  records (layout check, then a builder thread makes the pair's process group) and ``xfer``
  headers, checked against the live tickets (`header_verdict`);
- one **transfer thread** per announced transfer. Accepted: it posts a receive per layer
  (`kvtransfer.recv_stream`: straight into the destination blocks when they are consecutive,
  else into staging buffers it then writes into the blocks; direct receives land by
  themselves, so it sleeps once, until the trailer), then acknowledges: OK as soon as every
  layer is in (before the deadline, not cancelled) — posted before the event that wakes the
  engine thread, and without waiting for that thread, which may be in the middle of a step —
  else the engine's verdict once it has one.
  Rejected (unknown ticket, stale epoch, ...): it drains the stream and acknowledges with the
  reject code.

A transfer's deadline or cancel ends only that transfer (`kvtransfer.wire`, "a transfer ends
alone"): its thread writes nothing more but still takes the rest of the stream (the sender fills
it) into the receives it posted, and acknowledges. Waits on the wire are bounded by the
transfer's exchange bound (the sender's deadline, from the header, plus a slack), never by its
own deadline, because a gloo wait that times out closes the pair's connection for every
transfer on it. A wait that fails or runs past that bound means the peer broke or froze: the
thread drops the pair and tears its connection down, and the sender re-joins on next use.

Writing from a helper thread is the one exception to "the engine thread owns the cache", and it
is safe by the ownership rules: destination blocks are reserved for this transfer and nobody
else touches them until its result is out. `RecvTransfer.lock` makes the cut-off exact: a
staged layer is written under the lock only while the transfer is undecided, and the engine
decides (or cancels) under the same lock; a direct transfer's result waits until none of its
receives can land (state LANDING until they settle: `kvtransfer.recv_state`). So once
``poll()`` has reported a result (success, failure, deadline or cancel) nothing writes into
those blocks, and the caller may free or reuse them at once.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import Work

from kvtransfer import rendezvous as rdv
from kvtransfer.recv_state import RecvPair, RecvTransfer
from kvtransfer.recv_stream import (
    ACK_TIMEOUT_S,
    Posted,
    drain_and_answer,
    post_receives,
    settle,
)
from kvtransfer.same_host import PeerKV, control_device, map_offer, pair_backend
from kvtransfer.shm import ShmUnavailable
from kvtransfer.staging import StagingPool, write_layer
from kvtransfer.types import (
    Code,
    LayoutMismatchError,
    blocks_needed,
    check_layout,
    header_verdict,
)
from kvtransfer.wire import (
    CLOSE_WAIT_S,
    Event,
    EventQueue,
    HelperThreads,
    control_tensor,
    exchange_bound,
    read_code,
    remaining,
    td,
    tear_down,
)
from model_runtime.kv_cache import KVCache
from security.kvseal import RecordSeal

log = logging.getLogger(__name__)


class _StreamBroken(Exception):
    """The stream carried something no live sender sends (an unknown trailer code): the pair
    is out of step and is dropped."""


_IDLE_WAIT_S = 3600.0  # the control thread's blocking pop; close() wakes it with a stop record


class Receiver:
    """Serves this worker's rendezvous store and runs the receiving threads."""

    def __init__(
        self,
        worker_id: str,
        cache: KVCache,
        host: str,
        port: int,
        connect_timeout_s: float,
        events: EventQueue,
        staging: StagingPool,
        shared_memory: bool = False,
        node: str = "",
        seal: RecordSeal | None = None,
    ) -> None:
        self._worker_id = worker_id
        self._node = node
        self._seal = seal  # with it, only records signed with the cluster secret count
        self.refusals = rdv.Refusals(worker_id)
        self._shared_memory = shared_memory
        self._cache = cache
        self._layout = cache.layout
        self._device = cache.device
        self._host = host
        self._backend = rdv.backend_for(cache.device)
        self._connect_timeout_s = connect_timeout_s
        self._events = events
        self._server = rdv.serve_store(host, port, connect_timeout_s)
        self.port: int = self._server.port
        # Store clients serialise their operations, so the control thread's long blocking pop
        # gets a connection of its own (whose timeout is the pop's); the server object's own
        # connection (`_quick`) carries the short operations of the other threads.
        self._ctl = rdv.connect_store(host, self.port, _IDLE_WAIT_S)
        self._quick = self._server
        self._lock = threading.Lock()
        self._pairs: dict[str, RecvPair] = {}
        self._live: dict[str, RecvTransfer] = {}
        self._stopped = False
        self._helpers = HelperThreads()
        self._staging = staging
        self._thread = threading.Thread(
            target=self._control_loop, name=f"kvx-ctl-{worker_id}", daemon=True
        )
        self._thread.start()

    # ---- engine thread ----------------------------------------------------------------------

    def add(self, tr: RecvTransfer) -> None:
        with self._lock:
            self._live[tr.ticket.transfer_id] = tr

    def finish(self, tr: RecvTransfer, code: Code) -> bool:
        """Record the engine's verdict; no write by this worker into the blocks follows. The
        transfer thread acknowledges it to the sender, unless it already acknowledged a
        complete transfer. True when receives posted straight into the blocks may still land
        (state LANDING): the result waits until they settle."""
        with self._lock:
            if self._live.get(tr.ticket.transfer_id) is tr:
                del self._live[tr.ticket.transfer_id]
        with tr.lock:  # waits for a write in progress (a memcpy), never for the network
            landing = tr.decide()
        tr.final_code = code
        tr.decided.set()
        return landing

    def drop_pair(self, pair: RecvPair) -> None:
        """Forget a broken pair and close its connection (any thread): the transfers still on
        it fail at once; its sender re-joins with a new generation on next use."""
        if pair.group is not None:
            tear_down(pair.group, 1, self._device)
        with self._lock:
            if self._pairs.get(pair.sender) is not pair:
                return
            del self._pairs[pair.sender]
        log.warning("kvtransfer: dropping pair %s gen %d", pair.sender, pair.gen)
        try:
            self._quick.set(rdv.cur_key(pair.sender), "0")
        except RuntimeError as exc:  # our own store; only fails while shutting down
            log.warning("kvtransfer: could not mark pair %s dropped: %s", pair.sender, exc)

    def close(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        with self._lock:
            pairs = list(self._pairs.values())
            self._pairs.clear()
            self._live.clear()
        try:
            self._quick.queue_push(rdv.CTL_QUEUE, rdv.stop_record(self._seal))
        except RuntimeError as exc:
            log.warning("kvtransfer: could not stop the control thread: %s", exc)
        for pair in pairs:  # threads blocked on the wire return now
            if pair.group is not None:
                tear_down(pair.group, 1, self._device)
        self._thread.join(timeout=CLOSE_WAIT_S)
        self._helpers.join(timeout_s=CLOSE_WAIT_S)

    # ---- control thread ---------------------------------------------------------------------

    def _control_loop(self) -> None:
        while True:
            try:  # one round trip per record (a wait then a pop took two: a longer tail)
                raw = self._ctl.queue_pop(rdv.CTL_QUEUE, True)
            except dist.DistStoreError:  # idle for an hour: just wait again
                continue
            except RuntimeError as exc:
                log.warning("kvtransfer: control queue of %s closed: %s", self._worker_id, exc)
                return
            try:
                rec = rdv.decode(raw, self._seal)
                if rec["kind"] == "stop":
                    return
                if rec["kind"] == "join":
                    self._on_join(rec)
                elif rec["kind"] == "xfer":
                    self._on_header(rec)
                elif rec["kind"] == "cancel":
                    self._on_cancel(rec)
                else:
                    log.warning("kvtransfer: unknown control record kind %r", rec["kind"])
            except rdv.RecordRejected as exc:
                self.refusals.note(exc, self._ctl)
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("kvtransfer: bad control record %r: %s", raw[:200], exc)

    def _on_join(self, rec: dict[str, Any]) -> None:
        sender, gen = str(rec["sender"]), int(rec["gen"])
        if gen < int(self._ctl.add(rdv.gen_key(sender), 0)):  # an old join, replayed
            self._answer(sender, gen, f"reject:generation {gen} is not the newest")
            return
        try:
            check_layout(
                self._layout,
                rdv.join_layout(rec),
                f"decode {self._worker_id}",
                f"prefill {sender}",
            )
        except LayoutMismatchError as exc:
            self._answer(sender, gen, f"reject:{exc}")
            return
        pair = RecvPair(sender, gen, peer_cache=self._map_peer_cache(sender, rec.get("shm")))
        with self._lock:
            old = self._pairs.get(sender)
            if old is not None and old.gen >= gen:
                self._answer(sender, gen, f"reject:generation {gen} is older than {old.gen}")
                return
            self._pairs[sender] = pair
        self._ctl.set(rdv.cur_key(sender), str(gen))
        self._answer(sender, gen, rdv.JOIN_OK_SHM if pair.peer_cache is not None else rdv.JOIN_OK)
        self._helpers.start(f"kvx-join-{sender}-{gen}", self._build_pair, pair)

    def _answer(self, sender: str, gen: int, verdict: str) -> None:
        """Store the verdict on a join (signed with the cluster secret's seal, if any)."""
        self._ctl.set(rdv.join_key(sender, gen), rdv.verdict_text(verdict, sender, gen, self._seal))

    def _map_peer_cache(self, sender: str, shm: Any) -> PeerKV | None:
        """The sender's cache mapped (memfd read-only, or CUDA IPC; `kvtransfer.same_host`),
        when both sides want the same-host plane and the offer checks out; else None (the
        pair's layers come as bytes over gloo or NCCL)."""
        if shm is None or not self._shared_memory:
            return None
        try:
            return map_offer(shm, self._cache, self._node)
        except ShmUnavailable as exc:
            log.info("kvtransfer: no same-host plane with %s, bytes go over %s: %s",
                     sender, self._backend, exc)  # fmt: skip
            return None

    def _build_pair(self, pair: RecvPair) -> None:
        try:
            pair.store = rdv.connect_store(self._host, self.port, self._connect_timeout_s)
            pair.group = rdv.make_pair_group(
                pair.store,
                pair.sender,
                pair.gen,
                0,
                pair_backend(self._device, pair.peer_cache is not None),
                self._host,
                self._connect_timeout_s,
                self._seal,
            )
        except RuntimeError as exc:
            pair.error = f"building the group with {pair.sender} (gen {pair.gen}) failed: {exc}"
            log.warning("kvtransfer: %s", pair.error)
        pair.ready.set()

    def _on_cancel(self, rec: dict[str, Any]) -> None:
        tid, epoch = str(rec["transfer_id"]), int(rec["epoch"])
        with self._lock:
            tr = self._live.get(tid)
            if tr is None or tr.ticket.epoch != epoch or tr.io_started:
                return  # gone already, or announced: the stream itself carries the cancel
            tr.sender = str(rec["sender"])  # claimed: no later header for it is accepted
        self._events.put(Event("recv_failed", tid, epoch, error="cancelled by sender"))

    def _on_header(self, rec: dict[str, Any]) -> None:
        sender, gen, tag = str(rec["sender"]), int(rec["gen"]), int(rec["tag"])
        tid, epoch = str(rec["transfer_id"]), int(rec["epoch"])
        with self._lock:
            pair = self._pairs.get(sender)
            if pair is None or pair.gen != gen:
                why = "kvtransfer: header for %s from %s on a dropped pair (gen %d); ignored"
                log.warning(why, tid, sender, gen)
                return
            tr = self._live.get(tid)
            code = header_verdict(
                tr.ticket if tr else None,
                tr is not None and tr.io_started,
                epoch,
                int(rec["num_tokens"]),
            )
            if code is Code.GO and tr is not None and pair.peer_cache is not None:
                tr.src_ids = pair.peer_cache.source_blocks(rec.get("src"), tr.ticket.num_blocks)
                if tr.src_ids is None:
                    log.warning("kvtransfer: header for %s has bad source blocks; ignored", tid)
                    return
            if code is Code.GO and tr is not None:
                tr.sender, tr.pair = sender, pair
                sender_deadline = time.monotonic() + float(rec["timeout_ms"]) / 1000
                tr.exchange_until = exchange_bound(max(sender_deadline, tr.deadline))
        name = f"kvx-recv-{tid}"
        if code is Code.GO and tr is not None:
            # Post the receives right here when the group is up (it is, but for a pair's
            # first transfer), so the data flows while the transfer thread starts.
            posted = None
            if pair.ready.is_set() and pair.group is not None:
                try:
                    posted = self._post_receives(pair.group, tr, tag)
                except RuntimeError as exc:
                    self.drop_pair(pair)
                    error = f"receive failed: {exc}"
                    self._events.put(Event("recv_failed", tid, epoch, error=error))
                    return
            self._helpers.start(name, self._run_transfer, tr, pair, tag, posted)
            return
        n_blocks = blocks_needed(int(rec["num_tokens"]), self._layout.block_size)
        if not 0 < n_blocks <= self._cache.num_blocks:
            log.warning("kvtransfer: header for %s claims %d blocks; ignored", tid, n_blocks)
            return
        bound = exchange_bound(time.monotonic() + float(rec["timeout_ms"]) / 1000)
        self._helpers.start(name, self._reject, pair, tag, code, tid, n_blocks, bound)

    # ---- transfer threads -------------------------------------------------------------------

    def _reject(
        self, pair: RecvPair, tag: int, code: Code, tid: str, n_blocks: int, bound: float
    ) -> None:
        """Drain the stream of a refused transfer, then acknowledge with the reject code
        (waiting until `bound`, the exchange bound); a failed wait breaks the pair."""
        log.info("kvtransfer: transfer %s from %s: %s", tid, pair.sender, code.describe())
        try:
            notified = pair.peer_cache is not None  # notifications, not a layer's bytes
            group = self._group(pair)
            drain_and_answer(group, tag, code, self._cache, n_blocks, notified, bound)
        except (RuntimeError, TimeoutError) as exc:
            log.warning("kvtransfer: could not reject %s to %s: %s", tid, pair.sender, exc)
            self.drop_pair(pair)

    def _post_receives(self, group: rdv.PairGroup, tr: RecvTransfer, tag: int) -> Posted:
        direct_ok = self._backend == "gloo"
        return post_receives(group, tr, tag, self._cache, self._staging, direct_ok)

    def _run_transfer(
        self,
        tr: RecvTransfer,
        pair: RecvPair,
        tag: int,
        posted: Posted | None,
    ) -> None:
        """Receive (and write) the layers in order, then acknowledge (see the module
        docstring). A direct transfer's receives are settled before any event goes out."""
        tid, epoch = tr.ticket.transfer_id, tr.ticket.epoch
        try:
            group = self._group(pair)
            posted = posted or self._post_receives(group, tr, tag)
        except (RuntimeError, TimeoutError) as exc:
            self.drop_pair(pair)
            self._events.put(Event("recv_failed", tid, epoch, error=f"receive failed: {exc}"))
            return
        broken = False
        try:
            event = self._receive_layers(tr, pair, posted)
        except _StreamBroken as exc:
            error, broken = f"receive failed: {exc}", True
            event = Event("recv_failed", tid, epoch, error=error)
        except RuntimeError as exc:  # a wait failed, or ran past the exchange bound
            error, broken = f"receive failed: {exc}", True
            event = Event("recv_failed", tid, epoch, error=error)
        if broken:
            self.drop_pair(pair)  # closes the connection: nothing more lands
        settle(tr, posted, tr.exchange_until)  # no direct receive can land after this
        if broken:
            self._events.put(event)
            return  # no acknowledgement gets through a broken pair
        with tr.lock:
            complete = tr.undecided and tr.layers_written == tr.ticket.layout.num_layers
        ack: Work | None = None
        if complete:
            # Every layer is in the blocks, before the deadline: that is what OK means, so the
            # sender hears it now — posted before the event wakes this worker's engine thread
            # (which would hold the interpreter while it polls), and without waiting for that
            # thread, which may be in the middle of a step. (Should the engine still cancel,
            # the request's fate is decided on this side.)
            ack = self._acknowledge(group, pair, tag, tid, Code.OK)
        self._events.put(event)
        if not complete:  # the engine decides (deadline, cancel); tell the sender why
            decided = tr.decided.wait(remaining(tr.deadline) + ACK_TIMEOUT_S)
            code = tr.final_code if decided else Code.RECEIVER_FAILED
            ack = self._acknowledge(group, pair, tag, tid, code)
        if ack is None:
            return
        try:
            ack.wait(td(ACK_TIMEOUT_S))
        except RuntimeError as exc:  # the sender broke or froze (the connection is closed)
            self._ack_failed(pair, tid, exc)

    def _acknowledge(
        self, group: rdv.PairGroup, pair: RecvPair, tag: int, tid: str, code: Code
    ) -> Work | None:
        """Post the acknowledgement `code`; None when posting failed (the pair is dropped)."""
        try:
            ctl = control_device(self._device, pair.peer_cache is not None)
            return group.send([control_tensor(code, ctl)], 1, tag)
        except RuntimeError as exc:
            self._ack_failed(pair, tid, exc)
            return None

    def _ack_failed(self, pair: RecvPair, tid: str, exc: RuntimeError) -> None:
        log.warning("kvtransfer: acknowledging %s to %s failed: %s", tid, pair.sender, exc)
        self.drop_pair(pair)

    def _receive_layers(self, tr: RecvTransfer, pair: RecvPair, posted: Posted) -> Event:
        """Take every layer and the trailer off the wire, putting each layer in the blocks
        while the transfer is live; the event to report: done, or failed when the trailer
        says the sender cancelled, the engine decided first, or a layer came after the
        deadline (the stream is taken in full all the same: the pair goes on). Raises
        `RuntimeError` when a wait fails or runs past the exchange bound, `_StreamBroken` on
        a trailer that is no known code."""
        tid, epoch, t = tr.ticket.transfer_id, tr.ticket.epoch, tr.ticket
        layers, dst = t.layout.num_layers, list(t.dst_block_ids[: t.num_blocks])
        shape = self._cache.message_shape(t.num_blocks)
        late: str | None = None  # why the layers stopped counting: past the deadline
        if posted.mode == "direct":  # the layers land by themselves: one wait, not one each
            posted.wait_trailer(tr.exchange_until)
        for i in range(layers):
            posted.wait_next(tr.exchange_until)
            if i == layers - 1:  # the trailer says whether the layers are real
                posted.wait_next(tr.exchange_until)
                code = read_code(posted.trailer)
                if code is not Code.OK:
                    posted.recycle(self._staging)
                    if code is not Code.SENDER_CANCELLED:
                        raise _StreamBroken(f"bad trailer {int(posted.trailer[0])}")
                    return Event("recv_failed", tid, epoch, error=code.describe())
            with tr.lock:
                if late is not None or not tr.undecided:  # write nothing more
                    continue
                if time.monotonic() >= tr.deadline:
                    # Never complete with bytes that arrived late: past the sender's own
                    # deadline (later than ours) it may have reused the blocks it sends from.
                    late = f"layer {i} was in only after the transfer's deadline"
                    continue
                if posted.mode == "notified":  # one copy, from the sender's cache
                    assert pair.peer_cache is not None and tr.src_ids is not None
                    pair.peer_cache.copy_layer(i, tr.src_ids, self._cache, dst)
                    if time.monotonic() >= tr.deadline:  # the sender may reuse them now
                        late = f"layer {i} was read past the deadline"
                        continue
                elif posted.mode == "staged":
                    write_layer(self._cache, i, dst, StagingPool.view(posted.bufs[i], shape))
                tr.layers_written += 1  # direct: the bytes are in the blocks already
        posted.recycle(self._staging)
        if late is not None:
            return Event("recv_failed", tid, epoch, error=late)
        nbytes = layers * math.prod(shape) * self._cache.kv.element_size()
        return Event("recv_done", tid, epoch, nbytes=nbytes)

    def _group(self, pair: RecvPair) -> rdv.PairGroup:
        """The pair's group, once built (bounded by the build's own connect timeouts)."""
        if not pair.ready.wait(2 * self._connect_timeout_s + CLOSE_WAIT_S):
            raise TimeoutError("the pair's process group was not built in time")
        if pair.group is None:
            raise RuntimeError(pair.error or "the pair's process group was not built")
        return pair.group
