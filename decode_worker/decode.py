"""Decode role, remote-prefill part: reserve KV blocks, receive a prompt's KV, then decode.

Runs in the engine thread of a decode worker, as one part of its "decode" role
(`worker_main.ROLES`). Every step of the KV hand-off is the worker's hand-off owner's
(`worker.kv_handoff.KVHandoff`); this role only turns RPCs into hand-off calls and outcomes
into answers. One request's life here::

    Reserve ──> TRANSFERRING ──RECEIVED──> READY ──Decode──> DECODING ──finished──> gone
                    │   ^ Decode may arrive here too: admitted when the KV is in
                    └──RECEIVE_FAILED──> blocks freed, Decode answers UNAVAILABLE

1. `Reserve` takes blocks for every KV position the request can ever write (prompt +
   max_tokens - 1) and a ticket the transport expects (`KVHandoff.reserve`).
   RESOURCE_EXHAUSTED when the blocks are short — unless blocks of doomed work will come back
   soon: those of transfers given up while in flight (freed at their result), of reservations
   past or near their lifetime, of requests past or near their deadline. Then the Reserve
   *waits* (`_WaitingReserve`, first come first served, retried every engine iteration after
   the expiries) until its blocks are free, at most `RESERVE_WAIT_S` and never past its own
   deadline, and is refused only when no doomed block is left to wait for: a normal request
   does not fail while a deadline storm's requests still hold its blocks, and a pool full of
   live work still refuses at once.
   *Trade-off:* booking the worst case up front means a decode worker never preempts (a
   request admitted here always runs to its end at one token per step), at the price of
   blocks that sit idle when a request stops early (EOS) — capacity is booked, not used.
2. The transport writes the layers; the outcome (`on_handoff`) makes the reservation READY,
   or fails it: the reserved blocks were freed and a waiting `Decode` answers UNAVAILABLE
   naming the transfer and why.
3. `Decode` (prompt, first token, sampling) hands the blocks to the engine as an
   already-prefilled request (`KVHandoff.admit`); it then streams the tokens after the first
   one (the router already sent that). The first chunk carries `admission_ms` (Decode arrival
   until the step that ran it: transfer wait + admission) and `first_step_ms`.
4. A reservation with no `Decode` within its `timeout_s` is released, and a late `Decode`
   gets DEADLINE_EXCEEDED, also when the transfer's own deadline (never earlier than the
   reservation's) is what noticed it. `Abort` or a cancelled RPC releases it from any state
   (`KVHandoff.abandon`: a transfer still in flight is cancelled and its blocks are freed
   when its result arrives); the request id is free for a new `Reserve` at once (a router
   retrying after an abort reuses it).

A request that ended without decoding leaves a short-lived tombstone, so a late `Decode`
gets the reason (transfer failed, expired, aborted) instead of "no reservation".

State: the engine scheduler owns each request's state and blocks, not this role: the diagram's
TRANSFERRING and READY are its reservation's RECEIVING and RECEIVED
(`KVHandoff.receive_state`), DECODING is the engine request. This role keeps two maps of RPC
data, neither of them block state: request id -> `_Reservation` (the Reserve and Decode calls'
sinks, ticket, lifetime and deadline: what answering needs, from Reserve until the request
ends), the tombstones (request id -> the error a late `Decode` gets) and the waiting
Reserves (their RPC data; they hold no block).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from model_runtime.limits import check_context
from model_runtime.request import RequestOutput
from model_runtime.sampling_params import SamplingParams
from model_runtime.scheduler import Receive
from proto.pdserve.v1 import worker_pb2
from worker.convert import sampling_from_proto, token_chunk
from worker.kv_handoff import HandoffOutcome, Outcome, TransferRefused
from worker.roles import RoleHandler, Rpc, ms
from worker.sinks import Sink, StreamSink, UnarySink, WorkerError

log = logging.getLogger(__name__)

TOMBSTONE_TTL_S = 60.0
RESERVE_WAIT_S = 5.0
"""Longest a Reserve waits for the blocks of doomed work (module docstring, step 1)."""


@dataclass
class _WaitingReserve:
    """A Reserve waiting for blocks that doomed work will give back (module docstring)."""

    req: worker_pb2.ReserveRequest
    sink: UnarySink
    since: float  # when it came
    until: float  # refused from then on (at most `RESERVE_WAIT_S`)
    deadline: float  # the request's own: expired from then on


@dataclass
class _DecodeCall:
    sink: StreamSink
    deadline: float
    arrival: float
    prompt: list[int]
    first_token: int
    params: SamplingParams
    num_sampled: int  # tokens sampled before the prompt's first_token, elsewhere (migration)


@dataclass
class _Reservation:
    """The RPCs of one request from Reserve until it ends (its blocks are the scheduler's)."""

    ticket: worker_pb2.TransferTicket
    max_tokens: int
    expires: float  # released if no Decode arrives by then
    reserve_sink: UnarySink
    decode: _DecodeCall | None = None


class RemoteDecodeRole(RoleHandler):
    """`Reserve` + `Decode` for requests prefilled on a prefill worker (see the module
    docstring); one part of the worker's "decode" role (`worker_main.ROLES`)."""

    name = "decode-remote"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._res: dict[str, _Reservation] = {}  # the RPCs of live requests, by request id
        self._gone: dict[str, tuple[WorkerError, float]] = {}  # tombstones: (error, until)
        self._waiting: dict[str, _WaitingReserve] = {}  # FIFO: Reserves waiting for blocks

    # ---- RPCs --------------------------------------------------------------------------------

    def reserve(
        self, req: worker_pb2.ReserveRequest, sink: UnarySink, timeout_s: float | None
    ) -> None:
        """`Reserve`: blocks for the request's whole KV and a ticket for them, answered at
        once — or, when the blocks are short but doomed work will give enough back, once they
        are (module docstring, step 1); RESOURCE_EXHAUSTED otherwise."""
        rid, n, m = req.request_id, req.num_prompt_tokens, req.max_tokens
        if not rid:
            raise self.invalid(ValueError("request_id is empty"))
        if rid in self._res or rid in self._waiting:
            raise self.duplicate(rid)
        life = timeout_s or self.ctx.transfer_timeout_s
        try:
            check_context(rid, n, m, self.engine.model_config.max_position_embeddings)
        except ValueError as exc:
            raise self.invalid(exc) from exc
        now = time.monotonic()
        if not self._waiting and self._take(req, sink, life):
            return
        until = min(now + life, now + RESERVE_WAIT_S)
        need = self.handoff.blocks_for(n, m)
        if self._coming_back(until) + self.engine.block_pool.num_free < need:
            raise self._short(req)
        self._waiting[rid] = _WaitingReserve(req, sink, now, until, now + life)

    def _take(self, req: worker_pb2.ReserveRequest, sink: UnarySink, life: float) -> bool:
        """Reserve now and answer `sink`; False (nothing answered) when the blocks are short."""
        rid, n, m = req.request_id, req.num_prompt_tokens, req.max_tokens
        # Read before the transport's clock starts: the reservation expires no later than its
        # transfer's deadline, so a transfer that times out with no Decode call is always seen
        # as the reservation's expiry.
        started = time.monotonic()
        try:
            ticket = self.handoff.reserve(rid, n, m, life)
        except ValueError as exc:
            raise self.invalid(exc) from exc
        except TransferRefused as exc:
            raise WorkerError(grpc.StatusCode.INTERNAL, str(exc)) from exc
        if ticket is None:
            return False
        self._res[rid] = _Reservation(ticket, m, started + ticket.timeout_ms / 1000, sink)
        self._gone.pop(rid, None)
        sink.set(worker_pb2.ReserveResponse(ticket=ticket))
        return True

    def _short(self, req: worker_pb2.ReserveRequest, waited_s: float = 0.0) -> WorkerError:
        """RESOURCE_EXHAUSTED for a Reserve whose blocks are short (live work holds them)."""
        n, m = req.num_prompt_tokens, req.max_tokens
        waited = f" after waiting {waited_s:.2f} s" if waited_s else ""
        return WorkerError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"decode worker {self.ctx.worker_id}: request {req.request_id!r} needs "
            f"{self.handoff.blocks_for(n, m)} KV blocks (prompt {n} + max_tokens {m}), "
            f"{self.engine.block_pool.num_free} free{waited}",
        )

    def _coming_back(self, by: float) -> int:
        """Blocks that doomed work gives back by `by` without anyone's help: transfers given
        up in flight (at their result), reservations whose lifetime ends and requests whose
        deadline passes by then (at the next expiry sweep)."""
        blocks = self.handoff.num_abandoned_blocks()
        for res in self._res.values():
            ends = res.expires if res.decode is None else res.decode.deadline
            if ends <= by:
                blocks += len(res.ticket.block_ids)
        return blocks

    def _serve_waiting(self, now: float) -> None:
        """The waiting Reserves, first come first served: each takes its blocks, waits on, or
        is refused (no doomed block left to wait for, or its wait is over)."""
        for rid, w in list(self._waiting.items()):
            try:
                if now >= w.deadline:
                    raise self.expired(rid, "waiting for KV blocks")
                if self._take(w.req, w.sink, w.deadline - now):
                    del self._waiting[rid]
                    continue
                need = self.handoff.blocks_for(w.req.num_prompt_tokens, w.req.max_tokens)
                coming = self._coming_back(w.until) + self.engine.block_pool.num_free
                if now < w.until and coming >= need:
                    return  # first come first served: the ones behind wait too
                raise self._short(w.req, now - w.since)
            except WorkerError as error:  # answered here: never raised into the engine loop
                del self._waiting[rid]
                w.sink.fail(error)

    def decode(
        self, req: worker_pb2.DecodeRequest, sink: StreamSink, timeout_s: float | None
    ) -> None:
        """`Decode`: run the reservation's request once its KV is in; tokens stream to
        `sink`."""
        rid = req.request_id
        res = self._res.get(rid)
        if res is None:
            gone = self._gone.get(rid)
            if gone is not None:
                raise gone[0]
            raise WorkerError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no reservation for request {rid!r} on decode worker {self.ctx.worker_id}",
            )
        if req.transfer_id != res.ticket.transfer_id:
            raise WorkerError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"request {rid!r}: transfer_id {req.transfer_id!r} is not the reservation's "
                f"{res.ticket.transfer_id!r}",
            )
        if res.decode is not None:
            raise self.duplicate(rid)
        try:
            params = sampling_from_proto(req.sampling, self.engine.model_config.vocab_size)
            if len(req.prompt_token_ids) != res.ticket.num_tokens:
                raise ValueError(
                    f"prompt has {len(req.prompt_token_ids)} tokens, the reservation "
                    f"{res.ticket.num_tokens}"
                )
            if params.max_tokens > res.max_tokens:
                raise ValueError(
                    f"max_tokens {params.max_tokens} exceeds the reserved {res.max_tokens}"
                )
        except ValueError as exc:
            raise self.invalid(ValueError(f"request {rid!r}: {exc}")) from exc
        now = time.monotonic()
        deadline = now + timeout_s if timeout_s else self.deadline(None)
        prompt = list(req.prompt_token_ids)
        res.decode = _DecodeCall(
            sink, deadline, sink.created, prompt, req.first_token, params, req.sampling.num_sampled
        )
        res.expires = math.inf  # the Decode deadline governs from now on
        if self.handoff.receive_state(rid) is Receive.RECEIVED:
            self._admit(rid, res)

    def _admit(self, rid: str, res: _Reservation) -> None:
        d = res.decode
        state = self.handoff.receive_state(rid)
        assert d is not None and state is Receive.RECEIVED, (rid, state)
        try:
            request = self.engine.prefilled_request(
                rid, d.prompt, d.first_token, d.params, d.num_sampled
            )
            out = self.handoff.admit(request, d.first_token)
        except ValueError as exc:  # nothing was taken over
            error = self.invalid(exc)
            self.handoff.abandon(rid)
            d.sink.fail(error)
            self._end(rid, error)
            return
        if out is not None:  # the first token already ends the request
            d.sink.put(
                worker_pb2.TokenChunk(
                    finished=True,
                    finish_reason=out.finish_reason or "",
                    admission_ms=ms(time.monotonic() - d.arrival),
                )
            )
            self._end(rid, None)

    # ---- engine-thread events ----------------------------------------------------------------

    def on_outputs(self, outputs: Sequence[RequestOutput], started: float, ended: float) -> None:
        for out in outputs:
            res = self._res[out.request_id]
            assert res.decode is not None, out.request_id
            chunk = token_chunk(out, res.decode.params.logprobs is not None)
            if res.decode.sink.num_chunks == 0:
                chunk.admission_ms = ms(started - res.decode.arrival)
                chunk.first_step_ms = ms(ended - started)
            res.decode.sink.put(chunk)
            if out.finished:
                self._end(out.request_id, None)

    def on_handoff(self, outcomes: Sequence[HandoffOutcome]) -> None:
        self._handoff_outcomes(outcomes)
        if self._waiting:  # a result may have freed blocks (an abandoned transfer's too)
            self._serve_waiting(time.monotonic())

    def _handoff_outcomes(self, outcomes: Sequence[HandoffOutcome]) -> None:
        for o in outcomes:
            rid, r = o.request_id, o.result
            res = self._res[rid]  # a live reservation's RPCs are open until it ends
            if o.outcome is Outcome.RECEIVED:
                if res.decode is not None:
                    self._admit(rid, res)
            elif res.decode is None and time.monotonic() >= res.expires:
                self._end(rid, self._expiry(res))  # ran out with its reservation: no one came
            else:
                error = WorkerError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"KV transfer {r.transfer_id} for request {rid!r} failed: {r.error}; its "
                    f"{len(res.ticket.block_ids)} reserved blocks on decode worker "
                    f"{self.ctx.worker_id} were freed",
                    failed_peer=r.peer if r.peer != "?" else "",
                )
                if res.decode is not None:
                    res.decode.sink.fail(error)
                self._end(rid, error)

    def expire(self, now: float) -> None:
        for rid, res in list(self._res.items()):
            if res.decode is None and now >= res.expires:
                self.abort(rid, None, self._expiry(res))
            elif res.decode is not None and now >= res.decode.deadline:
                receiving = self.handoff.receive_state(rid) is not None
                what = "waiting for the KV transfer" if receiving else "decoding"
                self.abort(rid, None, self.expired(rid, what))
        for rid, (_, until) in list(self._gone.items()):
            if now >= until:
                del self._gone[rid]
        if self._waiting:  # after the sweep: the expired ones' blocks are back
            self._serve_waiting(now)

    def _expiry(self, res: _Reservation) -> WorkerError:
        """What a late `Decode` of a reservation that outlived its lifetime gets."""
        life = res.ticket.timeout_ms / 1000
        return WorkerError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"reservation for request {res.ticket.request_id!r} on decode worker "
            f"{self.ctx.worker_id} expired: no Decode call within {life:.3f} s; its blocks were "
            "released",
        )

    def abort(self, request_id: str, sink: Sink | None, error: WorkerError) -> bool:
        waiting = self._waiting.get(request_id)
        if waiting is not None and (sink is None or sink is waiting.sink):
            del self._waiting[request_id]  # it holds no block yet
            waiting.sink.fail(error)
            return True
        res = self._res.get(request_id)
        if res is None:
            return False
        decode_sink = res.decode.sink if res.decode is not None else None
        if sink is not None and sink is not res.reserve_sink and sink is not decode_sink:
            return False
        if decode_sink is not None:
            decode_sink.fail(error)
        self.handoff.abandon(request_id)  # blocks a transfer still writes: freed at its result
        self._end(request_id, error)
        return True

    # ---- bookkeeping -------------------------------------------------------------------------

    def _end(self, request_id: str, error: WorkerError | None) -> None:
        del self._res[request_id]
        if error is not None:
            self._gone[request_id] = (error, time.monotonic() + TOMBSTONE_TTL_S)

    def request_ids(self) -> list[str]:
        return [*self._res, *self._waiting]

    def holds(self, request_id: str) -> bool:
        return request_id in self._res or request_id in self._waiting

    rpcs = (
        # A reservation only takes free blocks and registers a ticket: safe in the middle of a
        # step, and the router's Prefill (hence TTFT) waits for it.
        Rpc("Reserve", reserve, worker_pb2.ReserveRequest, UnarySink, between_layers=True),
        # A Decode continues a reservation: served while draining.
        Rpc("Decode", decode, worker_pb2.DecodeRequest, StreamSink, new_work=False),
    )
