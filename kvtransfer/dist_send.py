"""Sending half of the torch.distributed KV transport (prefill side). Runs in prefill workers.

One **transfer thread** per open transfer (a job on a reused helper thread,
`kvtransfer.wire.HelperThreads`) does everything that may block: connect to the
receiver's store and join (first use of a pair, or after it broke), announce the transfer,
check the receiver still serves the pair's generation (else re-join once and announce again),
wait for each layer's send to complete, wait for the acknowledgement.

A transfer's own end (its deadline, a cancel, the engine giving up) ends only that transfer,
never the pair that other transfers share (`kvtransfer.wire`, "a transfer ends alone"): before
announcing, the thread tells the receiver with a cancel record; after, it fills the layers the
engine did not hand over and sends the SENDER_CANCELLED trailer, then takes the
acknowledgement. Its waits on the wire are bounded by `wire.exchange_bound` (the deadline plus
a slack), joining by the connect timeout. Only a wait that fails (the peer broke the
connection) or runs past that bound (the peer is frozen) breaks the pair: the thread tears it
down and drops it, and the next transfer re-joins. The engine's result for the transfer goes
out by the clock (`kvtransfer.torch_dist`) whatever the thread is waiting for.

The engine thread only hands over a finished layer: it posts it with a non-blocking ``send``
once the transfer is announced, else queues its index in `SendTransfer.pending`, which the
thread posts when it announces. On a shared-memory pair (`kvtransfer.shm`) a layer's message
is a notification and the receiver copies the blocks itself, straight from this worker's
cache, which it may read until the acknowledgement. Otherwise the message is the layer's
bytes: the cache itself when the source blocks are consecutive
(`KVCache.run_start` / `layer_slice`, a view: **zero-copy**), else a copy
(`kvtransfer.staging.read_layer`) into a buffer from the sender's `StagingPool` — reused memory:
a fresh multi-megabyte buffer faults in page by page, which costs more than the copy. Buffers go
back to the pool once every send of the transfer completed (dropped if one failed: gloo may
still read them). A send in flight may therefore read the source blocks until it completes:
`SendTransfer.source_released` says when no send it posted can read them any more, and the
transport holds a cancelled transfer's result (so its blocks) until then
(`kvtransfer.torch_dist`).

On a gloo pair the thread posts its receive for the acknowledgement before it waits for its
sends: gloo moves a message only once its receive is posted, so the receiver's ack then goes
out at once instead of announcing itself and waiting for the receive (NCCL, which matches each
side's operations in the order they are issued, receives it after the sends).

The transfer's lifecycle is the state machine of `kvtransfer.send_state` (JOINING, STREAMING,
GIVEN_UP, FILLING, POST_FAILED, SENT, DONE); `SendTransfer.cond` guards it and the fields the
two threads share. With NCCL (no message tags) a pair carries one transfer at a time
(`SendPair.serial`); gloo multiplexes concurrent transfers on one pair by tag.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import torch
from torch._C._distributed_c10d import Work

from kvtransfer import rendezvous as rdv
from kvtransfer.same_host import Offer, control_device, pair_backend
from kvtransfer.send_state import SendPair, SendState, SendTransfer
from kvtransfer.staging import StagingPool, read_layer
from kvtransfer.transitions import Mover
from kvtransfer.types import Code, PeerEndpoint, TransferError
from kvtransfer.wire import (
    CLOSE_WAIT_S,
    Event,
    EventQueue,
    HelperThreads,
    control_tensor,
    empty_control,
    exchange_bound,
    read_code,
    remaining,
    td,
    tear_down,
    wait_until,
)
from model_runtime.kv_cache import KVCache
from security.kvseal import RecordSeal

log = logging.getLogger(__name__)


class Sender:
    """Connects to receivers lazily and runs the sending threads."""

    def __init__(
        self,
        worker_id: str,
        cache: KVCache,
        host: str,
        connect_timeout_s: float,
        events: EventQueue,
        staging: StagingPool,
        segment: Offer | None = None,
        seal: RecordSeal | None = None,
    ) -> None:
        self._worker_id = worker_id
        self._seal = seal  # the cluster secret's seal on every record (None: open cluster)
        self._cache = cache
        self._segment = segment  # this worker's cache in shared memory, offered at join
        self._layout = cache.layout
        self._device = cache.device
        self._dtype = cache.dtype
        self._message_shape = cache.message_shape
        self.staging = staging
        self._host = host
        self._backend = rdv.backend_for(cache.device)
        self._serialize = self._backend == "nccl"
        self._connect_timeout_s = connect_timeout_s
        self._events = events
        self._lock = threading.Lock()
        self._pairs: dict[str, SendPair] = {}
        self._helpers = HelperThreads()
        self._closing = threading.Event()  # close(): threads stop instead of filling

    # ---- engine thread ----------------------------------------------------------------------

    def start(self, tr: SendTransfer) -> None:
        self._helpers.start(f"kvx-send-{tr.ticket.transfer_id}", self._run, tr)

    def post_layer(self, tr: SendTransfer, layer: int) -> None:
        """Layer `layer` of the transfer's source blocks is final: send it (or queue it)."""
        with tr.cond:
            if tr.state is SendState.STREAMING:
                self._post_layer(tr, layer, "engine")
            elif tr.state is SendState.JOINING:
                tr.pending.append(layer)
            else:  # given up, filling, failed, or the thread is done: nobody waits for it
                return
            tr.cond.notify_all()

    def _post_layer(self, tr: SendTransfer, layer: int, by: Mover) -> None:
        """Post layer `layer`, and after the last one the OK trailer (caller holds `tr.cond`)."""
        self._post(tr, self._message(tr, layer), by)
        if layer == tr.ticket.layout.num_layers - 1 and tr.state is not SendState.POST_FAILED:
            self._post(tr, control_tensor(Code.OK, self._ctl(tr.shm)), by)

    def _message(self, tr: SendTransfer, layer: int) -> torch.Tensor:
        """What goes over the group for one layer (caller holds `tr.cond`, after announcing)."""
        if tr.shm:
            if self._device.type == "cuda":
                # The receiver reads the layer from this device as soon as it is notified:
                # the layer's K/V (enqueued on this stream) must be written by then.
                torch.cuda.current_stream(self._device).synchronize()
            return control_tensor(layer, self._ctl(True))
        if tr.run_start is not None:  # zero-copy: a view of the cache
            if not tr.views:  # every layer's, made once
                tr.views = self._cache.layer_slices(tr.run_start, len(tr.src))
            return tr.views[layer]
        shape = self._cache.message_shape(len(tr.src))
        buf = self.staging.take(math.prod(shape), self._dtype, self._device)
        tr.pooled.append(buf)
        return read_layer(self._cache, layer, tr.src, StagingPool.view(buf, shape))

    def _ctl(self, notified: bool) -> torch.device:
        """Where this pair's control messages live (`kvtransfer.same_host.control_device`)."""
        return control_device(self._device, notified)

    def stop(self, tr: SendTransfer, cancelled: bool) -> None:
        """The engine gave up (deadline, close, a failed result) or cancelled; the thread winds
        down. Giving up stops the engine's posts (a no-op once they stopped anyway)."""
        with tr.cond:
            if cancelled:
                tr.cancelled = True
            elif tr.state in (SendState.JOINING, SendState.STREAMING):
                tr.move(SendState.GIVEN_UP, by="engine")
            tr.cond.notify_all()

    def plane(self, tr: SendTransfer) -> str:
        """The data plane `tr` was announced on: 'shm' (memfd) or 'cuda_ipc' on a notified
        pair, else the group's backend ('gloo', 'nccl'); '' if it was never announced."""
        with tr.cond:
            if tr.group is None:
                return ""
            if tr.shm:
                return "cuda_ipc" if self._device.type == "cuda" else "shm"
            return str(self._backend)

    def shm_receivers(self) -> list[str]:
        """Worker ids of the receivers this worker currently streams to over shared memory."""
        with self._lock:
            return sorted(p.endpoint.worker_id for p in self._pairs.values() if p.shm)

    def drop_pair(self, pair: SendPair) -> None:
        """Forget a broken pair and close its connection (any thread): the transfers still on
        it fail at once, and the next transfer to that receiver re-joins."""
        with self._lock:
            pair.broken = True
            if self._pairs.get(pair.endpoint.key()) is pair:
                del self._pairs[pair.endpoint.key()]
        if pair.group is not None:
            tear_down(pair.group, 0, self._device)

    def close(self, transfers: list[SendTransfer]) -> None:
        """Give up `transfers` (the open ones), close every pair's connection, so threads
        blocked on the wire return at once, and wait (boundedly) for the threads."""
        self._closing.set()
        for tr in transfers:
            self.stop(tr, cancelled=False)
        with self._lock:
            pairs = list(self._pairs.values())
            self._pairs.clear()
        for pair in pairs:
            pair.broken = True
            if pair.group is not None:
                tear_down(pair.group, 0, self._device)
        self._helpers.join(timeout_s=CLOSE_WAIT_S)

    # ---- transfer thread --------------------------------------------------------------------

    def _run(self, tr: SendTransfer) -> None:
        tid, epoch = tr.ticket.transfer_id, tr.ticket.epoch
        try:
            self._send(tr)
        except TransferError as exc:  # refused, or this transfer's own end: the pair is fine
            event = Event("send_done", tid, epoch, error=str(exc))
        except (RuntimeError, TimeoutError) as exc:  # the connection failed, or the peer froze
            event = Event("send_done", tid, epoch, error=f"send failed: {exc}")
            if tr.pair is not None:
                self.drop_pair(tr.pair)
        else:
            event = Event("send_done", tid, epoch)
        with tr.cond:
            completed = tr.state is SendState.SENT  # every send completed without error
            tr.move(SendState.DONE, by="helper")
        self._recycle(tr, completed)
        self._events.put(event)

    def _recycle(self, tr: SendTransfer, completed: bool) -> None:
        """Return the transfer's copy buffers to the pool when no send can read them now
        (`completed`: every send completed; after a failed one gloo may still read them)."""
        if completed and tr.pooled:
            self.staging.give(tr.pooled)
        tr.pooled = []

    def _send(self, tr: SendTransfer) -> None:
        """Connect if needed and run the exchange; re-join once if the receiver had dropped a
        pair this worker still used (it then ignores the header announced on it)."""
        for attempt in range(2):
            # A transfer past its deadline, or given up before a re-join, does not join.
            if time.monotonic() >= tr.deadline:
                raise TransferError("the deadline passed before the pair was ready")
            if attempt and (tr.cancelled or tr.state is SendState.GIVEN_UP):
                raise TransferError("cancelled by sender" if tr.cancelled else "given up")
            pair = self._pair_for(tr.ticket.receiver)
            fresh = self._connect(pair, tr.deadline)
            tr.pair = pair
            # NCCL has no message tags: one transfer at a time (a notified pair is gloo).
            serial = self._serialize and not pair.shm
            if serial and not pair.serial.acquire(timeout=remaining(tr.deadline)):
                raise TransferError("another transfer held the pair until the deadline")
            try:
                if self._exchange(tr, pair, verify=not fresh, serial=serial):
                    return
            finally:
                if serial:
                    pair.serial.release()
            log.info(
                "kvtransfer: %s dropped our pair (gen %d); re-joining",
                pair.endpoint.worker_id,
                pair.gen,
            )
            self.drop_pair(pair)
        raise RuntimeError(f"receiver {tr.ticket.receiver.worker_id} keeps dropping the pair")

    def _pair_for(self, endpoint: PeerEndpoint) -> SendPair:
        with self._lock:
            pair = self._pairs.get(endpoint.key())
            if pair is None or pair.broken:
                pair = SendPair(endpoint)
                self._pairs[endpoint.key()] = pair
            return pair

    def _connect(self, pair: SendPair, deadline: float) -> bool:
        """Join the receiver (steps 1-4 of `kvtransfer.rendezvous`); True when this call did.

        The join is the pair's, not the transfer's: it is bounded by the connect timeout, so a
        transfer whose deadline is shorter than a join still leaves the pair joined for the
        next one; a join that fails breaks the pair. A transfer whose deadline passes while
        another transfer's thread joins raises `TransferError` (the pair is fine)."""
        if not pair.lock.acquire(timeout=remaining(deadline)):
            raise TransferError(f"the deadline passed while joining {pair.endpoint.key()}")
        try:
            if pair.group is not None:
                return False
            if pair.broken:
                raise RuntimeError(f"the pair with {pair.endpoint.key()} broke while connecting")
            ep, me = pair.endpoint, self._worker_id
            limit = self._connect_timeout_s
            store = rdv.connect_store(ep.host, ep.port, limit)
            gen = int(store.add(rdv.gen_key(me), 1))
            shm = self._segment.to_dict() if self._segment is not None else None
            record = rdv.join_record(me, gen, self._layout, shm, self._seal)
            store.queue_push(rdv.CTL_QUEUE, record)
            key = rdv.join_key(me, gen)
            store.wait([key], td(limit))
            verdict = rdv.read_verdict(store.get(key), me, gen, self._seal)
            store.delete_key(key)
            if verdict not in (rdv.JOIN_OK, rdv.JOIN_OK_SHM):
                pair.broken = True
                why = verdict.removeprefix("reject:")
                raise TransferError(f"receiver {ep.worker_id} refused prefill {me}: {why}")
            notified = verdict == rdv.JOIN_OK_SHM
            pair.group = rdv.make_pair_group(
                store,
                me,
                gen,
                1,
                pair_backend(self._device, notified),
                self._host,
                limit,
                self._seal,
            )
            pair.store, pair.gen, pair.shm = store, gen, notified
            return True
        except BaseException:
            pair.broken = True  # the next transfer joins afresh
            raise
        finally:
            pair.lock.release()

    def _exchange(self, tr: SendTransfer, pair: SendPair, verify: bool, serial: bool) -> bool:
        """Announce, stream the layers, wait for the acknowledgement (see `kvtransfer.wire`);
        `serial`: an NCCL pair (one transfer at a time, operations matched in order).

        With `verify` (a pair connected earlier), first check that the receiver still serves
        its generation — after announcing, so the check overlaps the receiver's set-up — and
        return False, having posted nothing, when it does not.
        """
        t, deadline = tr.ticket, tr.deadline
        bound = exchange_bound(deadline)  # past it, the peer counts as frozen
        store, group = pair.connected()
        tag = pair.take_tag()
        late = time.monotonic() >= deadline
        if tr.cancelled or late:  # not announced yet: tell the receiver so it fails it now
            store.queue_push(
                rdv.CTL_QUEUE,
                rdv.cancel_record(self._worker_id, t.transfer_id, t.epoch, self._seal),
            )
            raise TransferError("cancelled by sender" if tr.cancelled else "deadline passed")
        left_ms = max(1, round((deadline - time.monotonic()) * 1000))
        src = list(tr.src) if pair.shm else None
        header = rdv.xfer_record(
            self._worker_id, pair.gen, t.transfer_id, t.epoch, tag, t.num_tokens, left_ms, src,
            self._seal,
        )  # fmt: skip
        store.queue_push(rdv.CTL_QUEUE, header)
        if verify and store.get(rdv.cur_key(self._worker_id)).decode() != str(pair.gen):
            return False
        with tr.cond:  # from here on the engine thread posts each layer as it comes
            tr.group, tr.tag, tr.shm = group, tag, pair.shm
            if tr.state is SendState.JOINING:  # else it gave up: only the queued layers go
                tr.move(SendState.STREAMING, by="helper")
            for layer in tr.pending:
                self._post_layer(tr, layer, "helper")
            tr.pending.clear()
        ack = empty_control(self._ctl(pair.shm))
        acked = None if serial else group.recv([ack], 0, tag)  # gloo: ahead (module docstring)
        for i in range(t.layout.num_layers):
            wait_until(self._wait_layer(tr, i), bound)
        with tr.cond:  # the trailer went out with the last layer (or the last filler)
            if tr.state is SendState.POST_FAILED:
                raise RuntimeError(tr.post_error)
            trailer = tr.works[t.layout.num_layers]
        wait_until(trailer, bound)
        # The sends are done reading the cache (a shared-memory receiver is not: see
        # `SendTransfer.source_released`).
        tr.move(SendState.SENT, by="helper")
        wait_until(acked or group.recv([ack], 0, tag), bound)
        code = read_code(ack)
        if code is not Code.OK:
            raise TransferError(code.describe() if code else f"bad ack code {int(ack[0])}")
        if tr.cancelled:
            raise TransferError("cancelled by sender")
        return True

    def _wait_layer(self, tr: SendTransfer, i: int) -> Work:
        """The posted send of layer `i`. When the engine will not hand it over (cancelled,
        gave up, or the deadline passed), filler sends complete the stream and a
        SENDER_CANCELLED trailer tells the receiver not to complete it: the transfer ends, the
        pair goes on. Raises `TransferError` when the transport closes."""
        failed = SendState.POST_FAILED
        with tr.cond:
            while len(tr.works) <= i and tr.state is not failed:
                if self._closing.is_set():
                    raise TransferError("transport closed")
                if tr.cancelled or tr.state is SendState.GIVEN_UP:
                    break
                if time.monotonic() >= tr.deadline:
                    break
                tr.cond.wait(remaining(tr.deadline))
            if tr.state is failed:
                raise RuntimeError(tr.post_error)
            if len(tr.works) > i:
                return tr.works[i]
            # Cancelled, given up or out of time: the engine posts nothing more from here.
            tr.move(SendState.FILLING, by="helper")
        filler = (
            empty_control(self._ctl(True))
            if tr.shm
            else torch.zeros(
                self._message_shape(tr.ticket.num_blocks), dtype=self._dtype, device=self._device
            )
        )
        with tr.cond:
            while len(tr.works) < tr.ticket.layout.num_layers and tr.state is not failed:
                self._post(tr, filler, "helper")
            if tr.state is not failed:  # the receiver checks it before completing
                self._post(tr, control_tensor(Code.SENDER_CANCELLED, self._ctl(tr.shm)), "helper")
            if tr.state is failed:
                raise RuntimeError(tr.post_error)
            return tr.works[i]

    @staticmethod
    def _post(tr: SendTransfer, data: torch.Tensor, by: Mover) -> None:
        """Post one send (caller, `by`, holds `tr.cond`)."""
        assert tr.group is not None, "posting needs the pair's group"
        try:
            work = tr.group.send([data], 0, tr.tag)
        except RuntimeError as exc:
            tr.post_error = f"posting a send failed: {exc}"
            if tr.state is not SendState.POST_FAILED:  # announcing goes on through `pending`
                tr.move(SendState.POST_FAILED, by)
            return
        tr.works.append(work)
        tr.keep.append(data)
