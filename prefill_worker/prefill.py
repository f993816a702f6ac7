"""Prefill role: run prompts, push their KV into a decode worker's blocks, return the first token.

Runs in the engine thread of a prefill worker. Batching is the colocated scheduler's (token
budget, chunked prefill, local prefix-cache reuse); each request enters it with max_tokens=1,
so it finishes with its first token, and its open transfer (`Scheduler.open_send`) keeps its
blocks. One request's life here:

1. `Prefill` validates the ticket (layout, token count) and queues the prompt.
2. In the step that runs the request's *last* chunk, `before_forward` calls
   ``transport.open(ticket, prompt blocks)`` (then `Scheduler.open_send`; an open that
   raises answers the RPC at once, and the blocks are freed as the step finishes the
   request) and the runner's ``on_layer_done(l)`` calls
   ``send_layer(transfer_id, l)``: layer l leaves while layers l+1.. still compute. Prefix-cached
   blocks are sent like the rest: the decode worker gets the whole prompt's KV.
3. The step samples the first token. The blocks stay held (the transport may still read them)
   until ``poll()`` returns the transfer's result; then they are released exactly once and the
   RPC answers: ok -> `PrefillResponse` (first_token, cached_tokens, queue/compute/transfer
   ms, finished + finish_reason if the first token already ends the request), failed ->
   UNAVAILABLE naming the transfer and why.

*First token ends the request* (EOS / stop token / max_tokens 1): the transfer is never
cancelled for that — its layers are already on the way when the token is sampled — so the
answer still waits for the transfer's result and says ``finished=True``; the router then
aborts the decode side's reservation.

`Abort`, a cancelled RPC or the request deadline: before the last step the request is simply
aborted in the engine (blocks freed at once); once the transfer is open it is cancelled, the
RPC answers at once, and the blocks are freed when the cancelled transfer's result arrives.
The request id is free again at once: inside the engine a job runs under its own id
(``<request id>#<n>``), so a router retrying the same request here never collides with a
cancelled predecessor whose blocks are still held.

State: the engine scheduler owns each request's state and blocks — queued or running, then
"sending KV" (`Scheduler.open_send`: SENDING, or ABANDONED once cancelled) until the
transport's result frees the blocks (`Scheduler.send_result`, exactly once). This role keeps one
map, request id -> `_PrefillCall`: the open RPC's sink, ticket, sampling params and timings,
which is what answering needs and nothing the scheduler knows; a call leaves it when its RPC is
answered (a cancelled request's blocks stay with the scheduler's ABANDONED send).

Timings: queue_ms = the RPC's arrival (its sink's creation, on the gRPC loop) until the
request's first step — so it includes the wait for the engine thread to finish its current
step; compute_ms = first step start
until the end of the step that sampled the first token (chunked prefill included);
transfer_ms = that end until the transfer's result was known; kv_total_ms = the transfer's own
time (its open, in the last step, to its result), with its bytes, layers and data plane
(`TransferResult`): what the worker's trace span of the transfer shows (`worker.tracing`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvtransfer.types import LayoutMismatchError, TransferResult, TransferTicket, check_layout
from model_runtime.engine import LayerCallback
from model_runtime.limits import check_context
from model_runtime.request import RequestOutput, stop_reason
from model_runtime.sampling_params import SamplingParams
from model_runtime.scheduler import SchedulerOutput, Send, SendingKV
from proto.pdserve.v1 import worker_pb2
from worker.convert import logprobs_to_proto, sampling_from_proto, ticket_from_proto
from worker.roles import RoleHandler, Rpc, ms
from worker.sinks import Sink, UnarySink, WorkerError

log = logging.getLogger(__name__)


@dataclass
class _PrefillCall:
    """One unanswered Prefill RPC: what answering it needs (not block state: see the module
    docstring)."""

    request_id: str
    engine_id: str  # the engine request's id: unique per call
    sink: UnarySink
    ticket: TransferTicket
    params: SamplingParams  # the request's own (max_tokens, stop ids): decide `finished`
    deadline: float
    arrival: float
    first_scheduled: float | None = None
    compute_end: float | None = None
    output: RequestOutput | None = None


class PrefillRole(RoleHandler):
    """`Prefill` with layer-wise KV push (see the module docstring)."""

    name = "prefill"
    starts_transfers = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._calls: dict[str, _PrefillCall] = {}  # unanswered Prefill RPCs by request id
        self._seq = itertools.count()

    def prefill(
        self, req: worker_pb2.PrefillRequest, sink: UnarySink, timeout_s: float | None
    ) -> None:
        """`Prefill`: validate the ticket and queue the prompt; `sink` gets the first token
        once the transfer's result is known."""
        rid = req.request_id
        if rid in self._calls:
            raise self.duplicate(rid)
        engine_id = f"{rid}#{next(self._seq)}"
        prompt = list(req.prompt_token_ids)
        try:
            params = sampling_from_proto(req.sampling, self.engine.model_config.vocab_size)
            ticket = ticket_from_proto(req.ticket)
            check_layout(
                self.ctx.transport.layout,
                ticket.layout,
                f"prefill {self.ctx.worker_id}",
                f"decode {ticket.receiver.worker_id}",
            )
            if ticket.num_tokens != len(prompt):
                raise ValueError(
                    f"ticket.num_tokens {ticket.num_tokens} != prompt length {len(prompt)}"
                )
            if ticket.request_id and ticket.request_id != rid:
                raise ValueError(f"ticket is for request {ticket.request_id!r}, not {rid!r}")
            context = self.engine.model_config.max_position_embeddings
            check_context(rid, len(prompt), params.max_tokens, context)
            first_only = dataclasses.replace(
                params, max_tokens=1, min_tokens=min(params.min_tokens, 1)
            )
            self.engine.add_request(
                engine_id, prompt, first_only, num_sampled=req.sampling.num_sampled
            )
        except LayoutMismatchError as exc:
            raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc
        except ValueError as exc:
            raise self.invalid(ValueError(f"request {rid!r}: {exc}")) from exc
        arrival = sink.created  # queue_ms includes the wait for the engine thread's next turn
        self._calls[rid] = _PrefillCall(
            rid, engine_id, sink, ticket, params, self.deadline(timeout_s), arrival
        )

    def _call_of(self, engine_id: str) -> _PrefillCall | None:
        """The unanswered call whose engine request is `engine_id`, if any."""
        call = self._calls.get(engine_id.rpartition("#")[0])
        return call if call is not None and call.engine_id == engine_id else None

    def before_forward(self, scheduled: SchedulerOutput) -> LayerCallback | None:
        now = time.monotonic()
        opened: list[str] = []
        for item in scheduled.items:
            call = self._call_of(item.request_id)
            assert call is not None, f"scheduled {item.request_id!r} has no Prefill call"
            if call.first_scheduled is None:
                call.first_scheduled = now
            if not item.samples:
                continue
            t = call.ticket
            try:
                self.ctx.transport.open(t, item.block_table[: t.num_blocks])
            except ValueError as exc:
                # Nothing reads the blocks: the request frees them when this step finishes it.
                code = (
                    grpc.StatusCode.FAILED_PRECONDITION
                    if isinstance(exc, LayoutMismatchError)
                    else grpc.StatusCode.INTERNAL
                )
                del self._calls[call.request_id]
                call.sink.fail(WorkerError(code, f"could not open KV transfer: {exc}"))
                continue
            self.engine.scheduler.open_send(call.engine_id, t.transfer_id)
            opened.append(t.transfer_id)
        if not opened:
            return None
        transport = self.ctx.transport

        def on_layer_done(layer: int) -> None:
            for tid in opened:
                transport.send_layer(tid, layer)

        return on_layer_done

    def on_outputs(self, outputs: Sequence[RequestOutput], started: float, ended: float) -> None:
        sending = self.engine.scheduler.sending
        for out in outputs:
            assert out.finished and len(out.output_token_ids) == 1, out
            call = self._call_of(out.request_id)
            if call is None:  # its open failed and answered it; the blocks were freed
                assert all(kv.request.request_id != out.request_id for kv in sending.values())
                continue
            assert self._send_of(call) is not None, (out.request_id, "finished unsent")
            call.output, call.compute_end = out, ended

    def on_transfer_results(self, results: Sequence[TransferResult]) -> None:
        now = time.monotonic()
        sched = self.engine.scheduler
        for r in results:
            if r.role != "send" or sched.send_state(r.transfer_id) is None:
                log.error("transfer result for no prefill request of this worker: %s", r)
                continue
            engine_id = sched.send_result(r.transfer_id)  # frees the blocks, ok or not
            if engine_id is None:  # abandoned: its RPC was answered when it was cancelled
                continue
            call = self._call_of(engine_id)
            assert call is not None, (engine_id, "a wanted result with no call")
            del self._calls[call.request_id]
            rid, out = call.request_id, call.output
            assert out is not None and call.compute_end is not None, (rid, "result before output")
            if not r.ok:
                call.sink.fail(
                    WorkerError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"KV transfer {r.transfer_id} of request {rid!r} to decode worker "
                        f"{r.peer} failed: {r.error}",
                        failed_peer=r.peer,
                    )
                )
                continue
            first = out.output_token_ids[0]
            reason = stop_reason(first, 1, call.params, self.engine.model_config.eos_token_ids)
            if out.finish_reason in ("stop", "error"):  # also a grammar complete or broken
                reason = out.finish_reason
            started = call.first_scheduled if call.first_scheduled is not None else call.arrival
            resp = worker_pb2.PrefillResponse(
                first_token=first,
                cached_tokens=out.num_cached_tokens,
                queue_ms=ms(started - call.arrival),
                compute_ms=ms(call.compute_end - started),
                transfer_ms=ms(now - call.compute_end),
                finished=reason is not None,
                finish_reason=reason or "",
                kv_bytes=r.nbytes,
                kv_layers=r.layers,
                kv_plane=r.plane,
                kv_total_ms=ms(r.elapsed_s),
            )
            if call.params.logprobs is not None:
                resp.first_logprob.CopyFrom(logprobs_to_proto(out.new_logprobs())[0])
            call.sink.set(resp)

    def expire(self, now: float) -> None:
        for rid, call in list(self._calls.items()):
            if now >= call.deadline:
                sending = self._send_of(call) is not None
                self.abort(
                    rid, None, self.expired(rid, "transferring KV" if sending else "prefilling")
                )

    def abort(self, request_id: str, sink: Sink | None, error: WorkerError) -> bool:
        call = self._calls.get(request_id)
        if call is None or (sink is not None and call.sink is not sink):
            return False
        del self._calls[request_id]
        call.sink.fail(error)
        if call.engine_id in self.engine.scheduler.requests:
            self.engine.abort_request(call.engine_id)  # frees its blocks, or abandons its send
        else:  # finished: its send holds the blocks until the transfer's result
            self.engine.scheduler.abandon_send(call.ticket.transfer_id)
        send = self._send_of(call)  # (the transfer id may be a cancelled predecessor's)
        if send is not None:
            assert send.state is Send.ABANDONED, send.state
            self.ctx.transport.cancel(send.transfer_id)  # its result frees the blocks
        return True

    def _send_of(self, call: _PrefillCall) -> SendingKV | None:
        """The scheduler's send of `call`'s own request, if it opened one (a retry may carry
        the ticket of a cancelled predecessor whose send is still in flight)."""
        send = self.engine.scheduler.sending.get(call.ticket.transfer_id)
        return send if send is not None and send.request.request_id == call.engine_id else None

    def request_ids(self) -> list[str]:
        return list(self._calls)

    def holds(self, request_id: str) -> bool:
        return request_id in self._calls

    def num_active(self) -> int:
        """Unanswered calls, and cancelled sends whose transfer result is still to come."""
        sending = self.engine.scheduler.sending.values()
        return len(self._calls) + sum(1 for kv in sending if kv.state is Send.ABANDONED)

    def transfers_in_flight(self) -> bool:
        return bool(self.engine.scheduler.sending)

    rpcs = (Rpc("Prefill", prefill, worker_pb2.PrefillRequest, UnarySink),)
