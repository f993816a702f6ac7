"""`worker.tracing`: an RPC's spans built from the numbers its answer carries, placed from the
RPC's arrival. Pure: the SDK's in-memory exporter, fabricated answers, no engine. (Tracing
off — `NO_RPC_TRACE`, no OpenTelemetry imported — is tests/unit/test_tracing.py's.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proto.pdserve.v1 import worker_pb2
from tracing import TracingConfig
from tracing.config import ExportSettings
from tracing.sdk import OtelTracer
from worker.tracing import RpcSpans

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def traced() -> Iterator[tuple[OtelTracer, InMemorySpanExporter]]:
    settings = ExportSettings.resolve(TracingConfig(enabled=True), {})
    assert settings is not None
    exporter = InMemorySpanExporter()
    tracer = OtelTracer(settings, "worker", "w0", exporter)
    yield tracer, exporter
    tracer.shutdown()


def _spans(tracer: OtelTracer, exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    tracer.force_flush()
    return {s.name: s for s in exporter.get_finished_spans()}


def _ms(a: int, b: int) -> float:
    return (b - a) / 1e6


def test_prefill_spans_follow_the_answers_numbers(
    traced: tuple[OtelTracer, InMemorySpanExporter],
) -> None:
    tracer, exporter = traced
    request = worker_pb2.PrefillRequest(request_id="r", prompt_token_ids=[1, 2, 3])
    trace = RpcSpans(tracer, "Prefill", request, [("traceparent", PARENT)], time.monotonic(), "w0")
    trace.answered(
        worker_pb2.PrefillResponse(
            queue_ms=10.0,
            compute_ms=30.0,
            transfer_ms=2.0,
            kv_total_ms=25.0,
            kv_bytes=4096,
            kv_layers=12,
            kv_plane="shm",
            cached_tokens=1,
        )
    )
    trace.end()
    s = _spans(tracer, exporter)
    server, queue, compute, kv = (
        s[n]
        for n in (
            "pdserve.worker.prefill",
            "pdserve.prefill.queue",
            "pdserve.prefill.compute",
            "pdserve.kv_transfer",
        )
    )
    assert server.parent is not None and f"{server.parent.span_id:016x}" == "b7ad6b7169203331"
    for child in (queue, compute, kv):
        assert child.parent is not None and child.parent.span_id == server.context.span_id
    assert server.start_time is not None and queue.start_time == server.start_time
    assert _ms(queue.start_time, queue.end_time) == pytest.approx(10.0, abs=1e-3)
    assert _ms(server.start_time, compute.start_time) == pytest.approx(10.0, abs=1e-3)
    assert _ms(compute.start_time, compute.end_time) == pytest.approx(30.0, abs=1e-3)
    # the transfer ends at its result (queue + compute + exposed part), lasting kv_total_ms
    assert _ms(server.start_time, kv.end_time) == pytest.approx(42.0, abs=1e-3)
    assert _ms(kv.start_time, kv.end_time) == pytest.approx(25.0, abs=1e-3)
    assert kv.attributes == {
        "pdserve.kv.bytes": 4096,
        "pdserve.kv.layers": 12,
        "pdserve.kv.plane": "shm",
        "pdserve.kv.exposed_ms": 2.0,
    }
    assert server.attributes is not None and server.attributes["gen_ai.usage.input_tokens"] == 3


def test_decode_spans_from_the_first_chunk_and_a_failed_stream(
    traced: tuple[OtelTracer, InMemorySpanExporter],
) -> None:
    tracer, exporter = traced
    request = worker_pb2.DecodeRequest(request_id="r")
    trace = RpcSpans(tracer, "Decode", request, (), time.monotonic(), "w0")
    trace.chunk(worker_pb2.TokenChunk(token_ids=[5], admission_ms=4.0, first_step_ms=6.0))
    trace.chunk(worker_pb2.TokenChunk(token_ids=[6, 7], admission_ms=99.0))  # only the first
    trace.failed("UNAVAILABLE", "worker stopping")
    trace.end()
    s = _spans(tracer, exporter)
    server, admission, step = (
        s[n]
        for n in ("pdserve.worker.decode", "pdserve.decode.admission", "pdserve.decode.first_step")
    )
    assert server.parent is None  # no traceparent came: a trace of its own
    assert _ms(admission.start_time, admission.end_time) == pytest.approx(4.0, abs=1e-3)
    assert _ms(step.start_time, step.end_time) == pytest.approx(6.0, abs=1e-3)
    assert step.start_time == admission.end_time
    assert server.attributes is not None and server.attributes["gen_ai.usage.output_tokens"] == 3
    assert server.status.status_code.name == "ERROR"
