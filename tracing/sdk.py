"""The real `Tracer` / `Span` (`tracing.spans`) over the OpenTelemetry SDK. Imported only by
`tracing.make_tracer` when tracing is on; runs in the router and in every worker process.

Each `OtelTracer` owns a `TracerProvider` of its own (never the process-global one, so several
routers in one test process keep their spans apart), with:

- a resource naming the process: ``service.name`` (the resolved service name),
  ``service.instance.id`` (router address or worker id) and ``pdserve.component``
  (``router`` / ``worker``);
- the configured sampler (`ExportSettings.sampler`, the names of ``OTEL_TRACES_SAMPLER``);
- an OTLP exporter, gRPC or HTTP/protobuf, behind `tracing.export.BoundedSpanProcessor`;
- W3C trace-context propagation (``traceparent`` / ``tracestate``), in and out.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from types import TracebackType

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.status import Status, StatusCode

from tracing.config import ExportSettings
from tracing.export import BoundedSpanProcessor, SpanStats
from tracing.spans import Attributes, Headers, Span, SpanKind, w3c_headers

_KINDS = {
    "internal": trace.SpanKind.INTERNAL,
    "server": trace.SpanKind.SERVER,
    "client": trace.SpanKind.CLIENT,
}
_PROPAGATOR = TraceContextTextMapPropagator()


def make_sampler(name: str, arg: float) -> Sampler:
    """The SDK sampler `OTEL_TRACES_SAMPLER` calls `name` (one of `tracing.config.SAMPLERS`)."""
    root: Sampler
    base = name.removeprefix("parentbased_")
    if base == "always_on":
        root = ALWAYS_ON
    elif base == "always_off":
        root = ALWAYS_OFF
    elif base == "traceidratio":
        root = TraceIdRatioBased(arg)
    else:
        raise ValueError(f"unknown sampler {name!r}")
    return ParentBased(root) if name.startswith("parentbased_") else root


def make_exporter(settings: ExportSettings) -> SpanExporter:
    """The OTLP span exporter for `settings.protocol` (each imported only when used)."""
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=settings.endpoint, timeout=settings.export_timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=settings.endpoint, timeout=settings.export_timeout_s)


class OtelSpan:
    """A `tracing.spans.Span` over an SDK span (`tracer` opens its children)."""

    __slots__ = ("_ended", "_span", "_tracer")

    def __init__(self, span: trace.Span, tracer: trace.Tracer) -> None:
        self._span = span
        self._tracer = tracer
        self._ended = False

    @property
    def recording(self) -> bool:
        return self._span.is_recording()

    @property
    def trace_id(self) -> str:
        context = self._span.get_span_context()
        if not context.trace_flags.sampled:
            return ""
        return trace.format_trace_id(context.trace_id)

    def child(
        self,
        name: str,
        *,
        kind: SpanKind = "internal",
        start_ns: int | None = None,
        attributes: Attributes | None = None,
    ) -> Span:
        span = self._tracer.start_span(
            name,
            context=trace.set_span_in_context(self._span),
            kind=_KINDS[kind],
            attributes=attributes,
            start_time=start_ns,
        )
        return OtelSpan(span, self._tracer)

    def set(self, attributes: Attributes) -> None:
        self._span.set_attributes(attributes)

    def event(
        self, name: str, time_ns: int | None = None, attributes: Attributes | None = None
    ) -> None:
        self._span.add_event(name, attributes, time_ns)

    def fail(self, status: str, message: str = "") -> None:
        self._span.set_attribute("error.type", status)
        self._span.set_status(Status(StatusCode.ERROR, message or status))

    def end(self, end_ns: int | None = None) -> None:
        if not self._ended:
            self._ended = True
            self._span.end(end_ns)

    def headers(self) -> tuple[tuple[str, str], ...]:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(self._span))
        return tuple(carrier.items())

    def __enter__(self) -> Span:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None and not isinstance(exc, GeneratorExit):  # a closed stream: no error
            self.fail(exc_type.__name__ if exc_type is not None else "error", str(exc))
        self.end()


class OtelTracer:
    """A `tracing.spans.Tracer` over a `TracerProvider` of its own (module docstring)."""

    enabled = True

    def __init__(
        self,
        settings: ExportSettings,
        component: str,
        instance: str,
        exporter: SpanExporter | None = None,
    ) -> None:
        """`exporter`: where spans go (default: the OTLP exporter `settings` name)."""
        self.settings = settings
        self.capture_content = settings.capture_content
        self.stats = SpanStats()
        resource = Resource.create(
            {
                "service.name": settings.service_name,
                "service.instance.id": instance,
                "pdserve.component": component,
            }
        )
        self._provider = TracerProvider(
            sampler=make_sampler(settings.sampler, settings.sampler_arg),
            resource=resource,
            span_limits=SpanLimits(max_attribute_length=4096),
        )
        self._provider.add_span_processor(
            BoundedSpanProcessor(
                exporter if exporter is not None else make_exporter(settings),
                self.stats,
                settings.max_queue_size,
                settings.schedule_delay_ms,
                settings.max_export_batch_size,
            )
        )
        self._tracer = self._provider.get_tracer("pdserve")

    def start(
        self,
        name: str,
        *,
        parent_headers: Headers | None = None,
        kind: SpanKind = "server",
        start_ns: int | None = None,
        attributes: Attributes | None = None,
    ) -> Span:
        carrier = w3c_headers(parent_headers)
        context = _PROPAGATOR.extract(carrier) if carrier else None
        span = self._tracer.start_span(
            name, context=context, kind=_KINDS[kind], attributes=attributes, start_time=start_ns
        )
        return OtelSpan(span, self._tracer)

    def counts(self) -> Mapping[str, int]:
        return self.stats.counts()

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Export every finished span now (tests, benchmarks); False if it timed out."""
        return self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Stop, exporting what is queued for at most `settings.shutdown_timeout_s`: the SDK's
        shutdown runs on a daemon thread, so a hanging collector never holds a stop."""
        done = threading.Thread(target=self._provider.shutdown, name="otel-shutdown", daemon=True)
        done.start()
        done.join(self.settings.shutdown_timeout_s)
