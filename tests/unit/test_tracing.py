"""`tracing`: the ``[tracing]`` settings with the standard OTEL_* environment, the span seam
(one contract over the no-op pair and the SDK pair), and bounded, counted export.

Pure and fast: spans go to the SDK's in-memory exporter or to exporters that the test holds;
no network (the OTLP receiver round trips are in tests/integration/test_tracing_export.py).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tracing import NO_SPAN, NO_TRACER, Tracer, TracingConfig, make_tracer
from tracing.config import DEFAULT_ENDPOINTS, ExportSettings
from tracing.sdk import OtelTracer
from tracing.spans import w3c_headers

ON = TracingConfig(enabled=True)


def _settings(config: TracingConfig = ON, **env: str) -> ExportSettings:
    got = ExportSettings.resolve(config, env)
    assert got is not None
    return got


# ---- settings ------------------------------------------------------------------------------


def test_tracing_is_off_by_default_and_by_otel_sdk_disabled() -> None:
    assert ExportSettings.resolve(TracingConfig(), {"OTEL_EXPORTER_OTLP_ENDPOINT": "x"}) is None
    assert ExportSettings.resolve(ON, {"OTEL_SDK_DISABLED": "true"}) is None
    assert make_tracer(TracingConfig(), "router", "r", env={}) is NO_TRACER


def test_defaults_without_config_or_environment() -> None:
    s = _settings()
    assert (s.protocol, s.endpoint, s.service_name) == (
        "grpc",
        DEFAULT_ENDPOINTS["grpc"],
        "pdserve",
    )
    assert (s.sampler, s.sampler_arg, s.capture_content) == ("parentbased_always_on", 1.0, False)


def test_the_standard_environment_fills_what_the_config_leaves_unset() -> None:
    s = _settings(
        OTEL_EXPORTER_OTLP_ENDPOINT="http://collector:4318/",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_SERVICE_NAME="llm-serving",
        OTEL_TRACES_SAMPLER="parentbased_traceidratio",
        OTEL_TRACES_SAMPLER_ARG="0.1",
    )
    # the base endpoint of every signal gets the traces path with http/protobuf, as in the SDK
    assert (s.protocol, s.endpoint) == ("http/protobuf", "http://collector:4318/v1/traces")
    assert (s.service_name, s.sampler, s.sampler_arg) == (
        "llm-serving",
        "parentbased_traceidratio",
        0.1,
    )
    # the traces-specific variables win over the general ones, and are used as they are
    s = _settings(
        OTEL_EXPORTER_OTLP_ENDPOINT="http://a:4317",
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="http://b:9999/custom",
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
    )
    assert (s.protocol, s.endpoint) == ("http/protobuf", "http://b:9999/custom")
    assert _settings(OTEL_EXPORTER_OTLP_ENDPOINT="http://a:4317").endpoint == "http://a:4317"


def test_the_config_wins_over_the_environment() -> None:
    config = TracingConfig(
        enabled=True,
        endpoint="http://mine:4317",
        protocol="grpc",
        service_name="mine",
        sampler="traceidratio",
        sampler_arg=0.5,
    )
    s = _settings(
        config,
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="http://env:1",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_SERVICE_NAME="env",
        OTEL_TRACES_SAMPLER="always_off",
        OTEL_TRACES_SAMPLER_ARG="0.9",
    )
    assert (s.endpoint, s.protocol, s.service_name, s.sampler, s.sampler_arg) == (
        "http://mine:4317",
        "grpc",
        "mine",
        "traceidratio",
        0.5,
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        ("OTEL_TRACES_SAMPLER", "sometimes"),
        ("OTEL_TRACES_SAMPLER_ARG", "2"),
        ("OTEL_TRACES_SAMPLER_ARG", "half"),
    ],
)
def test_a_bad_environment_value_names_its_variable(name: str, value: str) -> None:
    env = {name: value, "OTEL_TRACES_SAMPLER": "traceidratio"} if "ARG" in name else {name: value}
    with pytest.raises(ValueError, match=name):
        ExportSettings.resolve(ON, env)


def test_tracing_off_imports_no_opentelemetry() -> None:
    """Off means off: building the router's and a worker's tracer imports nothing of the SDK
    (nor does importing the request path)."""
    code = (
        "import sys, router.app, worker.service, tracing\n"
        "from tracing import TracingConfig, make_tracer\n"
        "make_tracer(TracingConfig(), 'router', 'r')\n"
        "bad = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the span seam: one contract over both tracers -------------------------------------------


@pytest.fixture(params=["off", "sdk"])
def tracer(request: pytest.FixtureRequest) -> Iterator[tuple[Tracer, InMemorySpanExporter | None]]:
    if request.param == "off":
        yield NO_TRACER, None
        return
    exporter = InMemorySpanExporter()
    t = OtelTracer(
        _settings(TracingConfig(enabled=True, schedule_delay_ms=1)), "router", "r", exporter
    )
    yield t, exporter
    t.shutdown()


def test_span_contract(tracer: tuple[Tracer, InMemorySpanExporter | None]) -> None:
    """Every call works, and nothing raises, with tracing on or off; on, the spans form one
    trace with the parents, times, attributes and statuses given."""
    t, exporter = tracer
    root = t.start("pdserve.request", attributes={"gen_ai.request.model": "m"}, start_ns=1_000)
    child = root.child("pdserve.prefill", kind="client", start_ns=2_000)
    headers = child.headers()
    child.set({"pdserve.worker.id": "p0"})
    child.event("first_token", time_ns=3_000)
    child.end(4_000)
    child.end(5_000)  # later ends do nothing
    with pytest.raises(KeyError), root.child("pdserve.decode"):
        raise KeyError("lost")
    remote = t.start("pdserve.worker.prefill", parent_headers=headers)
    remote.end()
    root.fail("UNAVAILABLE", "no decode worker")
    root.end(6_000)
    if exporter is None:
        assert root is NO_SPAN and headers == () and root.trace_id == ""
        return
    assert isinstance(t, OtelTracer) and t.force_flush()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {
        "pdserve.request",
        "pdserve.prefill",
        "pdserve.decode",
        "pdserve.worker.prefill",
    }
    r, p, d, w = (
        spans[n]
        for n in ("pdserve.request", "pdserve.prefill", "pdserve.decode", "pdserve.worker.prefill")
    )
    assert {s.context.trace_id for s in spans.values()} == {r.context.trace_id}
    assert root.trace_id == f"{r.context.trace_id:032x}"
    assert p.parent is not None and p.parent.span_id == r.context.span_id
    assert w.parent is not None and w.parent.span_id == p.context.span_id  # over the headers
    assert (p.start_time, p.end_time, r.start_time, r.end_time) == (2_000, 4_000, 1_000, 6_000)
    assert p.attributes is not None and p.attributes["pdserve.worker.id"] == "p0"
    assert [(e.name, e.timestamp) for e in p.events] == [("first_token", 3_000)]
    assert d.status.status_code.name == "ERROR" and r.status.status_code.name == "ERROR"
    assert r.attributes is not None and r.attributes["error.type"] == "UNAVAILABLE"
    assert dict(headers)["traceparent"].split("-")[1] == root.trace_id


def test_a_client_trace_context_is_continued_from_http_headers_or_grpc_metadata() -> None:
    exporter = InMemorySpanExporter()
    t = OtelTracer(_settings(), "router", "r", exporter)
    client_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = f"00-{client_trace}-00f067aa0ba902b7-01"
    assert w3c_headers({"traceparent": parent, "authorization": "Bearer x"}) == {
        "traceparent": parent
    }
    assert w3c_headers([("traceparent", parent), ("x-b", b"1")]) == {"traceparent": parent}
    for headers in ({"traceparent": parent}, [("traceparent", parent)]):
        span = t.start("pdserve.request", parent_headers=headers)
        assert span.trace_id == client_trace
        span.end()
    t.force_flush()
    for s in exporter.get_finished_spans():
        assert s.parent is not None and f"{s.parent.span_id:016x}" == "00f067aa0ba902b7"
    t.shutdown()


def test_a_sampled_out_request_records_nothing_and_propagates_the_decision() -> None:
    exporter = InMemorySpanExporter()
    config = TracingConfig(enabled=True, sampler="parentbased_traceidratio", sampler_arg=0.0)
    t = OtelTracer(_settings(config), "router", "r", exporter)
    span = t.start("pdserve.request")
    child = span.child("pdserve.prefill")
    assert not span.recording and span.trace_id == ""
    flags = int(dict(child.headers())["traceparent"][-2:], 16)
    assert not flags & 1  # the workers follow: not sampled
    child.end()
    span.end()
    t.force_flush()
    assert exporter.get_finished_spans() == ()
    t.shutdown()


# ---- bounded, counted export -------------------------------------------------------------------


class _HeldExporter(SpanExporter):
    """Blocks every export until `release`; answers `result`."""

    def __init__(self, result: SpanExportResult = SpanExportResult.SUCCESS) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.result = result

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(30)
        return self.result

    def shutdown(self) -> None:
        self.release.set()


def test_a_stuck_exporter_drops_and_counts_never_blocks() -> None:
    """With the exporter stuck in its first export, spans beyond the queue bound are dropped at
    once and counted; once it answers, the queue drains and every span is accounted for."""
    held = _HeldExporter()
    config = TracingConfig(
        enabled=True, max_queue_size=8, max_export_batch_size=4, schedule_delay_ms=1
    )
    t = OtelTracer(_settings(config), "worker", "w", held)
    t.start("first").end()
    assert held.entered.wait(10), "the export thread never exported"
    for i in range(20):  # the export thread is stuck: none of these may wait for it
        t.start(f"s{i}").end()
    counts = t.counts()
    assert counts["queue_full"] == 20 - 8 and counts["exported"] == 0
    held.release.set()
    assert t.force_flush()
    assert t.counts() == {"exported": 1 + 8, "queue_full": 12, "export_failed": 0}
    t.shutdown()


def test_a_failing_exporter_counts_its_batches_as_dropped() -> None:
    held = _HeldExporter(SpanExportResult.FAILURE)
    held.release.set()
    t = OtelTracer(_settings(TracingConfig(enabled=True, schedule_delay_ms=1)), "worker", "w", held)
    for i in range(5):
        t.start(f"s{i}").end()
    t.force_flush()
    assert t.counts() == {"exported": 0, "queue_full": 0, "export_failed": 5}
    t.shutdown()
