"""Decode role: reserve KV blocks, receive a prompt's KV, then decode with continuous batching.

Runs in the engine thread of a decode worker. One request's life here::

    Reserve ──> TRANSFERRING ──poll ok──> READY ──Decode──> DECODING ──finished──> gone
                    │   ^ Decode may arrive here too: admitted when the result is ok
                    └──poll failed──> blocks freed, Decode answers UNAVAILABLE

1. `Reserve` allocates blocks for every KV position the request can ever write (prompt +
   max_tokens - 1), builds a ticket addressed to this worker's transport and calls
   ``transport.expect(ticket)``. RESOURCE_EXHAUSTED when the blocks are short.
   *Trade-off:* booking the worst case up front means a decode worker never preempts (a
   request admitted here always runs to its end at one token per step), at the price of
   blocks that sit idle when a request stops early (EOS) — capacity is booked, not used.
2. The transport writes the layers; its result (``poll()``) makes the reservation READY, or
   fails it: the reserved blocks are freed exactly once and a waiting `Decode` answers
   UNAVAILABLE naming the transfer and why.
3. `Decode` (prompt, first token, sampling) hands the blocks to the engine as an
   already-prefilled request (`LLMEngine.add_prefilled_request`); it then streams the tokens
   after the first one (the router already sent that). The first chunk carries `admission_ms`
   (Decode arrival until the step that ran it: transfer wait + admission) and
   `first_step_ms`.
4. A reservation with no `Decode` within its `timeout_s` is released, and a late `Decode`
   gets DEADLINE_EXCEEDED, also when the transfer's own deadline (never earlier than the
   reservation's) is what noticed it. `Abort` or a cancelled RPC releases it from any state.
   A transfer still in flight is cancelled first and its blocks are freed when its result
   arrives (the transport's ownership rule); the request id is free for a new `Reserve` at
   once (a router retrying after an abort reuses it).

A request that ended without decoding leaves a short-lived tombstone, so a late `Decode`
gets the reason (transfer failed, expired, aborted) instead of "no reservation".

Block ownership is the engine scheduler's, not this role's: the reserved blocks are a
"receiving KV" reservation (`Scheduler.reserve_remote`, keyed by transfer id) that the
transport's result makes RECEIVED or frees, that `abandon_remote` gives up (at the result when
the transfer is still in flight) and that `admit_received` hands to the decoding request; the
scheduler frees each exactly once. This role maps requests and RPCs onto those states.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvtransfer.types import TransferResult, TransferTicket, blocks_needed, new_ticket
from model_runtime.limits import check_context
from model_runtime.request import RequestOutput
from model_runtime.sampling_params import SamplingParams
from proto.pdserve.v1 import worker_pb2
from worker.convert import logprobs_to_proto, sampling_from_proto, ticket_to_proto
from worker.roles import RoleHandler, ms
from worker.sinks import Sink, StreamSink, UnarySink, WorkerError

log = logging.getLogger(__name__)

TOMBSTONE_TTL_S = 60.0


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
    ticket: TransferTicket
    block_ids: list[int]
    max_tokens: int
    expires: float  # released if no Decode arrives by then
    reserve_sink: UnarySink
    state: str = "transferring"  # -> "ready" -> "decoding"
    decode: _DecodeCall | None = None
    cancelled: WorkerError | None = None  # given up while the transfer is in flight


class DecodeRole(RoleHandler):
    """`Reserve` + `Decode` (see the module docstring)."""

    name = "decode"
    methods = frozenset({"Reserve", "Decode"})
    new_work = frozenset({"Reserve"})  # a Decode continues a reservation: served while draining
    # A reservation only takes free blocks and registers a ticket: safe in the middle of a
    # step, and the router's Prefill (hence TTFT) waits for it.
    between_layers = frozenset({"Reserve"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._res: dict[str, _Reservation] = {}  # live reservations by request id
        self._by_tid: dict[str, _Reservation] = {}  # transfers in flight, cancelled ones too
        self._gone: dict[str, tuple[WorkerError, float]] = {}

    # ---- RPCs --------------------------------------------------------------------------------

    def handle(self, method: str, request: Any, sink: Sink, timeout_s: float | None) -> None:
        if method == "Reserve":
            assert isinstance(sink, UnarySink), sink
            self._reserve(request, sink, timeout_s)
        else:
            assert method == "Decode" and isinstance(sink, StreamSink), (method, sink)
            self._decode(request, sink, timeout_s)

    def _reserve(
        self, req: worker_pb2.ReserveRequest, sink: UnarySink, timeout_s: float | None
    ) -> None:
        rid, n, m = req.request_id, req.num_prompt_tokens, req.max_tokens
        if not rid:
            raise self.invalid(ValueError("request_id is empty"))
        if rid in self._res or rid in self.engine.scheduler.requests:
            raise self.duplicate(rid)
        try:
            check_context(rid, n, m, self.engine.model_config.max_position_embeddings)
        except ValueError as exc:
            raise self.invalid(exc) from exc
        pool = self.engine.block_pool
        need = blocks_needed(n + m - 1, self.engine.config.block_size)
        if need > pool.num_blocks:
            raise self.invalid(
                ValueError(
                    f"request {rid!r} needs {need} KV blocks, the cache has {pool.num_blocks}"
                )
            )
        tid = f"{self.ctx.transport.endpoint.worker_id}/{uuid.uuid4().hex}"
        blocks = self.engine.scheduler.reserve_remote(tid, need)
        if blocks is None:
            raise WorkerError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"decode worker {self.ctx.worker_id}: request {rid!r} needs {need} KV blocks "
                f"(prompt {n} + max_tokens {m}), {pool.num_free} free",
            )
        life = timeout_s or self.ctx.transfer_timeout_s
        transport = self.ctx.transport
        # Read before `expect` starts the transport's clock: the reservation expires no later
        # than its transfer's deadline, so a transfer that times out with no Decode call is
        # always seen as the reservation's expiry.
        started = time.monotonic()
        try:
            ticket = new_ticket(
                transport.endpoint,
                transport.layout,
                rid,
                blocks,
                n,
                life,
                transfer_id=tid,
                epoch=self.ctx.epoch,
            )
            transport.expect(ticket)
        except ValueError as exc:
            self.engine.scheduler.remote_result(tid, ok=False)  # refused: a failed transfer
            raise WorkerError(grpc.StatusCode.INTERNAL, f"expect failed: {exc}") from exc
        res = _Reservation(ticket, blocks, m, started + ticket.timeout_ms / 1000, sink)
        self._res[rid] = res
        self._by_tid[ticket.transfer_id] = res
        self._gone.pop(rid, None)
        sink.set(worker_pb2.ReserveResponse(ticket=ticket_to_proto(ticket)))

    def _decode(
        self, req: worker_pb2.DecodeRequest, sink: StreamSink, timeout_s: float | None
    ) -> None:
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
        if res.state == "ready":
            self._admit(res)

    def _admit(self, res: _Reservation) -> None:
        d = res.decode
        assert d is not None and res.state == "ready", res.state
        rid = res.ticket.request_id
        tid = res.ticket.transfer_id
        try:
            out = self.engine.admit_received(
                tid, rid, d.prompt, d.first_token, d.params, d.num_sampled
            )
        except ValueError as exc:  # nothing was taken over
            error = self.invalid(exc)
            self.engine.scheduler.abandon_remote(tid)
            d.sink.fail(error)
            self._end(rid, error)
            return
        res.state = "decoding"  # the engine owns the blocks now
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
            assert res.decode is not None and res.state == "decoding", res.state
            chunk = worker_pb2.TokenChunk(
                token_ids=list(out.new_token_ids),
                finished=out.finished,
                finish_reason=out.finish_reason or "",
            )
            if res.decode.params.logprobs is not None:
                chunk.logprobs.extend(logprobs_to_proto(out.new_logprobs()))
            if res.decode.sink.num_chunks == 0:
                chunk.admission_ms = ms(started - res.decode.arrival)
                chunk.first_step_ms = ms(ended - started)
            res.decode.sink.put(chunk)
            if out.finished:
                self._end(out.request_id, None)

    def on_transfer_results(self, results: Sequence[TransferResult]) -> None:
        for r in results:
            res = self._by_tid.pop(r.transfer_id, None)
            if res is None or r.role != "recv":
                log.error("transfer result for no reservation of this worker: %s", r)
                continue
            rid = res.ticket.request_id
            received = self.engine.scheduler.remote_result(r.transfer_id, r.ok)
            if res.cancelled is not None:  # already out of `_res`, its RPCs answered
                assert not received, r  # an abandoned reservation is freed at its result
            elif received:
                res.state = "ready"
                if res.decode is not None:
                    self._admit(res)
            elif res.decode is None and time.monotonic() >= res.expires:
                self._end(rid, self._expiry(res))  # ran out with its reservation: no one came
            else:
                error = WorkerError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"KV transfer {r.transfer_id} for request {rid!r} failed: {r.error}; its "
                    f"{len(res.block_ids)} reserved blocks on decode worker "
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
                what = "decoding" if res.state == "decoding" else "waiting for the KV transfer"
                self.abort(rid, None, self.expired(rid, what))
        for rid, (_, until) in list(self._gone.items()):
            if now >= until:
                del self._gone[rid]

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
        res = self._res.get(request_id)
        if res is None:
            return False
        decode_sink = res.decode.sink if res.decode is not None else None
        if sink is not None and sink is not res.reserve_sink and sink is not decode_sink:
            return False
        if decode_sink is not None:
            decode_sink.fail(error)
        if res.state == "transferring":
            res.cancelled = error
            self.engine.scheduler.abandon_remote(res.ticket.transfer_id)  # freed at its result
            self.ctx.transport.cancel(res.ticket.transfer_id)
            del self._res[request_id]  # stays in `_by_tid` until then
            self._gone[request_id] = (error, time.monotonic() + TOMBSTONE_TTL_S)
        elif res.state == "ready":
            self.engine.scheduler.abandon_remote(res.ticket.transfer_id)  # RECEIVED: freed now
            self._end(request_id, error)
        else:
            self.engine.abort_request(request_id)  # frees the blocks it took over
            self._end(request_id, error)
        return True

    # ---- bookkeeping -------------------------------------------------------------------------

    def _end(self, request_id: str, error: WorkerError | None) -> None:
        res = self._res.pop(request_id)
        self._by_tid.pop(res.ticket.transfer_id, None)
        if error is not None:
            self._gone[request_id] = (error, time.monotonic() + TOMBSTONE_TTL_S)

    def _all(self) -> list[_Reservation]:
        """Live reservations and cancelled ones whose transfer result is still to come."""
        cancelled = [r for r in self._by_tid.values() if r.cancelled is not None]
        return [*self._res.values(), *cancelled]

    def request_ids(self) -> list[str]:
        return list(self._res)

    def num_active(self) -> int:
        return len(self._all())

    def transfers_in_flight(self) -> bool:
        return bool(self._by_tid)

    def num_pending(self) -> int:
        return sum(1 for r in self._res.values() if r.state != "decoding")
