"""The router's spans against fake workers and a real OTLP receiver (`tracing.receiver`):
one trace per request, its phases in order under ``pdserve.request``, the W3C context carried
on every worker call, a client's ``traceparent`` (gRPC metadata or HTTP header) continued, a
migration as a span, and the trace id as an exemplar on the OpenMetrics ``/metrics``. With
tracing off the workers get no ``traceparent`` at all.

Runs in the pytest process: router and fake workers on its event loop, the receiver on its own
threads, all on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import grpc
import pytest

from proto.pdserve.v1 import inference_pb2 as ipb
from router.request_trace import ROOT
from tests.fakes.cluster import fake_cluster
from tests.fakes.fake_worker import FakeWorkerConfig
from tracing import TracingConfig
from tracing.receiver import OtlpReceiver, ReceivedSpan

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


def _tracing(r: OtlpReceiver) -> TracingConfig:
    return TracingConfig(enabled=True, endpoint=r.grpc_endpoint, schedule_delay_ms=20)


def req(rid: str, max_tokens: int = 4) -> ipb.GenerateRequest:
    return ipb.GenerateRequest(
        request_id=rid,
        token_ids=ipb.TokenIds(ids=[5, 6, 7]),
        sampling=ipb.SamplingParams(max_tokens=max_tokens),
    )


def _complete(names: set[str]) -> object:
    """A `wait_for` condition: the trace's root and every span named in `names` arrived."""

    def done(spans: list[ReceivedSpan]) -> bool:
        roots = [s for s in spans if s.name == ROOT]
        return bool(roots) and names <= {s.name for s in spans if s.trace_id == roots[-1].trace_id}

    return done


def test_one_trace_per_request_with_its_phases_and_the_client_context(
    tiny_model_dir: Path, receiver: OtlpReceiver
) -> None:
    async def scenario() -> list[ReceivedSpan]:
        async with fake_cluster(tiny_model_dir, tracing=_tracing(receiver)) as c:
            call = c.stub.Generate(
                req("r1"), timeout=10, metadata=(("traceparent", CLIENT_PARENT),)
            )
            got = [r async for r in call]
            assert got[-1].final.finish_reason
            # the W3C context went along on every worker call, in the client's trace
            for w, method in (
                (c.decode[0], "Reserve"),
                (c.prefill[0], "Prefill"),
                (c.decode[0], "Decode"),
            ):
                assert w.traceparents[method].split("-")[1] == CLIENT_TRACE, method
            names = {
                "pdserve.tokenize",
                "pdserve.admission_queue",
                "pdserve.reserve",
                "pdserve.prefill",
                "pdserve.decode",
            }
            return receiver.wait_for(_complete(names), 30.0, "the request's trace")

    spans = asyncio.run(scenario())
    trace = [s for s in spans if s.trace_id == CLIENT_TRACE]
    by_name = {s.name: s for s in trace}
    root = by_name[ROOT]
    assert root.parent_id == CLIENT_SPAN and root.kind == SERVER
    assert root.attributes["gen_ai.request.model"] == tiny_model_dir.resolve().name
    assert root.attributes["gen_ai.usage.input_tokens"] == 3
    assert root.attributes["gen_ai.usage.output_tokens"] == 4
    assert root.attributes["pdserve.request_id"] == "r1"
    assert root.attributes["pdserve.status"] == "OK"
    assert (
        root.attributes["pdserve.path"] == "remote" and root.attributes["pdserve.migrations"] == 0
    )
    assert [e[0] for e in root.events] == ["first_token"]
    order = [
        "pdserve.tokenize",
        "pdserve.admission_queue",
        "pdserve.reserve",
        "pdserve.prefill",
        "pdserve.decode",
    ]
    for name in order:
        s = by_name[name]
        assert s.parent_id == root.span_id, name
        assert root.start_ns <= s.start_ns <= s.end_ns <= root.end_ns, name
    for a, b in itertools.pairwise(order):
        assert by_name[a].end_ns <= by_name[b].start_ns, (a, b)
    for name in ("pdserve.reserve", "pdserve.prefill", "pdserve.decode"):
        assert by_name[name].kind == CLIENT and by_name[name].attributes["rpc.system"] == "grpc"
    # no content without capture_content
    assert not any("messages" in k for s in trace for k in s.attributes)


def test_http_traceparent_and_exemplars(tiny_model_dir: Path, receiver: OtlpReceiver) -> None:
    async def scenario() -> tuple[str, str, str]:
        async with fake_cluster(tiny_model_dir, tracing=_tracing(receiver), http_port=0) as c:
            assert c.router.http is not None
            base = f"http://127.0.0.1:{c.router.http.port}"
            async with aiohttp.ClientSession() as http:
                body = {
                    "model": c.router.config.served_model_name,
                    "prompt": [5, 6, 7],
                    "max_tokens": 3,
                }
                async with http.post(
                    f"{base}/v1/completions", json=body, headers={"traceparent": CLIENT_PARENT}
                ) as resp:
                    assert resp.status == 200, await resp.text()
                receiver.wait_for(_complete(set()), 30.0, "the HTTP request's trace")
                accept = {"Accept": "application/openmetrics-text; version=1.0.0"}
                async with http.get(f"{base}/metrics", headers=accept) as resp:
                    openmetrics = await resp.text()
                    content_type = resp.headers["Content-Type"]
                async with http.get(f"{base}/metrics") as resp:
                    text = await resp.text()
            return openmetrics, content_type, text

    openmetrics, content_type, text = asyncio.run(scenario())
    roots = [s for s in receiver.spans() if s.name == ROOT]
    assert [s.trace_id for s in roots] == [CLIENT_TRACE]
    assert roots[0].attributes["gen_ai.operation.name"] == "text_completion"
    assert content_type.startswith("application/openmetrics-text")
    ttft = [
        line
        for line in openmetrics.splitlines()
        if line.startswith("pdserve:time_to_first_token_seconds_bucket") and "#" in line
    ]
    assert ttft and all(f'trace_id="{CLIENT_TRACE}"' in line for line in ttft), ttft
    assert "pdserve:tracing_spans_dropped_total" in openmetrics
    assert "trace_id" not in text  # the text format has no exemplars


def test_a_migration_is_a_span_holding_the_new_leg(
    tiny_model_dir: Path, receiver: OtlpReceiver
) -> None:
    async def scenario() -> list[ReceivedSpan]:
        worker = FakeWorkerConfig(token_delay_s=0.01)
        async with fake_cluster(
            tiny_model_dir, n_decode=2, worker=worker, tracing=_tracing(receiver)
        ) as c:
            call = c.stub.Generate(req("m1", 40), timeout=10)
            tokens: list[int] = []
            while len(tokens) < 3:
                resp = await call.read()
                tokens += resp.token_ids
            victim = next(w for w in c.decode if "m1" in w.held)
            await victim.stop()
            while (resp := await call.read()) is not grpc.aio.EOF:
                tokens += resp.token_ids
            assert len(tokens) == 40
            return receiver.wait_for(_complete({"pdserve.migration"}), 30.0, "the migration span")

    spans = asyncio.run(scenario())
    root = next(s for s in spans if s.name == ROOT)
    trace = [s for s in spans if s.trace_id == root.trace_id]
    migration = next(s for s in trace if s.name == "pdserve.migration")
    assert migration.parent_id == root.span_id
    assert migration.attributes["pdserve.migration"] == 1
    assert migration.attributes["pdserve.migration.tokens_sent"] >= 3
    assert root.attributes["pdserve.migrations"] == 1
    under = {s.name for s in trace if s.parent_id == migration.span_id}
    assert {"pdserve.reserve", "pdserve.prefill", "pdserve.decode"} <= under
    first_decode = next(
        s for s in trace if s.name == "pdserve.decode" and s.parent_id == root.span_id
    )
    assert first_decode.status_code == 2  # the stream that failed


def test_tracing_off_sends_no_trace_context(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir) as c:
            await c.generate(req("off"))
            assert c.router.tracer.enabled is False
            assert c.prefill[0].traceparents["Prefill"] == ""
            assert c.decode[0].traceparents["Decode"] == ""

    asyncio.run(scenario())
