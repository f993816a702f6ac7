"""Spans over the wire: an SDK tracer (`tracing.sdk.OtelTracer`, the real OTLP exporters)
against the in-process OTLP receiver (`tracing.receiver`, the protocol's own gRPC service and
HTTP endpoint), both protocols; a collector that is down or hangs costs spans (counted), never
a wait.

Runs in the pytest process; the receiver on 127.0.0.1, a free port.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tracing import TracingConfig, make_tracer
from tracing.receiver import OtlpReceiver, ReceivedSpan
from tracing.sdk import OtelTracer


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


def _tracer(endpoint: str, protocol: str, **fields: object) -> OtelTracer:
    config = TracingConfig.model_validate(
        {"enabled": True, "endpoint": endpoint, "protocol": protocol, "schedule_delay_ms": 20}
        | fields
    )
    t = make_tracer(config, "router", "router-0", env={})
    assert isinstance(t, OtelTracer)
    return t


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_spans_reach_an_otlp_receiver(receiver: OtlpReceiver, protocol: str) -> None:
    endpoint = receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint
    t = _tracer(endpoint, protocol, service_name="svc")
    root = t.start("pdserve.request", attributes={"gen_ai.request.model": "tiny"})
    root.child("pdserve.tokenize", attributes={"n": 3}).end()
    root.end()

    def both(spans: list[ReceivedSpan]) -> bool:
        return len(spans) == 2

    spans = {s.name: s for s in receiver.wait_for(both, 30.0, "two spans")}
    req, tok = spans["pdserve.request"], spans["pdserve.tokenize"]
    assert tok.parent_id == req.span_id and tok.trace_id == req.trace_id == root.trace_id
    assert req.attributes == {"gen_ai.request.model": "tiny"} and tok.attributes == {"n": 3}
    assert req.resource["service.name"] == "svc"
    assert req.resource["pdserve.component"] == "router"
    assert req.resource["service.instance.id"] == "router-0"
    t.shutdown()
    assert t.counts() == {"exported": 2, "queue_full": 0, "export_failed": 0}


def test_a_collector_that_is_down_costs_spans_not_time() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = _tracer(f"http://127.0.0.1:{port}", "grpc", export_timeout_s=0.5)
    for i in range(10):
        t.start(f"s{i}").end()
    assert t.force_flush(30.0)
    assert t.counts() == {"exported": 0, "queue_full": 0, "export_failed": 10}
    t.shutdown()


def test_a_hanging_collector_drops_beyond_the_queue_and_never_holds_a_stop(
    receiver: OtlpReceiver,
) -> None:
    """The collector takes the connection and never answers: spans wait in the bounded queue,
    the rest are dropped and counted at once; `shutdown` returns within its own bound."""
    receiver.hold()
    t = _tracer(
        receiver.grpc_endpoint,
        "grpc",
        max_queue_size=4,
        max_export_batch_size=2,
        export_timeout_s=30.0,
        shutdown_timeout_s=0.2,
    )
    t.start("first").end()  # taken by the export thread, which then hangs in the call
    deadline = time.monotonic() + 30.0
    while t.stats.waiting:  # until the export thread took it (and hangs in the call)
        assert time.monotonic() < deadline, "the export thread never took the span"
        time.sleep(0.01)
    for i in range(10):
        t.start(f"s{i}").end()
    assert t.counts()["queue_full"] == 10 - 4
    t.shutdown()
    receiver.release()


def test_a_stopped_receiver_leaves_no_thread() -> None:
    """`stop` ends the receiver's threads, its gRPC handler pool's too (grpc never stops a
    pool it is given: a test process would keep them, idle, per receiver)."""
    before = set(threading.enumerate())
    r = OtlpReceiver().start()
    t = _tracer(r.grpc_endpoint, "grpc")
    t.start("one").end()
    r.wait_for(lambda spans: len(spans) == 1, 30.0, "the span")
    t.shutdown()
    started = [
        x for x in threading.enumerate() if x not in before and x.name.startswith("otlp-receiver")
    ]
    assert any(x.name.startswith("otlp-receiver_") for x in started), started  # a handler ran
    r.stop()
    for thread in started:
        thread.join(10)
        assert not thread.is_alive(), thread.name
