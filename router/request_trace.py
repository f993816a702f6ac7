"""The router's spans of one request: the root ``pdserve.request`` and its phases. Runs in the
router process, on the request's task.

One `RequestTrace` per request (`lifecycle.RequestLifecycle.run` owns it). The tree, with the
workers' own spans (`worker.tracing`) joined under the router's calls through the W3C context
each call carries (``traceparent`` in its gRPC metadata)::

    pdserve.request                      root: the client's view, arrival -> final message
      pdserve.chat_template              (HTTP chat: render + tokenize, before `run`)
      pdserve.tokenize                   validation and tokenization
      pdserve.admission_queue            waiting for a running slot (= timings.router_queue_ms)
      pdserve.prefix_lookup              the prefix index (when the policy asks it)
      pdserve.reserve        client  ->  pdserve.worker.reserve          (decode worker)
      pdserve.prefill        client  ->  pdserve.worker.prefill          (prefill worker)
                                           pdserve.prefill.queue / .compute, pdserve.kv_transfer
      pdserve.decode         client  ->  pdserve.worker.decode           (decode worker)
                                           pdserve.decode.admission / .first_step
      pdserve.generate       client  ->  pdserve.worker.generate   (colocated, or hybrid local)
      pdserve.migration                  a move off a failed worker; the new leg's calls inside
      pdserve.abort                      Abort calls to the workers still holding the request

Attributes follow the OpenTelemetry GenAI conventions where they apply (``gen_ai.request.*``,
``gen_ai.usage.*``, ``gen_ai.response.*``), ``pdserve.*`` otherwise. Content — the prompt
text, the output text, token ids — is on a span only with `TracingConfig.capture_content`
(``gen_ai.input.messages`` / ``gen_ai.output.messages``); credentials never (only
``traceparent`` / ``tracestate`` are read from a request's headers).

With tracing off (`tracing.NO_TRACER`) every span is `tracing.NO_SPAN` and each method here
returns after one check: no attribute is built.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

from model_runtime.tokenizer import Tokenizer
from router.client_stream import ClientStream
from router.validation import ValidatedRequest
from tracing.spans import Attributes, Headers, Span, Tracer

ROOT = "pdserve.request"


@dataclass(frozen=True)
class TraceStart:
    """What an edge knows of a request's trace before `RequestLifecycle.run`: the incoming
    W3C context (gRPC metadata or HTTP headers; None: a new trace), the GenAI operation
    ('text_completion' or 'chat'), and when the request arrived if work ran before `run`
    (`time.time_ns()`; an HTTP chat request's template render)."""

    headers: Headers | None = None
    operation: str = "text_completion"
    arrived_ns: int | None = None


NEW_TRACE = TraceStart()


def worker_call(span: Span, method: str, address: str, worker_id: str) -> Span:
    """A client span under `span` for one call to a worker (`rpc.*`, `server.address`)."""
    name = f"pdserve.{method.lower()}"
    if not span.recording:  # still a child: it carries the trace context (not sampled)
        return span.child(name)
    return span.child(
        name,
        kind="client",
        attributes={
            "rpc.system": "grpc",
            "rpc.service": "pdserve.v1.Worker",
            "rpc.method": method,
            "server.address": address,
            "pdserve.worker.id": worker_id,
        },
    )


class RequestTrace:
    """The root span of one request and its router-side phases (module docstring)."""

    def __init__(self, tracer: Tracer, model: str, start: TraceStart) -> None:
        self.capture_content = tracer.capture_content
        self.client: ClientStream | None = None  # what the client got (set once validated)
        now = time.time_ns()
        self.start_ns = start.arrived_ns if start.arrived_ns is not None else now
        self.root = tracer.start(
            ROOT,
            parent_headers=start.headers,
            kind="server",
            start_ns=self.start_ns,
            attributes={
                "gen_ai.operation.name": start.operation,
                "gen_ai.provider.name": "pdserve",
                "gen_ai.request.model": model,
            }
            if tracer.enabled
            else None,
        )
        if start.arrived_ns is not None and self.root.recording:
            self.root.child("pdserve.chat_template", start_ns=start.arrived_ns).end(now)

    @property
    def trace_id(self) -> str:
        """The request's trace id ("" when not traced)."""
        return self.root.trace_id

    def phase(self, name: str, attributes: Attributes | None = None) -> Span:
        """A child of the root, started now (use as a context manager)."""
        return self.root.child(name, attributes=attributes)

    def validated(self, req: ValidatedRequest, request_id: str, tokenizer: Tokenizer) -> None:
        """The request's parameters, once validated (and its prompt, with capture_content)."""
        if not self.root.recording:
            return
        s = req.sampling
        attrs: dict[str, str | int | float | bool] = {
            "pdserve.request_id": request_id,
            "gen_ai.response.id": request_id,
            "gen_ai.request.max_tokens": s.max_tokens,
            "gen_ai.request.temperature": s.temperature,
            "gen_ai.request.top_p": s.top_p,
            "gen_ai.request.top_k": s.top_k,
            "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
        }
        if s.seed is not None:
            attrs["gen_ai.request.seed"] = s.seed
        if self.capture_content:
            text = tokenizer.decode(list(req.prompt_token_ids))
            attrs["gen_ai.input.messages"] = json.dumps(
                [{"role": "user", "parts": [{"type": "text", "content": text}]}]
            )
        self.root.set(attrs)

    def finish(
        self,
        status: str,
        message: str,
        tpot_s: float | None,
        finish_reason: str,
        colocated: bool,
        tokenizer: Tokenizer,
    ) -> None:
        """End the root with how the request ended: `status` (a gRPC code name; 'OK') and
        `message`, and what `client` (None: the request never got that far) sent: tokens,
        final facts, timings."""
        root = self.root
        if not root.recording:
            root.end()
            return
        client = self.client
        facts = client.facts if client is not None else None
        timings = client.timings if client is not None else None
        tokens: Sequence[int] = client.tokens if client is not None else ()
        attrs: dict[str, str | int | float | bool | Sequence[str]] = {
            "pdserve.status": status,
            "gen_ai.usage.output_tokens": len(tokens),
        }
        if finish_reason:
            attrs["gen_ai.response.finish_reasons"] = [finish_reason]
        if facts is not None:
            attrs["pdserve.path"] = "colocated" if colocated else (facts.prefill_path or "remote")
            if facts.prefill_path_reason:
                attrs["pdserve.path_reason"] = facts.prefill_path_reason
            attrs["pdserve.migrations"] = facts.migrations
            attrs["gen_ai.usage.cache_read.input_tokens"] = facts.cached_tokens
            if facts.prefill_worker:
                attrs["pdserve.prefill_worker"] = facts.prefill_worker
            if facts.decode_worker:
                attrs["pdserve.decode_worker"] = facts.decode_worker
        if timings is not None and timings.ttft_ms:
            attrs["pdserve.ttft_ms"] = timings.ttft_ms
            attrs["gen_ai.response.time_to_first_chunk"] = timings.ttft_ms / 1e3
            root.event("first_token", self.start_ns + int(timings.ttft_ms * 1e6))
        if tpot_s is not None:
            attrs["pdserve.tpot_ms"] = tpot_s * 1e3
        if self.capture_content and tokens:
            attrs["gen_ai.output.messages"] = json.dumps(
                [
                    {
                        "role": "assistant",
                        "parts": [{"type": "text", "content": tokenizer.decode(list(tokens))}],
                        "finish_reason": finish_reason,
                    }
                ]
            )
        root.set(attrs)
        if status != "OK":
            root.fail(status, message)
        root.end()
