"""Prefill role: run prompts, push their KV into a decode worker's blocks, return the first token.

Runs in the engine thread of a prefill worker. Batching is the colocated scheduler's (token
budget, chunked prefill, local prefix-cache reuse); each request enters it with max_tokens=1
and ``hold_blocks=True``, so it finishes with its first token but keeps its blocks. One
request's life here:

1. `Prefill` validates the ticket (layout, token count) and queues the prompt.
2. In the step that runs the request's *last* chunk, `before_forward` calls
   ``transport.open(ticket, prompt blocks)`` and the runner's ``on_layer_done(l)`` calls
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

Timings: queue_ms = the RPC's arrival (its sink's creation, on the gRPC loop) until the
request's first step — so it includes the wait for the engine thread to finish its current
step; compute_ms = first step start
until the end of the step that sampled the first token (chunked prefill included);
transfer_ms = that end until the transfer's result was known.
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
from model_runtime.scheduler import SchedulerOutput
from proto.pdserve.v1 import worker_pb2
from worker.convert import logprobs_to_proto, sampling_from_proto, ticket_from_proto
from worker.roles import RoleHandler, ms
from worker.sinks import Sink, UnarySink, WorkerError

log = logging.getLogger(__name__)


@dataclass
class _PrefillJob:
    """One Prefill RPC's request: its answer, its transfer and what the engine produced."""

    request_id: str
    engine_id: str  # the engine request's id: unique per job
    sink: UnarySink
    ticket: TransferTicket
    params: SamplingParams  # the request's own (max_tokens, stop ids): decide `finished`
    deadline: float
    arrival: float
    first_scheduled: float | None = None
    compute_end: float | None = None
    output: RequestOutput | None = None
    opened: bool = False
    open_error: WorkerError | None = None
    cancelled: bool = False  # given up while the transfer is in flight (RPC already answered)


class PrefillRole(RoleHandler):
    """`Prefill` with layer-wise KV push (see the module docstring)."""

    name = "prefill"
    methods = frozenset({"Prefill"})
    new_work = frozenset({"Prefill"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._jobs: dict[str, _PrefillJob] = {}  # live jobs by request id
        # every job holding engine state (cancelled ones too)
        self._by_engine: dict[str, _PrefillJob] = {}
        self._by_tid: dict[str, _PrefillJob] = {}  # open transfers
        self._seq = itertools.count()

    def handle(self, method: str, request: Any, sink: Sink, timeout_s: float | None) -> None:
        assert method == "Prefill" and isinstance(sink, UnarySink), (method, sink)
        req: worker_pb2.PrefillRequest = request
        rid = req.request_id
        if rid in self._jobs:
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
                engine_id,
                prompt,
                first_only,
                hold_blocks=True,
                num_sampled=req.sampling.num_sampled,
            )
        except LayoutMismatchError as exc:
            raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc
        except ValueError as exc:
            raise self.invalid(ValueError(f"request {rid!r}: {exc}")) from exc
        arrival = sink.created  # queue_ms includes the wait for the engine thread's next turn
        job = _PrefillJob(rid, engine_id, sink, ticket, params, self.deadline(timeout_s), arrival)
        self._jobs[rid] = self._by_engine[engine_id] = job

    def before_forward(self, scheduled: SchedulerOutput) -> LayerCallback | None:
        now = time.monotonic()
        opened: list[str] = []
        for item in scheduled.items:
            job = self._by_engine[item.request_id]
            if job.first_scheduled is None:
                job.first_scheduled = now
            if not item.samples:
                continue
            t = job.ticket
            try:
                self.ctx.transport.open(t, item.block_table[: t.num_blocks])
            except ValueError as exc:
                code = (
                    grpc.StatusCode.FAILED_PRECONDITION
                    if isinstance(exc, LayoutMismatchError)
                    else grpc.StatusCode.INTERNAL
                )
                job.open_error = WorkerError(code, f"could not open KV transfer: {exc}")
                continue
            job.opened = True
            self._by_tid[t.transfer_id] = job
            opened.append(t.transfer_id)
        if not opened:
            return None
        transport = self.ctx.transport

        def on_layer_done(layer: int) -> None:
            for tid in opened:
                transport.send_layer(tid, layer)

        return on_layer_done

    def on_outputs(self, outputs: Sequence[RequestOutput], started: float, ended: float) -> None:
        for out in outputs:
            job = self._by_engine[out.request_id]
            assert out.finished and len(out.output_token_ids) == 1, out
            job.output, job.compute_end = out, ended
            if not job.opened:  # open failed: nothing reads the blocks
                self._forget(job)
                assert job.open_error is not None, out.request_id
                job.sink.fail(job.open_error)

    def on_transfer_results(self, results: Sequence[TransferResult]) -> None:
        now = time.monotonic()
        for r in results:
            job = self._by_tid.pop(r.transfer_id, None)
            if job is None or r.role != "send":
                log.error("transfer result for no prefill job of this worker: %s", r)
                continue
            rid = job.request_id
            out = job.output
            assert out is not None and job.compute_end is not None, (rid, "result before output")
            self._forget(job)  # the transport never reads the blocks again
            if job.cancelled:
                continue
            if not r.ok:
                job.sink.fail(
                    WorkerError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"KV transfer {r.transfer_id} of request {rid!r} to decode worker "
                        f"{r.peer} failed: {r.error}",
                        failed_peer=r.peer,
                    )
                )
                continue
            first = out.output_token_ids[0]
            reason = stop_reason(first, 1, job.params, self.engine.model_config.eos_token_ids)
            started = job.first_scheduled if job.first_scheduled is not None else job.arrival
            resp = worker_pb2.PrefillResponse(
                first_token=first,
                cached_tokens=out.num_cached_tokens,
                queue_ms=ms(started - job.arrival),
                compute_ms=ms(job.compute_end - started),
                transfer_ms=ms(now - job.compute_end),
                finished=reason is not None,
                finish_reason=reason or "",
            )
            if job.params.logprobs is not None:
                resp.first_logprob.CopyFrom(logprobs_to_proto(out.new_logprobs())[0])
            job.sink.set(resp)

    def expire(self, now: float) -> None:
        for rid, job in list(self._jobs.items()):
            if now >= job.deadline:
                what = "transferring KV" if job.opened else "prefilling"
                self.abort(rid, None, self.expired(rid, what))

    def abort(self, request_id: str, sink: Sink | None, error: WorkerError) -> bool:
        job = self._jobs.get(request_id)
        if job is None or (sink is not None and job.sink is not sink):
            return False
        job.sink.fail(error)
        if job.opened:
            job.cancelled = True
            self.ctx.transport.cancel(job.ticket.transfer_id)  # blocks freed at its result
            del self._jobs[request_id]  # stays in `_by_engine` / `_by_tid` until then
        else:
            self.engine.abort_request(job.engine_id)  # frees its blocks
            del self._jobs[request_id], self._by_engine[job.engine_id]
        return True

    def _forget(self, job: _PrefillJob) -> None:
        """Release the held blocks of a finished job and drop it everywhere."""
        self.engine.release_held(job.engine_id)
        del self._by_engine[job.engine_id]
        if self._jobs.get(job.request_id) is job:
            del self._jobs[job.request_id]

    def request_ids(self) -> list[str]:
        return list(self._jobs)

    def num_active(self) -> int:
        return len(self._by_engine)

    def transfers_in_flight(self) -> bool:
        return bool(self._by_tid)
