"""Where one transfer's layers land on the decode side: the receives a transfer thread posts,
and how it makes sure none of them can still write once it is done. Runs in decode workers,
in the receiving threads of `kvtransfer.dist_recv`.

Three ways, chosen once per transfer (`post_receives`):

- **direct** (gloo, destination blocks consecutive): each layer is received straight into
  the destination blocks (`KVCache.layer_slices`, views): no staging buffer, no copy, and
  nothing for the thread to do per layer, so it waits for the trailer first
  (`Posted.wait_trailer`: one sleep per transfer, not one per layer). gloo
  writes those bytes whenever they arrive, so the transfer's result waits until no receive can
  write any more (the transfer is RECEIVING from `_claim_blocks` until `settle`, see
  `kvtransfer.recv_state`): each posted receive has completed — a live sender completes the
  stream even after a deadline or cancel, with fillers — or a wait on the pair failed: a gloo
  wait that fails or times out closes the pair's connection, after which nothing lands in any
  of its buffers (waits are bounded by the exchange bound, not the transfer's deadline, so
  that happens only when the peer failed: `kvtransfer.wire`);
- **staged** (scattered destination blocks, or NCCL): into pooled staging buffers, which the
  thread writes into the blocks itself (`kvtransfer.staging.write_layer`) under the
  transfer's lock, so nothing is written after the result;
- **notified** (shared-memory pair, `kvtransfer.shm`): each message is a layer's
  notification and the thread copies the layer out of the sender's cache.

Every way posts one more receive after the layers: the stream's trailer (`kvtransfer.wire`).
A refused transfer's stream is drained into scratch memory (`drain_and_answer`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch._C._distributed_c10d import Work

from kvtransfer import rendezvous as rdv
from kvtransfer.recv_state import RecvState, RecvTransfer
from kvtransfer.same_host import control_device
from kvtransfer.staging import StagingPool
from kvtransfer.types import Code
from kvtransfer.wire import control_tensor, empty_control, td, wait_until
from model_runtime.kv_cache import KVCache

Mode = Literal["direct", "staged", "notified"]
ACK_TIMEOUT_S = 5.0  # bound on sending a verdict or acknowledgement to a live peer


@dataclass
class Posted:
    """A transfer's posted receives: one per layer (into `bufs`, or the blocks themselves when
    `mode` is "direct"), then the trailer's. Waited in that order, each once (`wait_next`;
    the trailer's may come first, `wait_trailer`): a gloo receive's wait consumes its
    completion, so a second wait would block."""

    mode: Mode
    bufs: list[torch.Tensor]  # staging buffers or notifications; empty when direct
    works: list[Work]  # the layers' receives, then the trailer's
    trailer: torch.Tensor
    waited: int = 0  # how many of `works` were waited (returned or raised), in order
    trailer_waited: bool = False  # the trailer's was waited ahead of the layers'

    def wait_next(self, bound: float) -> None:
        """Wait for the next receive in order, at most until `bound` (the transfer's exchange
        bound, `kvtransfer.wire.exchange_bound`: never its own deadline); raises when it fails
        or times out — the peer broke or froze, and the pair's connection is closed now."""
        work = self.works[self.waited]
        self.waited += 1
        if self.trailer_waited and self.waited == len(self.works):
            return  # waited already (`wait_trailer`)
        wait_until(work, bound)

    def wait_trailer(self, bound: float) -> None:
        """Wait for the trailer ahead of the layers (as `wait_next` does, once). A pair
        delivers its messages in order, so every layer is in once the trailer is: the layers'
        waits then return at once, and a thread that has nothing to do per layer (direct
        receives land by themselves) sleeps once per transfer, not once per layer."""
        assert not self.trailer_waited and self.waited < len(self.works), "trailer waited twice"
        self.trailer_waited = True
        wait_until(self.works[-1], bound)

    def recycle(self, staging: StagingPool) -> None:
        """Staging buffers back to the pool, once every receive completed (none writes now)."""
        if self.mode == "staged":
            staging.give(self.bufs)


def post_receives(
    group: rdv.PairGroup,
    tr: RecvTransfer,
    tag: int,
    cache: KVCache,
    staging: StagingPool,
    direct_ok: bool,
) -> Posted:
    """Post every layer's receive and the trailer's, all up front: gloo only moves a message
    once its receive is posted, so receiving a few layers ahead would cost a round trip per
    layer. `direct_ok`: the pair's backend may receive into the cache (gloo).

    A transfer the engine already decided (or cancelled) is never received directly. If posting
    fails, the pair's connection is closed (gloo refuses new operations only then), so nothing
    already posted can land either, and the transfer settles before the error propagates.
    """
    t = tr.ticket
    layers = t.layout.num_layers
    notified = tr.src_ids is not None
    # A notified pair is gloo with CPU control messages (`kvtransfer.same_host`).
    device = control_device(cache.device, notified)
    trailer = empty_control(device)
    if notified:
        notes = [empty_control(device) for _ in range(layers)]
        works = [group.recv([n], 1, tag) for n in [*notes, trailer]]
        return Posted("notified", notes, works, trailer)
    dst = t.dst_block_ids[: t.num_blocks]
    first = KVCache.run_start(dst) if direct_ok else None
    if first is not None and _claim_blocks(tr):
        try:
            views = cache.layer_slices(first, len(dst))
            works = [group.recv([v], 1, tag) for v in [*views, trailer]]
            return Posted("direct", [], works, trailer)
        except RuntimeError:
            with tr.lock:
                tr.settle()
            raise
    shape = cache.message_shape(t.num_blocks)
    bufs = staging.take_many(math.prod(shape), cache.dtype, device, layers)
    works = [group.recv([StagingPool.view(buf, shape)], 1, tag) for buf in bufs]
    works.append(group.recv([trailer], 1, tag))
    return Posted("staged", bufs, works, trailer)


def _claim_blocks(tr: RecvTransfer) -> bool:
    """Move `tr` to RECEIVING (into its blocks), unless the engine already decided its result
    or cancelled (`Receiver.finish` reads the state under the same lock)."""
    with tr.lock:
        if tr.state is not RecvState.OPEN:
            return False
        tr.move(RecvState.RECEIVING, "helper")
        return True


def settle(tr: RecvTransfer, posted: Posted, bound: float) -> None:
    """Return once none of a direct transfer's receives can write into its blocks any more,
    and settle `tr` (out of RECEIVING, CANCELLED_LANDING or LANDING). Waits each receive at
    most until `bound` (the exchange bound): past it, a wait times out, which closes the pair
    (the peer froze). No-op for other modes."""
    if posted.mode != "direct":
        return
    while posted.waited < len(posted.works):
        # A wait that fails or times out closes the pair: nothing more lands on it.
        with contextlib.suppress(RuntimeError):
            posted.wait_next(bound)
    with tr.lock:
        tr.settle()


def drain_and_answer(
    group: rdv.PairGroup,
    tag: int,
    code: Code,
    cache: KVCache,
    n_blocks: int,
    notified: bool,
    bound: float,
) -> None:
    """Receive a refused transfer's stream into scratch memory, then send `code` as the
    acknowledgement. Waits until `bound` (the exchange bound); raises when a wait fails or
    times out."""
    ctl = control_device(cache.device, notified)
    scratch = (
        empty_control(ctl)
        if notified
        else torch.empty(cache.message_shape(n_blocks), dtype=cache.dtype, device=cache.device)
    )
    for _ in range(cache.num_layers):
        wait_until(group.recv([scratch], 1, tag), bound)
    wait_until(group.recv([empty_control(ctl)], 1, tag), bound)
    group.send([control_tensor(code, ctl)], 1, tag).wait(td(ACK_TIMEOUT_S))
