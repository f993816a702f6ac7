"""Colocated role: `Generate` runs prefill and decode in this worker's own LLMEngine.

Runs in the engine thread of a colocated worker (the baseline of every goodput comparison),
and of a decode worker, as the local-prefill part of its "decode" role (`worker_main.ROLES`).
Each request streams `TokenChunk`s: the first carries the first token with `cached_tokens`,
`admission_ms` (arrival until its first step) and `first_step_ms` (its first step until the
first token, chunked prefill included); the last has ``finished=True``.

The request's state (queued, running, its blocks) is the engine scheduler's; `_calls` maps each
request id to its RPC's stream and timings only, which is what answering needs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from model_runtime.engine import LayerCallback
from model_runtime.request import RequestOutput
from model_runtime.scheduler_types import SchedulerOutput
from proto.pdserve.v1 import worker_pb2
from worker.convert import sampling_from_proto, token_chunk
from worker.roles import RoleHandler, Rpc, ms
from worker.sinks import Sink, StreamSink, WorkerError


@dataclass
class _GenerateCall:
    """One Generate RPC's stream and timing."""

    sink: StreamSink
    deadline: float
    arrival: float
    logprobs: bool  # the request asked for logprobs
    first_scheduled: float | None = None


class ColocatedRole(RoleHandler):
    """`Generate` through the continuous-batching engine (chunked prefill, prefix cache)."""

    name = "colocated"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._jobs: dict[str, _GenerateCall] = {}  # the open Generate RPCs, by request id

    def generate(
        self, request: worker_pb2.WorkerGenerateRequest, sink: StreamSink, timeout_s: float | None
    ) -> None:
        """`Generate`: queue the request in the engine; its tokens stream to `sink`."""
        rid = request.request_id
        if rid in self._jobs:
            raise self.duplicate(rid)
        try:
            params = sampling_from_proto(request.sampling, self.engine.model_config.vocab_size)
            self.engine.add_request(
                rid,
                list(request.prompt_token_ids),
                params,
                num_sampled=request.sampling.num_sampled,
            )
        except ValueError as exc:
            raise self.invalid(exc) from exc
        logprobs = params.logprobs is not None
        job = _GenerateCall(sink, self.deadline(timeout_s), sink.created, logprobs)
        self._jobs[rid] = job

    def before_forward(self, scheduled: SchedulerOutput) -> LayerCallback | None:
        now = time.monotonic()
        for item in scheduled.items:
            job = self._jobs.get(item.request_id)
            if job is not None and job.first_scheduled is None:
                job.first_scheduled = now
        return None

    def on_outputs(self, outputs: Sequence[RequestOutput], started: float, ended: float) -> None:
        for out in outputs:
            job = self._jobs[out.request_id]
            chunk = token_chunk(out, job.logprobs)
            if job.sink.num_chunks == 0:
                first = job.first_scheduled if job.first_scheduled is not None else started
                chunk.cached_tokens = out.num_cached_tokens
                chunk.admission_ms = ms(first - job.arrival)
                chunk.first_step_ms = ms(ended - first)
            job.sink.put(chunk)
            if out.finished:
                del self._jobs[out.request_id]

    def expire(self, now: float) -> None:
        for rid, job in list(self._jobs.items()):
            if now >= job.deadline:
                what = "generating" if job.first_scheduled is not None else "queued"
                self.abort(rid, None, self.expired(rid, what))

    def abort(self, request_id: str, sink: Sink | None, error: WorkerError) -> bool:
        job = self._jobs.get(request_id)
        if job is None or (sink is not None and job.sink is not sink):
            return False
        self.engine.abort_request(request_id)  # frees its blocks
        del self._jobs[request_id]
        job.sink.fail(error)
        return True

    def request_ids(self) -> list[str]:
        return list(self._jobs)

    def holds(self, request_id: str) -> bool:
        return request_id in self._jobs

    rpcs = (Rpc("Generate", generate, worker_pb2.WorkerGenerateRequest, StreamSink),)
