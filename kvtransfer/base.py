"""The KV-transport seam: how a prefill worker pushes a prompt's KV into a decode worker.

Runs inside the engine thread of prefill and decode workers. Implementations:
`kvtransfer.loopback.LoopbackTransport` (same process, for tests) and
`kvtransfer.torch_dist.TorchDistTransport` (torch.distributed point-to-point between processes:
gloo for CPU caches, NCCL for CUDA caches). One contract test runs against both.

Life of one transfer:

1. The decode worker reserves destination blocks, builds a `TransferTicket` (`new_ticket`) and
   calls ``expect(ticket)``. The ticket travels to the prefill worker (router / gRPC).
2. The prefill worker calls ``open(ticket, src_block_ids)`` before its forward pass, then
   ``send_layer(transfer_id, l)`` from the model runner's ``on_layer_done(l)`` callback for
   l = 0 .. num_layers-1, in order, each exactly once. Each call sends layer l of the source
   blocks as one message (straight from the cache when the blocks are consecutive, else a
   copy) (never one message per block; besides
   the layers a transfer costs one small header and one acknowledgement), so the network
   overlaps the remaining layers' compute. Prefix-cached source blocks are sent like any
   other: what moves is exactly the prompt's KV, its first ``ticket.num_blocks`` blocks.
3. Each arrived layer is written into the destination blocks (the loopback does it in
   ``poll()``, the torch.distributed transport in its receiving thread as the layer lands).
   The decode worker's ``poll()`` returns an ok `TransferResult` once every layer of the
   ticket's epoch is in place; the prefill worker's ``poll()`` returns ok once the receiver
   acknowledged exactly that.

Ownership rules (every implementation keeps them; callers rely on them):

- **Sender keeps its source blocks until the result is known.** From ``open`` until ``poll()``
  has returned this transfer's result, the source blocks are neither freed nor overwritten.
  After an ok result the transport never reads them again; after a failed one a send still
  in flight may, but what it reads then never completes a transfer on the receiver.
- **Receiver does not schedule the request until the transfer is complete.** The destination
  blocks hold valid KV only once ``poll()`` returned ``ok=True`` for the ticket; before that
  they may hold any mix of layers.
- **On failure both sides free what they hold for that request, exactly once.** Every opened
  or expected transfer produces exactly one `TransferResult` per side (success, failure,
  deadline or cancel). The sender releases its source blocks when it sees the result, ok or
  not; the receiver frees its destination blocks when it sees a failed one (an ok one leaves
  them holding the request's KV). After ``cancel`` the result still arrives through
  ``poll()`` — at the next call, or, for a sender whose sends read straight from the cache
  or a receiver whose receives write straight into the blocks, once those are done (at the
  deadline at the latest) — and that is when blocks are freed. The transport itself never
  frees anything: blocks belong to the worker's block pool. Each side's result is its own: a
  sender that cancels after its last layer left may see "cancelled" while the receiver
  completes, and a receiver that cancels after its last layer landed may fail the transfer
  while the sender sees ok — the request's fate is decided on the decode side.

Deadlines and liveness: every transfer has its own deadline (``ticket.timeout_ms``, counted by
each side from ``expect`` / ``open``). A dead (SIGKILL) or frozen (SIGSTOP) peer makes the
surviving side's ``poll()`` report the transfer failed by its deadline (a receiver whose
receives write straight into the blocks: as soon as its wait times out there, a few ms); the pair's
connection is then torn down and re-created on next use. No method blocks on a peer: all of
them return promptly whatever the peer does. ``poll()`` must be called regularly (every engine
step, and every few ms while transfers are in flight) since that is where deadlines are checked
and results are produced.

Threading: the transport is owned by the worker's engine thread, the same thread that owns the
`KVCache`; only that thread calls these methods. Implementations may run helper threads for
network waits. The only cache access allowed off the engine thread is writing received layers
into the ticket's destination blocks (by a helper thread, or by the network stack receiving
into them) — reserved for the transfer, so nobody else touches them — and never after
``poll()`` has reported the transfer's result.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Literal, Protocol

from kvtransfer.types import (
    PeerEndpoint,
    TransferResult,
    TransferTicket,
    check_layout,
)
from model_runtime.kv_cache import KVCache, KVLayout


class KVTransport(Protocol):
    """Push a prompt's KV from a prefill worker into a decode worker. See the module docstring."""

    @property
    def endpoint(self) -> PeerEndpoint:
        """Where senders reach this worker; put into the tickets it issues."""
        ...

    @property
    def layout(self) -> KVLayout:
        """The layout of this worker's KV cache."""
        ...

    def expect(self, ticket: TransferTicket) -> None:
        """Receiver: accept KV for `ticket` into its destination blocks (already reserved).

        Raises ValueError for a ticket that is not addressed to this worker, has a different
        layout (`LayoutMismatchError`), names blocks outside the cache, or reuses a transfer id
        still in flight.
        """
        ...

    def open(self, ticket: TransferTicket, src_block_ids: Sequence[int]) -> None:
        """Sender: start pushing the blocks `src_block_ids` (the prompt's, in order).

        Raises `LayoutMismatchError` when the ticket's layout differs from this worker's (the
        message names both values), ValueError when the block count does not match the prompt.
        """
        ...

    def send_layer(self, transfer_id: str, layer: int) -> None:
        """Sender: layer `layer` of every source block is final; send it (non-blocking).

        Layers must come in order 0, 1, ... A transfer that already failed ignores further
        layers until its result is returned; after that the id is unknown (ValueError).
        """
        ...

    def cancel(self, transfer_id: str) -> None:
        """Either side: give up on a transfer; its failed result comes from a later poll() (the
        next one, or once a zero-copy sender's sends, or a direct receiver's receives, are
        done; at the deadline at the latest)."""
        ...

    def poll(self) -> list[TransferResult]:
        """Advance transfers: write arrived layers, enforce deadlines, return finished results."""
        ...

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        """`waker` is called (from any thread, cheaply, never under the transport's locks in a
        way that may block) whenever ``poll()`` may have a result it did not have before, so
        an engine that waits for work can wake at once instead of polling on a timer. Polls
        for deadlines are still the caller's job."""
        ...

    def close(self) -> None:
        """Stop serving and connecting; in-flight transfers fail (results via a last poll())."""
        ...


def check_expect(ticket: TransferTicket, endpoint: PeerEndpoint, cache: KVCache) -> None:
    """Receiver-side validation shared by implementations (raises ValueError)."""
    ticket.validate()
    if ticket.receiver != endpoint:
        raise ValueError(
            f"ticket {ticket.transfer_id} is addressed to {ticket.receiver.key()}, "
            f"this worker is {endpoint.key()}"
        )
    check_layout(cache.layout, ticket.layout, f"decode {endpoint.worker_id}", "ticket")
    _check_block_ids("dst_block_ids", ticket.dst_block_ids[: ticket.num_blocks], cache)


def check_open(
    ticket: TransferTicket, src_block_ids: Sequence[int], cache: KVCache, worker_id: str
) -> tuple[int, ...]:
    """Sender-side validation shared by implementations; returns the source ids as a tuple."""
    ticket.validate()
    check_layout(
        cache.layout, ticket.layout, f"prefill {worker_id}", f"decode {ticket.receiver.worker_id}"
    )
    src = tuple(int(b) for b in src_block_ids)
    if len(src) != ticket.num_blocks:
        raise ValueError(
            f"transfer {ticket.transfer_id}: {len(src)} source blocks given, the prompt of "
            f"{ticket.num_tokens} tokens has {ticket.num_blocks} "
            f"(block_size {ticket.layout.block_size})"
        )
    _check_block_ids("src_block_ids", src, cache)
    return src


def _check_block_ids(name: str, ids: Sequence[int], cache: KVCache) -> None:
    bad = [b for b in ids if not 0 <= b < cache.num_blocks]
    if bad:
        raise ValueError(f"{name} {bad} outside the cache's {cache.num_blocks} blocks")


def deadline_text(ticket: TransferTicket, layers: int, done: str) -> str:
    """The failure message of a transfer whose deadline passed, e.g. "... 2/12 layers sent"."""
    return (
        f"deadline of {ticket.timeout_ms} ms exceeded with {layers}/"
        f"{ticket.layout.num_layers} layers {done}"
    )


def make_result(
    ticket: TransferTicket,
    role: Literal["send", "recv"],
    peer: str,
    error: str | None,
    nbytes: int,
    started: float,
    plane: str = "",
    layers: int = 0,
) -> TransferResult:
    """The `TransferResult` of one side; `started` is its `time.monotonic()` start; `plane`
    and `layers`: see `TransferResult`."""
    return TransferResult(
        transfer_id=ticket.transfer_id,
        epoch=ticket.epoch,
        request_id=ticket.request_id,
        role=role,
        peer=peer,
        ok=error is None,
        error=error,
        nbytes=nbytes,
        elapsed_s=time.monotonic() - started,
        plane=plane,
        layers=layers,
    )
