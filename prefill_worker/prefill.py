"""Prefill role: run prompts, push their KV into a decode worker's blocks, return the first token.

Runs in the engine thread of a prefill worker. Batching is the colocated scheduler's (token
budget, chunked prefill, local prefix-cache reuse); each request enters it with max_tokens=1,
so it finishes with its first token, and its open send keeps its blocks. Every step of the KV
hand-off is the worker's hand-off owner's (`worker.kv_handoff.KVHandoff`); this role only turns
RPCs into engine requests and hand-off outcomes into answers. One request's life here:

1. `Prefill` checks the ticket (`KVHandoff.check_ticket`: fields, layout, token count) and
   queues the prompt under the request's own id.
2. In the step that runs the request's *last* chunk, `before_forward` opens its send
   (`KVHandoff.open_send`; one that the transport refuses answers the RPC at once, and the
   blocks are freed as the step finishes the request) and returns the hand-off's
   `layer_sender`: layer l leaves while layers l+1.. still compute. Prefix-cached blocks are
   sent like the rest: the decode worker gets the whole prompt's KV.
3. The step samples the first token. The blocks stay held (the transport may still read them)
   until the send's outcome (`on_handoff`); they are released then, exactly once, and the RPC
   answers: SENT -> `PrefillResponse` (first_token, cached_tokens, queue/compute/transfer ms,
   finished + finish_reason if the first token already ends the request), SEND_FAILED ->
   UNAVAILABLE naming the transfer and why (and the decode worker as the failed peer).

*First token ends the request* (EOS / stop token / max_tokens 1): the transfer is never
cancelled for that — its layers are already on the way when the token is sampled — so the
answer still waits for the send's outcome and says ``finished=True``; the router then aborts
the decode side's reservation.

`Abort`, a cancelled RPC or the request deadline: the RPC answers at once and the request is
given up (`KVHandoff.abandon`): before the last step it is simply aborted in the engine
(blocks freed at once); once its send is open the transfer is cancelled and its blocks are
freed at the transfer's result. The request id is free again at once, so a router retrying the
same request here never collides with a cancelled predecessor whose blocks are still held.

State: the engine scheduler owns each request's state and blocks. This role keeps one map,
request id -> `_PrefillCall`: the open RPC's sink, ticket, sampling params and timings, which
is what answering needs and nothing the scheduler knows; a call leaves it when its RPC is
answered.

Timings: queue_ms = the RPC's arrival (its sink's creation, on the gRPC loop) until the
request's first step — so it includes the wait for the engine thread to finish its current
step; compute_ms = first step start until the end of the step that sampled the first token
(chunked prefill included); transfer_ms = that end until the send's outcome was known;
kv_total_ms = the transfer's own time (its open, in the last step, to its result), with its
bytes, layers and data plane (the outcome's `TransferResult`): what the worker's trace span of
the transfer shows (`worker.tracing`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from model_runtime.engine import LayerCallback
from model_runtime.limits import check_context
from model_runtime.request import RequestOutput, stop_reason
from model_runtime.sampling_params import SamplingParams
from model_runtime.scheduler_types import SchedulerOutput
from proto.pdserve.v1 import worker_pb2
from worker.convert import logprobs_to_proto, sampling_from_proto
from worker.kv_handoff import HandoffOutcome, Outcome, TransferRefused
from worker.roles import RoleHandler, Rpc, ms
from worker.sinks import Sink, UnarySink, WorkerError

log = logging.getLogger(__name__)


@dataclass
class _PrefillCall:
    """One unanswered Prefill RPC: what answering it needs (not block state: see the module
    docstring)."""

    sink: UnarySink
    ticket: worker_pb2.TransferTicket
    params: SamplingParams  # the request's own (max_tokens, stop ids): decide `finished`
    deadline: float
    arrival: float
    first_scheduled: float | None = None
    compute_end: float | None = None
    output: RequestOutput | None = None


def refused(exc: TransferRefused, code: grpc.StatusCode = grpc.StatusCode.INTERNAL) -> WorkerError:
    """The answer to a transfer the transport refused: FAILED_PRECONDITION when the workers'
    KV layouts differ (a configuration error), else `code`."""
    return WorkerError(grpc.StatusCode.FAILED_PRECONDITION if exc.layout else code, str(exc))


class PrefillRole(RoleHandler):
    """`Prefill` with layer-wise KV push (see the module docstring)."""

    name = "prefill"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._calls: dict[str, _PrefillCall] = {}  # unanswered Prefill RPCs by request id

    def prefill(
        self, req: worker_pb2.PrefillRequest, sink: UnarySink, timeout_s: float | None
    ) -> None:
        """`Prefill`: check the ticket and queue the prompt; `sink` gets the first token once
        the send's outcome is known."""
        rid = req.request_id
        if rid in self._calls:
            raise self.duplicate(rid)
        prompt = list(req.prompt_token_ids)
        try:
            params = sampling_from_proto(req.sampling, self.engine.model_config.vocab_size)
            self.handoff.check_ticket(rid, len(prompt), req.ticket)
            context = self.engine.model_config.max_position_embeddings
            check_context(rid, len(prompt), params.max_tokens, context)
            first_only = dataclasses.replace(
                params, max_tokens=1, min_tokens=min(params.min_tokens, 1)
            )
            self.engine.add_request(rid, prompt, first_only, num_sampled=req.sampling.num_sampled)
        except TransferRefused as exc:
            raise refused(exc) from exc
        except ValueError as exc:
            raise self.invalid(ValueError(f"request {rid!r}: {exc}")) from exc
        arrival = sink.created  # queue_ms includes the wait for the engine thread's next turn
        self._calls[rid] = _PrefillCall(sink, req.ticket, params, self.deadline(timeout_s), arrival)

    def before_forward(self, scheduled: SchedulerOutput) -> LayerCallback | None:
        now = time.monotonic()
        opened: list[str] = []
        for item in scheduled.items:
            rid = item.request_id
            call = self._calls.get(rid)
            assert call is not None, f"scheduled {rid!r} has no Prefill call"
            if call.first_scheduled is None:
                call.first_scheduled = now
            if not item.samples:
                continue
            try:
                self.handoff.open_send(rid, call.ticket, item.block_table)
            except TransferRefused as exc:
                # Nothing reads the blocks: the request frees them when this step finishes it.
                del self._calls[rid]
                call.sink.fail(refused(exc))
                continue
            opened.append(rid)
        return self.handoff.layer_sender(opened) if opened else None

    def on_outputs(self, outputs: Sequence[RequestOutput], started: float, ended: float) -> None:
        for out in outputs:
            assert out.finished and len(out.output_token_ids) == 1, out
            call = self._calls.get(out.request_id)
            sends = self.handoff.sending(out.request_id)
            if call is None:  # its open failed and answered it; the blocks were freed
                assert not sends, (out.request_id, "a send with no call")
                continue
            assert sends, (out.request_id, "finished unsent")
            call.output, call.compute_end = out, ended

    def on_handoff(self, outcomes: Sequence[HandoffOutcome]) -> None:
        now = time.monotonic()
        for o in outcomes:
            rid, r = o.request_id, o.result
            call = self._calls.pop(rid)  # a live send's call is open until this outcome
            out = call.output
            assert out is not None and call.compute_end is not None, (rid, "result before output")
            if o.outcome is not Outcome.SENT:
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
                what = "transferring KV" if self.handoff.sending(rid) else "prefilling"
                self.abort(rid, None, self.expired(rid, what))

    def abort(self, request_id: str, sink: Sink | None, error: WorkerError) -> bool:
        call = self._calls.get(request_id)
        if call is None or (sink is not None and call.sink is not sink):
            return False
        del self._calls[request_id]
        call.sink.fail(error)
        self.handoff.abandon(request_id)  # blocks a transfer still reads: freed at its result
        return True

    def request_ids(self) -> list[str]:
        return list(self._calls)

    def holds(self, request_id: str) -> bool:
        return request_id in self._calls

    rpcs = (Rpc("Prefill", prefill, worker_pb2.PrefillRequest, UnarySink),)
