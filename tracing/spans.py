"""The span seam the router and the workers write to: `Span` and `Tracer` (protocols), with
`NO_SPAN` / `NO_TRACER`, the do-nothing pair used while tracing is off. Torch-free and
OpenTelemetry-free: with tracing off nothing of the OpenTelemetry SDK is imported, and each
call on the request path is one method call that returns at once.

The real pair is `tracing.sdk.OtelTracer` / `OtelSpan` (an OpenTelemetry SDK tracer provider
of this process's own, never the global one: several routers may share a test process).
`tracing.make_tracer` picks one from a `TracingConfig`. Contract, for both:

- `Tracer.start(name, parent_headers=..)` opens a span that continues the W3C trace context in
  `parent_headers` (``traceparent`` / ``tracestate`` from a gRPC call's metadata or an HTTP
  request's headers), or a new trace; the sampler decides whether it records;
- `Span.child(name, ..)` opens a child; `start_ns` / `end(end_ns)` place a span after the fact
  (wall-clock nanoseconds, `time.time_ns()`), so a phase measured as plain numbers elsewhere —
  an engine thread's timings — becomes a span without that thread ever touching a span;
- `Span.headers()` is the W3C trace context of the span as gRPC metadata pairs, for the calls
  made inside it (empty when off);
- a span used as a context manager ends on exit, with an error status when an exception
  escapes;
- nothing here raises into the caller's request path for a tracing reason, and nothing blocks:
  finished spans go to a bounded queue exported by a background thread (`tracing.export`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Literal, Protocol

AttrValue = str | bool | int | float | Sequence[str] | Sequence[int] | Sequence[float]
Attributes = Mapping[str, AttrValue]
SpanKind = Literal["internal", "server", "client"]
Headers = Mapping[str, str] | Iterable[tuple[str, str | bytes]]
"""Where a W3C trace context comes from: an HTTP request's headers (a case-insensitive mapping)
or a gRPC call's metadata (key, value) pairs."""

W3C_KEYS = ("traceparent", "tracestate")


def w3c_headers(headers: Headers | None) -> dict[str, str]:
    """The ``traceparent`` / ``tracestate`` entries of `headers` (lower-case keys; gRPC
    metadata keys are lower-case already, HTTP mappings are looked up case-insensitively)."""
    if headers is None:
        return {}
    if isinstance(headers, Mapping):
        found = {key: headers.get(key) for key in W3C_KEYS}
        return {k: v for k, v in found.items() if isinstance(v, str)}
    out: dict[str, str] = {}
    for key, value in headers:
        if key in W3C_KEYS and isinstance(value, str):
            out[key] = value
    return out


class Span(Protocol):
    """One span (module docstring). Every method is cheap and never raises for tracing's
    sake."""

    @property
    def recording(self) -> bool:
        """True when this span is sampled and will be exported."""
        ...

    @property
    def trace_id(self) -> str:
        """32 hex digits of the span's trace ("" when not recording)."""
        ...

    def child(
        self,
        name: str,
        *,
        kind: SpanKind = "internal",
        start_ns: int | None = None,
        attributes: Attributes | None = None,
    ) -> Span:
        """A span under this one (same trace), started now or at `start_ns` (wall-clock ns);
        the caller ends it."""
        ...

    def set(self, attributes: Attributes) -> None:
        """Add or overwrite attributes; does nothing on a span that does not record (so
        callers build costly attributes only when `recording`)."""
        ...

    def event(
        self, name: str, time_ns: int | None = None, attributes: Attributes | None = None
    ) -> None:
        """A point in time on the span (now, or at `time_ns`)."""
        ...

    def fail(self, status: str, message: str = "") -> None:
        """Mark the span failed: error status, `status` (e.g. a gRPC code name) as
        ``error.type``."""
        ...

    def end(self, end_ns: int | None = None) -> None:
        """End the span (now, or at `end_ns`); later calls do nothing."""
        ...

    def headers(self) -> tuple[tuple[str, str], ...]:
        """The span's W3C trace context as gRPC metadata (empty when tracing is off)."""
        ...

    def __enter__(self) -> Span: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


class Tracer(Protocol):
    """Where a process's spans start (module docstring)."""

    @property
    def enabled(self) -> bool:
        """False for `NO_TRACER`: nothing is traced and no header need be read."""
        ...

    @property
    def capture_content(self) -> bool:
        """Prompt and output text may go on spans (`TracingConfig.capture_content`)."""
        ...

    def start(
        self,
        name: str,
        *,
        parent_headers: Headers | None = None,
        kind: SpanKind = "server",
        start_ns: int | None = None,
        attributes: Attributes | None = None,
    ) -> Span:
        """A root span (module docstring): it continues `parent_headers`' W3C trace context
        when they carry one, else starts a trace; the sampler decides whether it records."""
        ...

    def counts(self) -> Mapping[str, int]:
        """Spans exported and dropped so far: ``exported``, ``queue_full``, ``export_failed``
        (`tracing.export.SpanStats`)."""
        ...

    def shutdown(self) -> None:
        """Export what is queued, bounded by the config's `shutdown_timeout_s`; then stop."""
        ...


class _NoSpan:
    """The span of a process without tracing: every call does nothing."""

    __slots__ = ()

    recording = False
    trace_id = ""

    def child(
        self,
        name: str,
        *,
        kind: SpanKind = "internal",
        start_ns: int | None = None,
        attributes: Attributes | None = None,
    ) -> Span:
        return self

    def set(self, attributes: Attributes) -> None:
        pass

    def event(
        self, name: str, time_ns: int | None = None, attributes: Attributes | None = None
    ) -> None:
        pass

    def fail(self, status: str, message: str = "") -> None:
        pass

    def end(self, end_ns: int | None = None) -> None:
        pass

    def headers(self) -> tuple[tuple[str, str], ...]:
        return ()

    def __enter__(self) -> Span:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        pass


class _NoTracer:
    """The tracer of a process without tracing."""

    __slots__ = ()

    enabled = False
    capture_content = False

    def start(
        self,
        name: str,
        *,
        parent_headers: Headers | None = None,
        kind: SpanKind = "server",
        start_ns: int | None = None,
        attributes: Attributes | None = None,
    ) -> Span:
        return NO_SPAN

    def counts(self) -> Mapping[str, int]:
        return {}

    def shutdown(self) -> None:
        pass


NO_SPAN: Span = _NoSpan()
NO_TRACER: Tracer = _NoTracer()
