"""The hand-off owner: the one place a worker pairs its KV transport with its engine's scheduler.

Runs in the engine thread of every worker process, and — over a simulated transport — in the
planner's simulator (`tooling/planner/sim_engine.py`), under the same names. Nothing else
calls a KV transport or the scheduler's hand-off methods: the roles above it
(`prefill_worker`, `decode_worker`) are RPC -> sink adapters that speak request ids and
`HandoffOutcome`s only, and the engine thread polls it once per iteration.

Each step of a hand-off is whole here, so no caller can leave one half done::

    decode side                                   prefill side
    reserve ──> RECEIVING ──poll ok──> RECEIVED   check_ticket (Prefill arrives)
      │ (expect refused: freed, raised)   │       open_send (the step that samples the first
      │          └──poll failed──> freed  admit     token: transport.open + Scheduler.open_send)
      └─ abandon: freed at the result           poll: the send's result frees the blocks
                  (RECEIVED: at once)           abandon: freed at the result

- `reserve` (decode): blocks for every KV position the request can write (prompt +
  max_tokens - 1; `blocks_for`), a ticket for them, and `KVTransport.expect`; a transport
  that refuses the ticket has its blocks freed before `TransferRefused` leaves. None when the
  blocks are short (the caller answers RESOURCE_EXHAUSTED).
- `open_send` (prefill): `KVTransport.open` and `Scheduler.open_send` as one step, so a
  finished request keeps its blocks until the transport's result; `layer_sender` is the
  runner's `on_layer_done` for the step's sends.
- `admit` (decode): a RECEIVED reservation's blocks go to the prefilled request.
- `abandon` (either side): whatever the engine holds for a request, wherever it stands — a
  queued or running request is aborted, a live send or reservation given up; blocks the
  transport may still touch stay the scheduler's (`Scheduler.abandoned`, by transfer id) and
  their transfer is cancelled, so they are freed at its result, never earlier.
- `poll`: the transport's results applied to the scheduler (a send's blocks freed, a
  reservation RECEIVED or freed, an abandoned transfer's blocks freed) and returned as
  `HandoffOutcome`s by request id — for live hand-offs only: an abandoned one's RPCs were
  answered when it was given up.

Ids: a request has one id on a worker, its request id; the engine, the scheduler's sends and
reservations and every outcome key by it. The transfer id is the wire's (the ticket's, issued
by the decode worker as ``<worker id>/<epoch>/<request id>/<n>``, never parsed back): it tells
a live transfer of a request from an abandoned earlier one of the same request id (a router
retrying it here), whose blocks the scheduler keeps by transfer id until that transfer's
result.

What moves is whole blocks of the worker's KV cache, whatever they hold (full precision, or
int8 values with their scales): the two workers' `KVLayout`s must match (`check_ticket`,
`KVTransport.expect`), and the block count of a reservation is decided in one place
(`blocks_for`). Speculative decoding needs no more: a verified step writes positions ahead of
the request's tokens only up to its last possible KV position (the scheduler caps each
request's lookahead by its remaining `max_tokens`), so the reservation already covers them.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvtransfer.base import KVTransport
from kvtransfer.types import (
    LayoutMismatchError,
    TransferResult,
    blocks_needed,
    check_layout,
    new_ticket,
)
from model_runtime.request import Request, RequestOutput
from model_runtime.scheduler import Receive, Scheduler
from proto.pdserve.v1 import worker_pb2
from worker.convert import ticket_from_proto, ticket_to_proto

log = logging.getLogger(__name__)


class HandoffEngine(Protocol):
    """What the hand-off owner needs of an engine (`LLMEngine`, or the simulator's
    `SimEngine`): its scheduler (read at every call: a role switch replaces it) and a way to
    abort a request (which the engine may need to know of first)."""

    @property
    def scheduler(self) -> Scheduler: ...

    def abort_request(self, request_id: str) -> object: ...


class TransferRefused(Exception):
    """The transport refused to start a transfer; nothing is held for it. `layout`: the two
    workers' KV layouts differ (a configuration error: FAILED_PRECONDITION at the edge);
    else the ticket or the transport is at fault (INTERNAL)."""

    def __init__(self, message: str, layout: bool = False) -> None:
        super().__init__(message)
        self.layout = layout


class Outcome(enum.Enum):
    """What a live hand-off's transfer result means for its request."""

    SENT = "sent"  # prefill: the receiver has every layer; the blocks were freed
    SEND_FAILED = "send_failed"  # prefill: the blocks were freed; the receiver has nothing
    RECEIVED = "received"  # decode: every layer landed; `admit` the request
    RECEIVE_FAILED = "receive_failed"  # decode: the reservation's blocks were freed


@dataclass(frozen=True)
class HandoffOutcome:
    """One live hand-off's end, by request id, and the transport's result it came from (its
    transfer id, peer worker, bytes, layers, data plane and time; on failure, why)."""

    request_id: str
    outcome: Outcome
    result: TransferResult


class KVHandoff:
    """The hand-off owner of one worker (module docstring). Engine-thread only."""

    def __init__(self, engine: HandoffEngine, transport: KVTransport, epoch: int) -> None:
        """`epoch`: the worker process's epoch, put in the tickets it issues."""
        self.engine = engine
        self.transport = transport
        self.epoch = epoch
        self._seq = itertools.count()

    @property
    def _sched(self) -> Scheduler:
        return self.engine.scheduler

    # ---- decode side: receiving -------------------------------------------------------------

    def blocks_for(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """KV blocks a reservation takes: every position the request can ever write (the
        prompt and max_tokens - 1 outputs; the last token is never run)."""
        return blocks_needed(num_prompt_tokens + max_tokens - 1, self._sched.config.block_size)

    def reserve(
        self, request_id: str, num_prompt_tokens: int, max_tokens: int, lifetime_s: float
    ) -> worker_pb2.TransferTicket | None:
        """Blocks for the request's whole KV and the ticket the transport now expects for
        them (deadline `lifetime_s`); None when too few blocks are free. ValueError naming
        the field when the request could never fit the cache; `TransferRefused` (its blocks
        freed) when the transport refuses the ticket."""
        sched, transport = self._sched, self.transport
        need = self.blocks_for(num_prompt_tokens, max_tokens)
        total = sched.block_pool.num_blocks
        if need > total:
            raise ValueError(
                f"request {request_id!r} needs {need} KV blocks, the cache has {total}"
            )
        tid = f"{transport.endpoint.worker_id}/{self.epoch}/{request_id}/{next(self._seq)}"
        blocks = sched.reserve_remote(request_id, tid, need)
        if blocks is None:
            return None
        try:
            ticket = new_ticket(
                transport.endpoint,
                transport.layout,
                request_id,
                blocks,
                num_prompt_tokens,
                lifetime_s,
                transfer_id=tid,
                epoch=self.epoch,
            )
            transport.expect(ticket)
        except ValueError as exc:
            sched.remote_result(request_id, ok=False)  # refused: freed as a failed transfer
            refused = isinstance(exc, LayoutMismatchError)
            raise TransferRefused(f"expect failed: {exc}", layout=refused) from exc
        return ticket_to_proto(ticket)

    def receive_state(self, request_id: str) -> Receive | None:
        """Where the request's reservation stands; None: none (never reserved, ended, or its
        request was admitted)."""
        return self._sched.remote_state(request_id)

    def admit(self, request: Request, first_token: int) -> RequestOutput | None:
        """The RECEIVED blocks of `request.request_id`'s reservation go to `request` (a
        prefilled request, `LLMEngine.prefilled_request`), whose first token is
        `first_token`; its final output if that token already ends it. ValueError (nothing
        taken over, the reservation stays RECEIVED) when the blocks cannot hold it."""
        return self._sched.admit_remote(request, first_token)

    # ---- prefill side: sending --------------------------------------------------------------

    def check_ticket(
        self, request_id: str, num_prompt_tokens: int, ticket: worker_pb2.TransferTicket
    ) -> None:
        """Whether `ticket` can carry `request_id`'s prompt from this worker: ValueError naming
        the field when it is malformed or for another prompt; `TransferRefused` (layout) when
        the decode worker's KV layout differs from this one's."""
        t = ticket_from_proto(ticket)
        here = self.transport
        try:
            check_layout(
                here.layout,
                t.layout,
                f"prefill {here.endpoint.worker_id}",
                f"decode {t.receiver.worker_id}",
            )
        except LayoutMismatchError as exc:
            raise TransferRefused(str(exc), layout=True) from exc
        if t.num_tokens != num_prompt_tokens:
            raise ValueError(
                f"ticket.num_tokens {t.num_tokens} != prompt length {num_prompt_tokens}"
            )
        if t.request_id and t.request_id != request_id:
            raise ValueError(f"ticket is for request {t.request_id!r}, not {request_id!r}")

    def open_send(
        self, request_id: str, ticket: worker_pb2.TransferTicket, block_table: Sequence[int]
    ) -> None:
        """The running request's prompt KV (the first blocks of `block_table`) starts moving
        to `ticket`'s receiver, and its blocks stay held past its end until the transport's
        result, as one step. `TransferRefused` when the transport refuses: nothing is held,
        and the blocks are freed as the step ends the request."""
        try:
            t = ticket_from_proto(ticket)
            if not t.request_id:  # results carry it: the request's own id, never another
                t = dataclasses.replace(t, request_id=request_id)
            self.transport.open(t, block_table[: t.num_blocks])
        except ValueError as exc:
            refused = isinstance(exc, LayoutMismatchError)
            raise TransferRefused(f"could not open KV transfer: {exc}", layout=refused) from exc
        self._sched.open_send(request_id, t.transfer_id)

    def layer_sender(self, request_ids: Sequence[str]) -> Callable[[int], None]:
        """The runner's `on_layer_done` for a step that opened the sends of `request_ids`:
        each layer leaves as soon as its forward is done."""
        sending = self._sched.sending
        transfer_ids = [sending[rid].transfer_id for rid in request_ids]
        transport = self.transport

        def on_layer_done(layer: int) -> None:
            for tid in transfer_ids:
                transport.send_layer(tid, layer)

        return on_layer_done

    def sending(self, request_id: str) -> bool:
        """Whether a live send reads the request's blocks."""
        return request_id in self._sched.sending

    # ---- both sides ---------------------------------------------------------------------------

    def abandon(self, request_id: str) -> None:
        """Give up whatever the engine holds for `request_id`: its reservation (RECEIVED
        blocks freed now, RECEIVING ones at the transfer's result), its queued or running
        request (aborted; an open send's blocks freed at its result), its finished request's
        send (freed at its result). A transfer still in flight is cancelled. Nothing held:
        nothing happens. The request id is free again at once."""
        sched = self._sched
        if request_id in sched.remote:
            tid = sched.remote[request_id].transfer_id
            if sched.abandon_remote(request_id):
                self.transport.cancel(tid)
            return
        send = sched.sending.get(request_id)
        if request_id in sched.requests:
            self.engine.abort_request(request_id)  # an open send's blocks: abandoned
        elif send is not None:
            sched.abandon_send(request_id)
        if send is not None:
            self.transport.cancel(send.transfer_id)

    def poll(self) -> tuple[list[HandoffOutcome], list[TransferResult]]:
        """Advance the transport, apply every result to the scheduler; the outcomes of live
        hand-offs (by request id), and every raw result (for metrics)."""
        results = self.transport.poll()
        outcomes = [out for out in map(self._apply, results) if out is not None]
        return outcomes, results

    def _apply(self, r: TransferResult) -> HandoffOutcome | None:
        sched = self._sched
        if r.transfer_id in sched.abandoned:
            sched.release_abandoned(r.transfer_id)  # its request's RPCs were answered
            return None
        if r.role == "send":
            send = sched.sending.get(r.request_id)
            if send is None or send.transfer_id != r.transfer_id:
                log.error("transfer result for no send of this worker: %s", r)
                return None
            sched.send_result(r.request_id)  # frees the blocks, ok or not
            outcome = Outcome.SENT if r.ok else Outcome.SEND_FAILED
        else:
            kv = sched.remote.get(r.request_id)
            if kv is None or kv.transfer_id != r.transfer_id:
                log.error("transfer result for no reservation of this worker: %s", r)
                return None
            received = sched.remote_result(r.request_id, r.ok)  # RECEIVED, or freed
            outcome = Outcome.RECEIVED if received else Outcome.RECEIVE_FAILED
        return HandoffOutcome(r.request_id, outcome, r)

    # ---- what the engine thread reads -------------------------------------------------------

    def in_flight(self) -> bool:
        """A transfer may still report: a send, an abandoned transfer, a RECEIVING
        reservation (the engine thread polls more often then)."""
        sched = self._sched
        if sched.sending or sched.abandoned:
            return True
        return any(kv.state is Receive.RECEIVING for kv in sched.remote.values())

    def num_abandoned(self) -> int:
        """Transfers given up whose result is still to come (a drain waits for them)."""
        return len(self._sched.abandoned)

    def num_abandoned_blocks(self) -> int:
        """Blocks of transfers given up in flight: back once their results come (a decode
        worker's Reserve may wait for them: `decode_worker.decode`)."""
        return sum(len(a.block_ids) for a in self._sched.abandoned.values())

    def num_reserved(self) -> int:
        """Live reservations: requests waiting for their KV or their Decode (status: waiting)."""
        return len(self._sched.remote)

    def num_receiving(self) -> int:
        """Of `num_reserved`: those whose KV has not arrived yet (status: `num_receiving`)."""
        return sum(1 for kv in self._sched.remote.values() if kv.state is Receive.RECEIVING)

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        """`KVTransport.set_waker`: `waker` runs whenever `poll` may have news."""
        self.transport.set_waker(waker)

    def close(self) -> None:
        """Close the transport: transfers in flight fail (their results come from `poll`)."""
        self.transport.close()
