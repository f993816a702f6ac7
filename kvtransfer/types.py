"""Plain data that crosses the KV-transfer seam: endpoints, tickets, results, errors.

Used in prefill and decode workers (and later carried by the gRPC layer as protobuf fields), so
everything here is ids, ints, strings and tuples of ints: `to_dict` / `from_dict` give a
JSON-safe form and nothing is ever pickled between processes.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Literal

from model_runtime.kv_cache import KVLayout


class TransferError(RuntimeError):
    """A KV transfer failed (peer dead or frozen, deadline passed, rejected, cancelled)."""


class LayoutMismatchError(ValueError):
    """Prefill and decode disagree on the KV layout; the message names both values."""


def check_layout(here: KVLayout, peer: KVLayout, here_name: str, peer_name: str) -> None:
    """Raise `LayoutMismatchError` naming every differing field with both sides' values."""
    diffs = [
        f"{name}: {getattr(here, name)!r} ({here_name}) != {getattr(peer, name)!r} ({peer_name})"
        for name in KVLayout.__dataclass_fields__
        if getattr(here, name) != getattr(peer, name)
    ]
    if diffs:
        raise LayoutMismatchError("KV layout mismatch: " + "; ".join(diffs))


def layout_to_dict(layout: KVLayout) -> dict[str, Any]:
    return {name: getattr(layout, name) for name in KVLayout.__dataclass_fields__}


def layout_from_dict(raw: Mapping[str, Any]) -> KVLayout:
    return KVLayout(
        model_name=str(raw["model_name"]),
        dtype=str(raw["dtype"]),
        block_size=int(raw["block_size"]),
        num_layers=int(raw["num_layers"]),
        num_kv_heads=int(raw["num_kv_heads"]),
        head_dim=int(raw["head_dim"]),
        # a peer from before int8 caches stores blocks in its model dtype
        cache_dtype=str(raw.get("cache_dtype", raw["dtype"])),
    )


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold a prompt of `num_tokens` tokens (the last one may be partial)."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class PeerEndpoint:
    """Where a receiver can be reached: its worker id and its rendezvous store address.

    For the loopback transport `host` is ``"loopback"`` and `port` is 0.
    """

    worker_id: str
    host: str
    port: int

    def key(self) -> str:
        return f"{self.worker_id}@{self.host}:{self.port}"


@dataclass(frozen=True)
class TransferTicket:
    """Issued by the decode side after it reserved `dst_block_ids` for one request's prompt.

    The prefill side pushes the first ``blocks_needed(num_tokens, layout.block_size)`` blocks of
    the prompt's KV into the first that many `dst_block_ids` (extra ids are decode headroom and
    are not written). `epoch` tells re-issues of the same `transfer_id` apart: only layers sent
    for the ticket's epoch count. `timeout_ms` is the transfer's deadline, measured by each side
    from the moment it learns of the ticket (`expect` on the decode side, `open` on the prefill
    side).
    """

    transfer_id: str
    epoch: int
    request_id: str
    num_tokens: int
    dst_block_ids: tuple[int, ...]
    receiver: PeerEndpoint
    layout: KVLayout
    timeout_ms: int

    @property
    def num_blocks(self) -> int:
        """Blocks that actually move (the prompt's), never more than len(dst_block_ids)."""
        return blocks_needed(self.num_tokens, self.layout.block_size)

    def validate(self) -> None:
        """Raise ValueError naming the field when the ticket cannot describe a transfer."""
        if not self.transfer_id:
            raise ValueError("ticket.transfer_id must be a non-empty string")
        if self.epoch < 0:
            raise ValueError(f"ticket.epoch must be >= 0, got {self.epoch}")
        if self.num_tokens <= 0:
            raise ValueError(f"ticket.num_tokens must be positive, got {self.num_tokens}")
        if self.timeout_ms <= 0:
            raise ValueError(f"ticket.timeout_ms must be positive, got {self.timeout_ms}")
        if len(self.dst_block_ids) < self.num_blocks:
            raise ValueError(
                f"ticket.dst_block_ids has {len(self.dst_block_ids)} blocks, the prompt of "
                f"{self.num_tokens} tokens needs {self.num_blocks} "
                f"(block_size {self.layout.block_size})"
            )
        if len(set(self.dst_block_ids)) != len(self.dst_block_ids):
            raise ValueError(f"ticket.dst_block_ids has duplicates: {list(self.dst_block_ids)}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (what a protobuf message would carry)."""
        return {
            "transfer_id": self.transfer_id,
            "epoch": self.epoch,
            "request_id": self.request_id,
            "num_tokens": self.num_tokens,
            "dst_block_ids": list(self.dst_block_ids),
            "receiver": {
                "worker_id": self.receiver.worker_id,
                "host": self.receiver.host,
                "port": self.receiver.port,
            },
            "layout": layout_to_dict(self.layout),
            "timeout_ms": self.timeout_ms,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TransferTicket:
        rcv = raw["receiver"]
        return cls(
            transfer_id=str(raw["transfer_id"]),
            epoch=int(raw["epoch"]),
            request_id=str(raw["request_id"]),
            num_tokens=int(raw["num_tokens"]),
            dst_block_ids=tuple(int(b) for b in raw["dst_block_ids"]),
            receiver=PeerEndpoint(str(rcv["worker_id"]), str(rcv["host"]), int(rcv["port"])),
            layout=layout_from_dict(raw["layout"]),
            timeout_ms=int(raw["timeout_ms"]),
        )


def new_ticket(
    receiver: PeerEndpoint,
    layout: KVLayout,
    request_id: str,
    dst_block_ids: Sequence[int],
    num_tokens: int,
    timeout_s: float,
    *,
    transfer_id: str | None = None,
    epoch: int = 0,
) -> TransferTicket:
    """Build a validated ticket; a fresh `transfer_id` is ``"<receiver id>/<uuid4 hex>"``."""
    ticket = TransferTicket(
        transfer_id=transfer_id or f"{receiver.worker_id}/{uuid.uuid4().hex}",
        epoch=epoch,
        request_id=request_id,
        num_tokens=num_tokens,
        dst_block_ids=tuple(int(b) for b in dst_block_ids),
        receiver=receiver,
        layout=layout,
        timeout_ms=max(1, round(timeout_s * 1000)),
    )
    ticket.validate()
    return ticket


@dataclass(frozen=True)
class TransferResult:
    """The one and only outcome of one side of one transfer, returned once by `poll()`.

    `role` is which side this process played. On the receiving side ``ok`` means every layer of
    the ticket's epoch is in the destination blocks; on the sending side it means the receiver
    acknowledged exactly that. On failure `error` says why, in words.
    """

    transfer_id: str
    epoch: int
    request_id: str
    role: Literal["send", "recv"]
    peer: str
    ok: bool
    error: str | None = None
    nbytes: int = 0
    elapsed_s: float = 0.0
    # the data plane it used (`kvtransfer.same_host`): "shm" (memfd), "cuda_ipc", "gloo",
    # "nccl", "loopback"; "" when it never reached one (failed before announcing)
    plane: str = ""
    layers: int = 0  # layers handed over (send) or written (recv)

    def raise_for_error(self) -> None:
        """Raise `TransferError` with the reason when the transfer failed."""
        if not self.ok:
            raise TransferError(
                f"KV transfer {self.transfer_id} (epoch {self.epoch}, request "
                f"{self.request_id}, {self.role} side, peer {self.peer}) failed: {self.error}"
            )


class Code(IntEnum):
    """Receiver verdicts and acknowledgements (sent as small int64 messages on the wire)."""

    GO = 1  # header accepted: send the layers
    OK = 2  # every layer arrived and was written: the transfer is complete
    UNKNOWN_TRANSFER = 3  # no live ticket with this id (never issued, expired or cancelled)
    STALE_EPOCH = 4  # the ticket was re-issued with another epoch
    SHAPE_MISMATCH = 5  # the sender's token or block count differs from the ticket's
    ALREADY_OPEN = 6  # another sender already opened this ticket
    RECEIVER_FAILED = 7  # the receiver gave up (deadline, cancel, sender cancel)
    SENDER_CANCELLED = 8  # trailer: the sender cancelled, the stream's last layers are filler

    def describe(self) -> str:
        return _CODE_TEXT[self]


_CODE_TEXT = {
    Code.GO: "accepted",
    Code.OK: "complete",
    Code.UNKNOWN_TRANSFER: "rejected by receiver: no live ticket with this id",
    Code.STALE_EPOCH: "rejected by receiver: stale epoch (the ticket was re-issued)",
    Code.SHAPE_MISMATCH: "rejected by receiver: token/block count differs from the ticket",
    Code.ALREADY_OPEN: "rejected by receiver: another sender already opened this ticket",
    Code.RECEIVER_FAILED: "receiver gave up on the transfer (deadline, cancel or sender cancel)",
    Code.SENDER_CANCELLED: "cancelled by sender",
}


def header_verdict(
    expected: TransferTicket | None, already_open: bool, epoch: int, num_tokens: int
) -> Code:
    """The receiver's answer to a sender announcing (transfer id, epoch, num_tokens)."""
    if expected is None:
        return Code.UNKNOWN_TRANSFER
    if expected.epoch != epoch:
        return Code.STALE_EPOCH
    if expected.num_tokens != num_tokens:
        return Code.SHAPE_MISMATCH
    if already_open:
        return Code.ALREADY_OPEN
    return Code.GO
