"""KV transport over torch.distributed point-to-point. Runs in prefill and decode workers.

gloo between CPU caches, NCCL between CUDA caches (chosen by the cache's device). There is no
global world: every prefill-decode pair gets its own 2-rank process group, created lazily
through the decode worker's `TCPStore` (`kvtransfer.rendezvous`), so workers can join, leave,
restart or change role without restarting the others. Every transport instance can both send
and receive (``serve=True`` starts its store, so a prefill worker can later switch to decode).

This class is the engine-thread face of the transport (the `kvtransfer.base.KVTransport`
contract, including the ownership rules): its methods never block on the network. The blocking
work runs in helper threads (`kvtransfer.dist_send`, `kvtransfer.dist_recv`) that report
through a queue drained by ``poll()``; ``poll()`` enforces each transfer's deadline by the
clock (whatever the helper threads are waiting for). A transfer's deadline or cancel ends that
transfer alone: its helper thread finishes its exchange on the wire, and the pair and every
other transfer on it go on (`kvtransfer.wire`). Only a helper thread that finds the pair's
connection failed, or its peer frozen past the exchange bound, drops the pair, so the next use
re-joins with a fresh group.

Zero-copy sends: a layer whose source blocks are consecutive is sent straight from the cache
(`KVCache.run_start` / `layer_slice`), so a send still in flight after the sender's result could
read blocks the prefill worker has already reused. Two rules keep that from ever reaching a
decode cache: a cancelled zero-copy transfer reports its result only once its sends are done (or
at its deadline), and a receiving thread never writes a layer after the ticket's deadline —
which comes before the sender's (both count ``ticket.timeout_ms``, the sender from the later
``open``), so bytes read after a sender's deadline never complete a transfer.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections.abc import Callable, Sequence

from kvtransfer.base import check_expect, check_open, deadline_text, make_result
from kvtransfer.dist_recv import Receiver
from kvtransfer.dist_send import Sender
from kvtransfer.recv_state import RecvState, RecvTransfer
from kvtransfer.same_host import share_cache
from kvtransfer.send_state import SendTransfer
from kvtransfer.staging import STAGING_POOL_BYTES, StagingPool
from kvtransfer.types import Code, PeerEndpoint, TransferResult, TransferTicket
from kvtransfer.wire import Event, EventQueue
from model_runtime.kv_cache import KVCache, KVLayout
from security.kvseal import RecordSeal

log = logging.getLogger(__name__)


class TorchDistTransport:
    """A `KVTransport` between processes (see the module docstring).

    `host` is this worker's address: its store listens there (`port`, 0 = any free port) and
    its gloo pairs bind to it. `connect_timeout_s` bounds joining a peer (store connect, layout
    handshake, group rendezvous) — and never exceeds the transfer's own deadline.
    `staging_pool_bytes` bounds the message buffers kept for reuse between transfers
    (`kvtransfer.staging.StagingPool`; 0 keeps none). `shared_memory`: make this worker's cache
    mappable by same-host peers and use the same-host data plane with every peer that also has
    it on — a CPU cache moves into shared memory (`kvtransfer.shm`), a CUDA cache is exported
    through CUDA IPC to peers on the same GPU (`kvtransfer.cuda_ipc`); the receiver copies the
    blocks straight from the sender's cache, and the pair's group is gloo (control messages
    only). Other peers still get the bytes (gloo between CPU caches, NCCL between GPUs).
    `node`: this worker's node label; the same-host plane is used only between equal labels
    (workers placed on different nodes move bytes even when they share a host). Build the transport
    before the cache serves a step (it moves the cache's tensor). `seal` (`security.kvseal`,
    from the cluster secret): sign every control record, seal the shared-memory offer, and act
    only on records that carry the secret's MAC (`rendezvous`); None: an open rendezvous.
    """

    def __init__(
        self,
        cache: KVCache,
        worker_id: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        connect_timeout_s: float = 10.0,
        serve: bool = True,
        staging_pool_bytes: int = STAGING_POOL_BYTES,
        shared_memory: bool = False,
        node: str = "",
        seal: RecordSeal | None = None,
    ) -> None:
        if not worker_id or "/" in worker_id or "@" in worker_id:
            raise ValueError(f"worker_id must be non-empty without '/' or '@', got {worker_id!r}")
        if connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be positive, got {connect_timeout_s}")
        self._cache = cache
        self._events = EventQueue()
        # Message buffers kept for reuse (copies of scattered layers, receives), shared by both
        # directions: at most `staging_pool_bytes` beyond what transfers in flight hold.
        pool = StagingPool(staging_pool_bytes)
        # memfd for a CPU cache, CUDA IPC for a CUDA one (`kvtransfer.same_host`).
        segment = share_cache(cache, node) if shared_memory else None
        self.shared_memory = segment is not None
        self._receiver = (
            Receiver(
                worker_id,
                cache,
                host,
                port,
                connect_timeout_s,
                self._events,
                pool,
                shared_memory=self.shared_memory,
                node=node,
                seal=seal,
            )
            if serve
            else None
        )
        self._sender = Sender(
            worker_id, cache, host, connect_timeout_s, self._events, pool, segment, seal
        )
        port_used = self._receiver.port if self._receiver is not None else 0
        self._endpoint = PeerEndpoint(worker_id, host, port_used)
        self._recvs: dict[str, RecvTransfer] = {}
        # Decided, but receives straight into their blocks may still land: (transfer, error).
        self._landing: list[tuple[RecvTransfer, str | None]] = []
        self._sends: dict[str, SendTransfer] = {}
        self._closed = False

    @property
    def endpoint(self) -> PeerEndpoint:
        return self._endpoint

    @property
    def layout(self) -> KVLayout:
        return self._cache.layout

    @property
    def rejected_records(self) -> int:
        """Rendezvous records this worker refused for want of the cluster secret's MAC."""
        return 0 if self._receiver is None else self._receiver.refusals.count

    def shared_memory_peers(self) -> list[str]:
        """Receivers this worker sends to through shared memory now (the rest get gloo bytes)."""
        return self._sender.shm_receivers()

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        self._events.waker = waker

    def expect(self, ticket: TransferTicket) -> None:
        self._check_usable()
        if self._receiver is None:
            raise ValueError(f"transport {self._endpoint.worker_id} was built with serve=False")
        check_expect(ticket, self._endpoint, self._cache)
        if ticket.transfer_id in self._recvs:
            raise ValueError(f"transfer {ticket.transfer_id} is already expected")
        now = time.monotonic()
        tr = RecvTransfer(ticket, now, now + ticket.timeout_ms / 1000)
        self._recvs[ticket.transfer_id] = tr
        self._receiver.add(tr)

    def open(self, ticket: TransferTicket, src_block_ids: Sequence[int]) -> None:
        self._check_usable()
        src = check_open(ticket, src_block_ids, self._cache, self._endpoint.worker_id)
        if ticket.transfer_id in self._sends:
            raise ValueError(f"transfer {ticket.transfer_id} is already open")
        now = time.monotonic()
        tr = SendTransfer(ticket, src, now, now + ticket.timeout_ms / 1000)
        tr.run_start = self._cache.run_start(src)  # once per transfer, not per layer
        self._sends[ticket.transfer_id] = tr
        self._sender.start(tr)

    def send_layer(self, transfer_id: str, layer: int) -> None:
        tr = self._sends.get(transfer_id)
        if tr is None:
            raise ValueError(f"send_layer: unknown transfer id {transfer_id!r}")
        if layer != tr.next_layer or layer >= tr.ticket.layout.num_layers:
            raise ValueError(
                f"send_layer({transfer_id!r}, {layer}): layers go in order 0.."
                f"{tr.ticket.layout.num_layers - 1}, expected {tr.next_layer}"
            )
        tr.next_layer += 1
        if not tr.takes_layers():  # cancelled, given up, failed, or its thread is done
            return
        tr.nbytes += math.prod(self._cache.message_shape(len(tr.src))) * self._cache.kv.itemsize
        self._sender.post_layer(tr, layer)

    def cancel(self, transfer_id: str) -> None:
        if transfer_id in self._sends:
            self._sender.stop(self._sends[transfer_id], cancelled=True)
        elif transfer_id in self._recvs:
            rcv = self._recvs[transfer_id]
            with rcv.lock:  # decided now: the receiving thread neither writes nor acks OK
                rcv.cancel()  # its result goes out at the next poll
        else:
            raise ValueError(f"cancel: unknown transfer id {transfer_id!r}")

    def poll(self) -> list[TransferResult]:
        out: list[TransferResult] = []
        self._finish_stopped(out)  # a cancel or close wins over layers that arrived since
        while True:
            try:
                ev = self._events.get_nowait()
            except queue.Empty:
                break
            self._on_event(ev, out)
        now = time.monotonic()
        for rcv in list(self._recvs.values()):
            if now >= rcv.deadline:
                self._finish_recv(
                    rcv, deadline_text(rcv.ticket, rcv.layers_written, "written"), out
                )
        for snd in list(self._sends.values()):
            if now >= snd.deadline:
                self._finish_send(
                    snd, deadline_text(snd.ticket, snd.next_layer, "handed over"), out
                )
        self._report_landed(out)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sender.close(list(self._sends.values()))
        if self._receiver is not None:
            self._receiver.close()

    # ---- helpers ----------------------------------------------------------------------------

    def _finish_stopped(self, out: list[TransferResult]) -> None:
        why = "transport closed" if self._closed else None
        for rcv in list(self._recvs.values()):
            if why or rcv.cancelled:
                self._finish_recv(rcv, why or "cancelled by receiver", out)
        for snd in list(self._sends.values()):
            # A cancelled zero-copy send, or a shared-memory receiver, may still be reading the
            # source blocks: the result (which frees them) waits until the thread is past its
            # sends (shared memory: the acknowledgement) or the deadline.
            copied = snd.run_start is None and not self.shared_memory
            if why or (snd.cancelled and (snd.source_released() or copied)):
                self._finish_send(snd, why or "cancelled by sender", out)

    def _on_event(self, ev: Event, out: list[TransferResult]) -> None:
        if ev.kind == "send_done":
            snd = self._sends.get(ev.transfer_id)
            if snd is None or snd.ticket.epoch != ev.epoch:
                return  # already finished (deadline, cancel): its result went out then
            error = ev.error or ("cancelled by sender" if snd.cancelled else None)
            self._finish_send(snd, error, out)
            return
        rcv = self._recvs.get(ev.transfer_id)
        if rcv is None or rcv.ticket.epoch != ev.epoch:
            return
        if ev.kind == "recv_done":
            rcv.nbytes = ev.nbytes
            self._finish_recv(rcv, None, out)
            return
        self._finish_recv(rcv, ev.error or "receive failed", out)

    def _finish_recv(self, tr: RecvTransfer, error: str | None, out: list[TransferResult]) -> None:
        del self._recvs[tr.ticket.transfer_id]
        assert self._receiver is not None, "only a serving transport receives"
        if self._receiver.finish(tr, Code.OK if error is None else Code.RECEIVER_FAILED):
            self._landing.append((tr, error))  # reported by `_report_landed`, soon
            return
        out.append(make_result(tr.ticket, "recv", tr.sender or "?", error, tr.nbytes, tr.started))

    def _report_landed(self, out: list[TransferResult]) -> None:
        """Report the decided transfers whose direct receives can no longer write into their
        blocks (each completed, or the pair closed: at the latest just past the deadline, when
        the receiving thread's wait times out). A closed transport reports them all."""
        still: list[tuple[RecvTransfer, str | None]] = []
        for tr, error in self._landing:
            with tr.lock:
                landing = tr.state is RecvState.LANDING
            if landing and not self._closed:
                still.append((tr, error))
                continue
            r = make_result(tr.ticket, "recv", tr.sender or "?", error, tr.nbytes, tr.started)
            out.append(r)
        self._landing = still

    def _finish_send(self, tr: SendTransfer, error: str | None, out: list[TransferResult]) -> None:
        del self._sends[tr.ticket.transfer_id]
        if error is not None:
            self._sender.stop(tr, cancelled=False)
        peer = tr.ticket.receiver.worker_id
        plane = self._sender.plane(tr)
        out.append(
            make_result(tr.ticket, "send", peer, error, tr.nbytes, tr.started, plane, tr.next_layer)
        )

    def _check_usable(self) -> None:
        if self._closed:
            raise ValueError(f"transport {self._endpoint.worker_id} is closed")
