"""Same-process KV transport: the reference implementation of the seam, for tests.

Runs wherever its hub's transports run (one process, typically one thread). Transports that
share a `LoopbackHub` reach each other by worker id; a layer "sent" is a copied tensor handed
to the receiver's inbox, and the receiver writes it into its cache in its own ``poll()``, just
as the torch.distributed transport does. It keeps every rule of `kvtransfer.base`: one result
per side per transfer, per-transfer deadlines, rejection of unknown tickets and stale epochs,
and ``close()`` of one side failing the other side's transfers (the loopback analogue of a dead
peer).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvtransfer.base import check_expect, check_open, deadline_text, make_result
from kvtransfer.types import (
    Code,
    PeerEndpoint,
    TransferResult,
    TransferTicket,
    header_verdict,
)
from model_runtime.kv_cache import KVCache, KVLayout


class LoopbackHub:
    """The "network" of loopback transports in one process, keyed by worker id."""

    def __init__(self) -> None:
        self._members: dict[str, LoopbackTransport] = {}

    def join(self, transport: LoopbackTransport) -> None:
        wid = transport.endpoint.worker_id
        if wid in self._members:
            raise ValueError(f"loopback worker id {wid!r} is already in use")
        self._members[wid] = transport

    def leave(self, worker_id: str) -> None:
        self._members.pop(worker_id, None)

    def find(self, worker_id: str) -> LoopbackTransport | None:
        return self._members.get(worker_id)


@dataclass
class _Send:
    ticket: TransferTicket
    src: tuple[int, ...]
    started: float
    deadline: float
    next_layer: int = 0
    nbytes: int = 0
    error: str | None = None  # set when failed; the result goes out at the next poll()
    acked: bool = False


@dataclass
class _Recv:
    ticket: TransferTicket
    started: float
    deadline: float
    sender: str | None = None
    layers_done: int = 0
    nbytes: int = 0
    inbox: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    error: str | None = None


class LoopbackTransport:
    """A `KVTransport` whose peers live in the same process (see the module docstring)."""

    def __init__(self, hub: LoopbackHub, worker_id: str, cache: KVCache) -> None:
        self._hub = hub
        self._cache = cache
        self._endpoint = PeerEndpoint(worker_id, "loopback", 0)
        self._sends: dict[str, _Send] = {}
        self._recvs: dict[str, _Recv] = {}
        self._closed = False
        self._waker: Callable[[], None] | None = None
        hub.join(self)

    @property
    def endpoint(self) -> PeerEndpoint:
        return self._endpoint

    @property
    def layout(self) -> KVLayout:
        return self._cache.layout

    # ---- receiver side ----------------------------------------------------------------------

    def expect(self, ticket: TransferTicket) -> None:
        self._check_open_transport()
        check_expect(ticket, self._endpoint, self._cache)
        if ticket.transfer_id in self._recvs:
            raise ValueError(f"transfer {ticket.transfer_id} is already expected")
        now = time.monotonic()
        self._recvs[ticket.transfer_id] = _Recv(ticket, now, now + ticket.timeout_ms / 1000)

    def _announce(self, sender: str, ticket: TransferTicket) -> Code:
        rec = self._recvs.get(ticket.transfer_id)
        live = rec if rec is not None and rec.error is None else None
        code = header_verdict(
            live.ticket if live else None,
            live is not None and live.sender is not None,
            ticket.epoch,
            ticket.num_tokens,
        )
        if code is Code.GO and live is not None:
            live.sender = sender
        return code

    def _deliver(self, transfer_id: str, epoch: int, layer: int, data: torch.Tensor) -> None:
        rec = self._recvs.get(transfer_id)
        if rec is not None and rec.ticket.epoch == epoch and rec.error is None:
            rec.inbox.append((layer, data))
            self._wake()

    def _sender_gave_up(self, transfer_id: str, epoch: int, why: str) -> None:
        rec = self._recvs.get(transfer_id)
        if rec is not None and rec.ticket.epoch == epoch and rec.error is None:
            rec.error = why
            self._wake()

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        self._waker = waker

    def _wake(self) -> None:
        if self._waker is not None:
            self._waker()

    # ---- sender side ------------------------------------------------------------------------

    def open(self, ticket: TransferTicket, src_block_ids: Sequence[int]) -> None:
        self._check_open_transport()
        src = check_open(ticket, src_block_ids, self._cache, self._endpoint.worker_id)
        if ticket.transfer_id in self._sends:
            raise ValueError(f"transfer {ticket.transfer_id} is already open")
        now = time.monotonic()
        snd = _Send(ticket, src, now, now + ticket.timeout_ms / 1000)
        self._sends[ticket.transfer_id] = snd
        peer = self._hub.find(ticket.receiver.worker_id)
        if peer is None:
            snd.error = f"receiver {ticket.receiver.worker_id} is not reachable"
            return
        code = peer._announce(self._endpoint.worker_id, ticket)
        if code is not Code.GO:
            snd.error = code.describe()

    def send_layer(self, transfer_id: str, layer: int) -> None:
        snd = self._sends.get(transfer_id)
        if snd is None:
            raise ValueError(f"send_layer: unknown transfer id {transfer_id!r}")
        if layer != snd.next_layer:
            raise ValueError(
                f"send_layer({transfer_id!r}, {layer}): layers go in order, expected "
                f"{snd.next_layer}"
            )
        snd.next_layer += 1
        if snd.error is not None:
            return
        peer = self._hub.find(snd.ticket.receiver.worker_id)
        if peer is None:
            snd.error = f"receiver {snd.ticket.receiver.worker_id} went away"
            return
        data = self._cache.gather_layer(layer, snd.src)
        snd.nbytes += data.numel() * data.element_size()
        peer._deliver(transfer_id, snd.ticket.epoch, layer, data)

    def _ack(self, transfer_id: str, epoch: int, code: Code) -> None:
        snd = self._sends.get(transfer_id)
        if snd is None or snd.ticket.epoch != epoch or snd.error is not None:
            return
        if code is Code.OK:
            snd.acked = True
        else:
            snd.error = code.describe()
        self._wake()

    # ---- both -------------------------------------------------------------------------------

    def cancel(self, transfer_id: str) -> None:
        if transfer_id in self._sends:
            snd = self._sends[transfer_id]
            if snd.error is None and not snd.acked:
                snd.error = "cancelled by sender"
                peer = self._hub.find(snd.ticket.receiver.worker_id)
                if peer is not None:
                    peer._sender_gave_up(transfer_id, snd.ticket.epoch, "cancelled by sender")
        elif transfer_id in self._recvs:
            rec = self._recvs[transfer_id]
            if rec.error is None:
                rec.error = "cancelled by receiver"
        else:
            raise ValueError(f"cancel: unknown transfer id {transfer_id!r}")

    def poll(self) -> list[TransferResult]:
        now = time.monotonic()
        out: list[TransferResult] = []
        for tid, rec in list(self._recvs.items()):
            for layer, data in rec.inbox:
                if rec.error is None:
                    n = rec.ticket.num_blocks
                    self._cache.scatter_layer(layer, rec.ticket.dst_block_ids[:n], data)
                    rec.layers_done += 1
                    rec.nbytes += data.numel() * data.element_size()
            rec.inbox.clear()
            done = rec.error is None and rec.layers_done == rec.ticket.layout.num_layers
            if not done and rec.error is None and now >= rec.deadline:
                rec.error = deadline_text(rec.ticket, rec.layers_done, "written")
            if done or rec.error is not None:
                del self._recvs[tid]
                self._ack_sender(rec, Code.OK if done else Code.RECEIVER_FAILED)
                out.append(
                    make_result(
                        rec.ticket,
                        "recv",
                        rec.sender or "?",
                        rec.error,
                        rec.nbytes,
                        rec.started,
                        "loopback",
                        rec.layers_done,
                    )
                )
        for tid, snd in list(self._sends.items()):
            if not snd.acked and snd.error is None and now >= snd.deadline:
                snd.error = deadline_text(snd.ticket, snd.next_layer, "handed over")
            if snd.acked or snd.error is not None:
                del self._sends[tid]
                out.append(
                    make_result(
                        snd.ticket,
                        "send",
                        snd.ticket.receiver.worker_id,
                        snd.error,
                        snd.nbytes,
                        snd.started,
                        "loopback",
                        snd.next_layer,
                    )
                )
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._hub.leave(self._endpoint.worker_id)
        for rec in self._recvs.values():
            if rec.error is None:
                rec.error = "transport closed"
        for snd in self._sends.values():
            if snd.error is None and not snd.acked:
                snd.error = "transport closed"
                peer = self._hub.find(snd.ticket.receiver.worker_id)
                if peer is not None:
                    peer._sender_gave_up(snd.ticket.transfer_id, snd.ticket.epoch, "sender closed")

    # ---- helpers ----------------------------------------------------------------------------

    def _ack_sender(self, rec: _Recv, code: Code) -> None:
        if rec.sender is not None:
            peer = self._hub.find(rec.sender)
            if peer is not None:
                peer._ack(rec.ticket.transfer_id, rec.ticket.epoch, code)

    def _check_open_transport(self) -> None:
        if self._closed:
            raise ValueError(f"transport {self._endpoint.worker_id} is closed")
