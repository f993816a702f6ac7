"""OpenTelemetry traces through a real 1P+2D cluster (issue 44), collected by an in-process
OTLP receiver (`tracing.receiver`: the protocol's own gRPC TraceService, not a stand-in for
pdserve code).

- one request through one prefill and one decode worker is one trace: the router's spans, the
  prefill worker's and the decode worker's, each worker span under the router call that
  caused it; the phases agree with the request's own TTFT breakdown (`FinalInfo.timings`)
  within 5 ms;
- a client's ``traceparent`` (gRPC metadata) is continued;
- a decode worker killed mid-stream shows as a ``pdserve.migration`` span holding the new
  leg's calls, whose worker spans come from the other decode worker.

The tests wait on states (spans arrived, a worker seen running the request), never on time.
Runs in the pytest process; one cluster for the module, stopped by PID at the end.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from deploy.client import CHANNEL_OPTIONS, build_request
from proto.pdserve.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from router.request_trace import ROOT
from tests.e2e.helpers import E2ECluster, wait_until
from tracing.receiver import OtlpReceiver, ReceivedSpan
from worker.step_gate import hold, release

pytestmark = pytest.mark.slow
PROMPT = [(i * 31) % 900 + 7 for i in range(40)]
TOL_MS = 5.0
CLIENT_TRACE = "5bd66ef5095369c7b0d1f8f4bd33716a"
CLIENT_SPAN = "c1a27e0f9d6b4c3a"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def cluster(
    start_cluster: Callable[..., Iterator[E2ECluster]], receiver: OtlpReceiver, hold_dir: Path
) -> Iterator[E2ECluster]:
    """`hold_dir`: the workers' step gates (`worker.step_gate`), set before they start."""
    overrides: dict[str, object] = {
        "tracing.enabled": True,
        "tracing.endpoint": receiver.grpc_endpoint,
        "tracing.schedule_delay_ms": 50,
        "supervision.backoff_s": 0.1,
        "router.max_migrations": 1,
    }
    yield from start_cluster("tracing", "disagg", overrides, prefill=1, decode=2)


def _trace_of(receiver: OtlpReceiver, request_id: str, names: set[str]) -> list[ReceivedSpan]:
    """The spans of `request_id`'s trace, once its root and every span in `names` arrived."""

    def trace(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        roots = [
            s
            for s in spans
            if s.name == ROOT and s.attributes.get("pdserve.request_id") == request_id
        ]
        return [s for s in spans if roots and s.trace_id == roots[0].trace_id]

    receiver.wait_for(
        lambda spans: names <= {s.name for s in trace(spans)}, 60.0, f"{request_id}'s spans"
    )
    return trace(receiver.spans())


def _one(spans: list[ReceivedSpan], name: str, parent: ReceivedSpan | None = None) -> ReceivedSpan:
    found = [
        s for s in spans if s.name == name and (parent is None or s.parent_id == parent.span_id)
    ]
    assert len(found) == 1, (name, [(s.name, s.parent_id) for s in spans])
    return found[0]


def _ms(ns: int) -> float:
    return ns / 1e6


def test_one_request_is_one_trace_across_router_prefill_and_decode(
    cluster: E2ECluster, receiver: OtlpReceiver
) -> None:
    req = build_request(token_ids=PROMPT, max_tokens=8, temperature=0.0, request_id="trace-1")
    tokens, final = cluster.generate(req)
    assert len(tokens) == 8 and final.prefill_path == "remote"
    worker_spans = {
        "pdserve.worker.reserve",
        "pdserve.worker.prefill",
        "pdserve.prefill.queue",
        "pdserve.prefill.compute",
        "pdserve.kv_transfer",
        "pdserve.worker.decode",
        "pdserve.decode.admission",
        "pdserve.decode.first_step",
    }
    spans = _trace_of(receiver, "trace-1", worker_spans)
    assert len({s.trace_id for s in spans}) == 1
    root = _one(spans, ROOT)
    assert root.parent_id == "" and root.resource["pdserve.component"] == "router"
    # router -> worker, each worker span under the call that caused it
    reserve, prefill, decode = (
        _one(spans, f"pdserve.{m}", root) for m in ("reserve", "prefill", "decode")
    )
    w_reserve = _one(spans, "pdserve.worker.reserve", reserve)
    w_prefill = _one(spans, "pdserve.worker.prefill", prefill)
    w_decode = _one(spans, "pdserve.worker.decode", decode)
    assert w_prefill.resource["service.instance.id"] == final.prefill_worker
    assert w_reserve.resource["service.instance.id"] == final.decode_worker
    assert w_decode.resource["service.instance.id"] == final.decode_worker
    assert {w_prefill.resource["pdserve.component"], w_decode.resource["pdserve.component"]} == {
        "worker"
    }
    queue = _one(spans, "pdserve.prefill.queue", w_prefill)
    compute = _one(spans, "pdserve.prefill.compute", w_prefill)
    kv = _one(spans, "pdserve.kv_transfer", w_prefill)
    admission = _one(spans, "pdserve.decode.admission", w_decode)
    first_step = _one(spans, "pdserve.decode.first_step", w_decode)
    assert kv.attributes["pdserve.kv.plane"] == "shm"  # same host, shared memory on (default)
    assert kv.attributes["pdserve.kv.layers"] > 0 and kv.attributes["pdserve.kv.bytes"] > 0
    # every worker span inside the router's call (one host: one clock)
    for outer, inner in ((reserve, w_reserve), (prefill, w_prefill), (decode, w_decode)):
        assert _ms(inner.start_ns - outer.start_ns) > -TOL_MS, inner.name
        assert _ms(outer.end_ns - inner.end_ns) > -TOL_MS, inner.name
    # the spans tell the request's own TTFT breakdown
    t = final.timings
    admission_queue = _one(spans, "pdserve.admission_queue", root)
    pairs = [
        (admission_queue.duration_ms, t.router_queue_ms, "router queue"),
        (queue.duration_ms, t.prefill_queue_ms, "prefill queue"),
        (compute.duration_ms, t.prefill_compute_ms, "prefill compute"),
        (_ms(kv.end_ns - compute.end_ns), t.kv_transfer_ms, "exposed KV transfer"),
        (admission.duration_ms, t.decode_admission_ms, "decode admission"),
        (first_step.duration_ms, t.first_decode_step_ms, "first decode step"),
    ]
    (first_token,) = (e for e in root.events if e[0] == "first_token")
    pairs.append((_ms(first_token[1] - root.start_ns), t.ttft_ms, "TTFT"))
    for span_ms, final_ms, what in pairs:
        assert abs(span_ms - final_ms) <= TOL_MS, (what, span_ms, final_ms)
    assert kv.start_ns <= compute.end_ns  # pushed layer by layer while the prompt computed
    assert queue.end_ns <= compute.start_ns + 1 and compute.end_ns <= w_prefill.end_ns
    assert root.attributes["gen_ai.usage.output_tokens"] == 8
    assert root.attributes["pdserve.path"] == "remote"
    assert not any(k.startswith("gen_ai.input") for s in spans for k in s.attributes)


def test_a_client_traceparent_is_continued(cluster: E2ECluster, receiver: OtlpReceiver) -> None:
    req = build_request(token_ids=PROMPT[:20], max_tokens=3, temperature=0.0, request_id="trace-2")
    parent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    for _ in cluster.stub.Generate(req, timeout=30.0, metadata=(("traceparent", parent),)):
        pass
    spans = _trace_of(receiver, "trace-2", {"pdserve.worker.prefill", "pdserve.worker.decode"})
    root = _one(spans, ROOT)
    assert root.trace_id == CLIENT_TRACE and root.parent_id == CLIENT_SPAN


def _kill_the_decoder_that_runs_it(cluster: E2ECluster, stream: Future[object]) -> str:
    """SIGKILL the decode worker seen (by its own status, one open channel per worker) running
    the request; its id. Its first token came from the prefill worker and reached the client,
    so the router moves it whatever the decode worker had done. The decode workers hold their
    steps (the caller's `worker.step_gate`), so the request cannot end before it is seen."""
    internal = cluster.local.workers.internal
    decoders = [w for w in cluster.local.workers.workers if w.role == "decode"]
    channels = [internal.channel(w.address, CHANNEL_OPTIONS) for w in decoders]
    try:
        stubs = [internal.stub(worker_pb2_grpc.WorkerStub(ch)) for ch in channels]
        get = worker_pb2.GetStatusRequest()
        deadline = time.monotonic() + 60.0
        while True:
            assert time.monotonic() < deadline, "no decode worker ran the request"
            assert not stream.done(), "the request ended before a decode worker ran it"
            for w, stub in zip(decoders, stubs, strict=True):
                status = stub.GetStatus(get, timeout=5.0)
                if status.num_running > 0:
                    os.kill(w.process.pid, signal.SIGKILL)
                    return status.worker_id
    finally:
        for ch in channels:
            ch.close()


def test_a_migration_shows_as_a_span(
    cluster: E2ECluster, receiver: OtlpReceiver, hold_dir: Path
) -> None:
    decoders = [w for w in cluster.local.workers.workers if w.role == "decode"]
    wait_until(
        lambda: all(cluster.status(w.address).num_running == 0 for w in decoders),
        30.0,
        "the decode workers to be idle",
    )
    restarts = sum(e.kind == "restarted" for e in cluster.local.workers.events)
    req = build_request(token_ids=PROMPT, max_tokens=64, temperature=0.0, request_id="trace-3")

    def stream() -> object:
        return cluster.generate(req, timeout=120.0)[1]

    statuses = [cluster.status(w.address) for w in decoders]
    ids = [st.worker_id for st in statuses]
    for st in statuses:  # two steps (admitted, one token), then none until the victim is killed
        hold(hold_dir, st.worker_id, st.engine_steps + 2)
    try:
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(stream)
            victim = _kill_the_decoder_that_runs_it(cluster, call)
            for worker_id in ids:
                release(hold_dir, worker_id)
            final = call.result()
    finally:
        for worker_id in ids:
            release(hold_dir, worker_id)
    assert isinstance(final, inference_pb2.FinalInfo)
    assert final.migrations == 1 and final.decode_worker != victim
    spans = _trace_of(receiver, "trace-3", {"pdserve.migration", "pdserve.worker.decode"})
    root = _one(spans, ROOT)
    migration = _one(spans, "pdserve.migration", root)
    assert migration.attributes["pdserve.migration"] == 1
    assert root.attributes["pdserve.migrations"] == 1
    # the new leg: its calls under the migration, its decode on the other worker
    receiver.wait_for(
        lambda spans: any(
            s.name == "pdserve.worker.decode"
            and s.resource.get("service.instance.id") == final.decode_worker
            and s.trace_id == root.trace_id
            for s in spans
        ),
        60.0,
        "the new leg's decode span",
    )
    spans = [s for s in receiver.spans() if s.trace_id == root.trace_id]
    new_decode = _one(spans, "pdserve.decode", migration)
    _one(spans, "pdserve.prefill", migration)
    w_decode = _one(spans, "pdserve.worker.decode", new_decode)
    assert w_decode.resource["service.instance.id"] == final.decode_worker
    old_decode = _one(spans, "pdserve.decode", root)
    assert old_decode.status_code == 2 and old_decode.end_ns <= migration.start_ns
    wait_until(
        lambda: sum(e.kind == "restarted" for e in cluster.local.workers.events) > restarts,
        90.0,
        "the killed decode worker to be restarted",
    )
    cluster.wait_no_leaks(30.0)
