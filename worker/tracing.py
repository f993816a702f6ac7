"""A worker's spans of the RPCs it serves, joined to the router's trace. Runs on the worker's
gRPC event loop, never on the engine thread.

The engine thread records what a span needs as plain numbers in the answer it already gives —
a `PrefillResponse`'s queue / compute / transfer times and its KV transfer's bytes, layers and
plane, a first `TokenChunk`'s admission and first-step times — and this module turns them into
spans once the answer is on the loop: no span is created, no lock taken and nothing exported on
the engine thread (export is the tracer's background thread, `tracing.export`). Times are
placed from the RPC's arrival (its sink's creation, the instant the roles measure from) with the
wall clock read at that instant. With tracing off every RPC gets `NO_RPC_TRACE`, whose methods
do nothing; with it on, an `RpcSpans`.

Spans (each RPC's server span continues the ``traceparent`` the router's call carried)::

    pdserve.worker.reserve       a decode worker's reservation (blocks booked)
    pdserve.worker.prefill       arrival -> answer
      pdserve.prefill.queue      arrival -> first step (PrefillResponse.queue_ms)
      pdserve.prefill.compute    first step -> first token sampled (.compute_ms)
      pdserve.kv_transfer        the transfer's open -> its result (.kv_total_ms; bytes,
                                 layers, plane; exposed_ms: the part after compute)
    pdserve.worker.decode        arrival -> the stream's end
      pdserve.decode.admission   arrival -> the step that ran it: KV wait + admission
      pdserve.decode.first_step  that step (TokenChunk.first_step_ms)
    pdserve.worker.generate      colocated, or a hybrid decode worker's local prefill
      pdserve.generate.queue     arrival -> first step (TokenChunk.admission_ms)
      pdserve.generate.prefill   first step -> first token, chunked prefill (.first_step_ms)
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from proto.pdserve.v1 import worker_pb2
from tracing.spans import Span, Tracer


class RpcTrace(Protocol):
    """The spans of one RPC (module docstring); every method is cheap and never raises."""

    def answered(self, response: Any) -> None:
        """A unary RPC's answer (`PrefillResponse`, `ReserveResponse`)."""
        ...

    def chunk(self, chunk: worker_pb2.TokenChunk) -> None:
        """A streaming RPC's chunk, in order."""
        ...

    def failed(self, status: str, message: str) -> None:
        """The RPC ended with `status` (a gRPC code name) and `message`: the span fails."""
        ...

    def end(self) -> None:
        """The RPC is over (answered, failed or cancelled): the server span ends; called once,
        last."""
        ...


class _NoRpcTrace:
    __slots__ = ()

    def answered(self, response: Any) -> None:
        pass

    def chunk(self, chunk: worker_pb2.TokenChunk) -> None:
        pass

    def failed(self, status: str, message: str) -> None:
        pass

    def end(self) -> None:
        pass


NO_RPC_TRACE: RpcTrace = _NoRpcTrace()


class RpcSpans:
    """One RPC's spans over a tracer that is on (module docstring): the RPC of `method` that
    arrived at `arrival` (`time.monotonic()`, its sink's creation); `metadata`: the call's
    invocation metadata (its W3C context)."""

    def __init__(
        self,
        tracer: Tracer,
        method: str,
        request: Any,
        metadata: Any,
        arrival: float,
        worker_id: str,
    ) -> None:
        # the wall clock at `arrival` (read within microseconds of it)
        self._arrival_ns = time.time_ns() - int((time.monotonic() - arrival) * 1e9)
        self._method = method
        self._tokens = 0
        self._chunks = 0
        self._finish = ""
        attrs: dict[str, str | int] = {
            "rpc.system": "grpc",
            "rpc.service": "pdserve.v1.Worker",
            "rpc.method": method,
            "pdserve.worker.id": worker_id,
            "pdserve.request_id": request.request_id,
        }
        if isinstance(request, worker_pb2.PrefillRequest | worker_pb2.WorkerGenerateRequest):
            attrs["gen_ai.usage.input_tokens"] = len(request.prompt_token_ids)
        self.span: Span = tracer.start(
            f"pdserve.worker.{method.lower()}",
            parent_headers=metadata,
            kind="server",
            start_ns=self._arrival_ns,
            attributes=attrs,
        )

    def _at(self, ms: float) -> int:
        """Wall-clock ns `ms` milliseconds after the RPC's arrival."""
        return self._arrival_ns + int(ms * 1e6)

    def _phase(self, name: str, start_ms: float, end_ms: float, **attrs: Any) -> None:
        self.span.child(name, start_ns=self._at(start_ms), attributes=attrs or None).end(
            self._at(end_ms)
        )

    def answered(self, response: Any) -> None:
        if not self.span.recording:
            return
        if isinstance(response, worker_pb2.PrefillResponse):
            self._prefill(response)
        elif isinstance(response, worker_pb2.ReserveResponse):
            self.span.set({"pdserve.kv.blocks": len(response.ticket.block_ids)})

    def _prefill(self, r: worker_pb2.PrefillResponse) -> None:
        q, c, t = r.queue_ms, r.compute_ms, r.transfer_ms
        self._phase("pdserve.prefill.queue", 0.0, q)
        self._phase(
            "pdserve.prefill.compute", q, q + c, **{"pdserve.cached_tokens": r.cached_tokens}
        )
        done = q + c + t  # the transfer's result
        self._phase(
            "pdserve.kv_transfer",
            done - r.kv_total_ms,
            done,
            **{
                "pdserve.kv.bytes": r.kv_bytes,
                "pdserve.kv.layers": r.kv_layers,
                "pdserve.kv.plane": r.kv_plane,
                "pdserve.kv.exposed_ms": t,
            },
        )
        self.span.set({"gen_ai.usage.cache_read.input_tokens": r.cached_tokens})

    def chunk(self, chunk: worker_pb2.TokenChunk) -> None:
        if not self.span.recording:
            return
        if self._chunks == 0:
            a, f = chunk.admission_ms, chunk.first_step_ms
            if self._method == "Decode":
                self._phase("pdserve.decode.admission", 0.0, a)
                if f:  # 0: the first token already ended the request, no step ran
                    self._phase("pdserve.decode.first_step", a, a + f)
            else:
                self._phase("pdserve.generate.queue", 0.0, a)
                self._phase("pdserve.generate.prefill", a, a + f)
                self.span.set({"gen_ai.usage.cache_read.input_tokens": chunk.cached_tokens})
        self._chunks += 1
        self._tokens += len(chunk.token_ids)
        if chunk.finished:
            self._finish = chunk.finish_reason

    def failed(self, status: str, message: str) -> None:
        self.span.fail(status, message)

    def end(self) -> None:
        if self.span.recording and self._chunks:
            attrs: dict[str, int | list[str]] = {"gen_ai.usage.output_tokens": self._tokens}
            if self._finish:
                attrs["gen_ai.response.finish_reasons"] = [self._finish]
            self.span.set(attrs)
        self.span.end()
