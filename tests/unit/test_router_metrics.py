"""The router's Prometheus metrics: what one request record, one prefix lookup and one ratio
decision add, read back through `prometheus_client.parser` from a real exposition."""

from __future__ import annotations

import asyncio

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.admission import Admission
from router.lifecycle import RequestRecord
from router.metrics import RouterMetrics
from router.ratio.config import RatioConfig
from router.ratio.driver import RatioController
from tests.fakes.ratio_pool import FakePool


def samples(metrics: RouterMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape: (name, sorted labels without model_name) -> value."""
    body, ctype = metrics.exposition()
    assert ctype.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            assert s.labels.get("model_name") == "m", s
            out[(s.name, labels)] = s.value
    return out


def test_records_lookups_and_live_gauges() -> None:
    pool = FakePool({"p:1": "prefill", "d:1": "decode", "d:2": "decode"})
    pool.workers["d:2"] = pool.workers["d:2"].__class__("d:2", "d:2", "decode", False, False)
    admission = Admission(max_inflight=2, max_queued=4)
    m = RouterMetrics("m", admission, pool.views)
    m.record(
        RequestRecord(
            finish_reason="length",
            queue_s=0.001,
            ttft_s=0.05,
            tpot_s=0.01,
            e2e_s=0.2,
            inter_token_s=[0.01, 0.02],
            prompt_tokens=7,
            completion_tokens=3,
        )
    )
    m.record(RequestRecord(status="RESOURCE_EXHAUSTED", e2e_s=0.001))
    m.record(RequestRecord(status="CANCELLED", queue_s=0.0, ttft_s=0.02, e2e_s=0.03))
    m.observe_prefix_lookup("hit", 0.0004, 32)
    m.observe_prefix_lookup("miss", 0.0003, 0)
    m.observe_prefix_lookup("timeout", None, 0)
    got = samples(m)
    assert got[("pdserve:request_success_total", (("finished_reason", "length"),))] == 1
    assert got[("pdserve:request_failure_total", (("status", "RESOURCE_EXHAUSTED"),))] == 1
    assert got[("pdserve:request_failure_total", (("status", "CANCELLED"),))] == 1
    assert got[("pdserve:time_to_first_token_seconds_count", ())] == 2
    assert got[("pdserve:time_per_output_token_seconds_count", ())] == 1
    assert got[("pdserve:inter_token_latency_seconds_count", ())] == 2
    assert got[("pdserve:inter_token_latency_seconds_sum", ())] == 0.03
    assert got[("pdserve:e2e_request_latency_seconds_count", ())] == 3
    assert got[("pdserve:request_queue_time_seconds_count", ())] == 2  # one was never admitted
    assert got[("pdserve:request_prompt_tokens_sum", ())] == 7
    assert got[("pdserve:request_generation_tokens_sum", ())] == 3
    assert got[("pdserve:prefix_index_lookups_total", ())] == 3
    assert got[("pdserve:prefix_index_hits_total", ())] == 1
    assert got[("pdserve:prefix_index_matched_tokens_total", ())] == 32
    assert got[("pdserve:prefix_index_lookup_failures_total", (("reason", "timeout"),))] == 1
    assert got[("pdserve:prefix_index_lookup_seconds_count", ())] == 2
    assert got[("pdserve:num_requests_running", ())] == 0
    assert got[("pdserve:num_workers", (("role", "decode"), ("state", "healthy")))] == 1
    assert got[("pdserve:num_workers", (("role", "decode"), ("state", "unhealthy")))] == 1
    assert got[("pdserve:num_workers", (("role", "prefill"), ("state", "healthy")))] == 1

    async def admit() -> None:
        await admission.acquire()

    asyncio.run(admit())
    assert samples(m)[("pdserve:num_requests_running", ())] == 1  # read at scrape time


def test_every_ratio_decision_is_counted_by_action() -> None:
    pool = FakePool({"p:1": "prefill", "d:1": "decode"})
    m = RouterMetrics("m", Admission(1, 0), pool.views)
    config = RatioConfig(mode="advisory", slo_ttft_ms=1000, slo_tpot_ms=50, min_requests=5)
    controller = RatioController(config, pool)
    controller.on_decision = m.observe_ratio_decision

    async def decide() -> None:
        for _ in range(3):
            await controller.evaluate()

    asyncio.run(decide())
    assert samples(m)[("pdserve:ratio_decisions_total", (("action", "hold"),))] == 3


def test_grafana_dashboard_uses_only_exported_metrics() -> None:
    """Every `pdserve:*` name in deploy/grafana-dashboard.json is a sample name the router or a
    worker exports (so a renamed metric cannot leave the dashboard silently empty)."""
    import json
    import re
    from pathlib import Path

    from worker.engine_thread import Snapshot
    from worker.metrics import WorkerMetrics

    dash = json.loads((Path(__file__).parents[2] / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {n for e in exprs for n in re.findall(r"pdserve:[a-z0-9_]+", e)}
    router = RouterMetrics("m", Admission(1, 0), lambda: [])
    snap = Snapshot("prefill", False, 0, 0, 0, 10, 10, 16)
    worker = WorkerMetrics("m", lambda: snap, "bfloat16")
    worker.on_transfers([])  # nothing: labelled series appear once used
    names: set[str] = set()
    for registry in (router.registry, worker.registry):
        for family in registry.collect():
            kind = family.type
            names.add(family.name + ("_total" if kind == "counter" else ""))
            names.update(family.name + s for s in ("_bucket", "_count", "_sum"))
    assert used and used <= names, sorted(used - names)


def test_every_labelled_series_exists_before_the_first_request() -> None:
    """A fresh router's scrape already has the model's TTFT / TPOT / e2e histograms and its
    success, failure and lookup counters, at zero (dashboards' rate() works from the start)."""
    router = RouterMetrics("smol", Admission(1, 0), lambda: [])
    text = router.exposition()[0].decode()
    for name in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert f'pdserve:{name}_count{{model_name="smol"}} 0.0' in text, name
        assert f'pdserve:{name}_bucket{{le="+Inf",model_name="smol"}} 0.0' in text, name
    assert 'pdserve:request_success_total{finished_reason="stop",model_name="smol"} 0.0' in text
    assert 'pdserve:request_failure_total{model_name="smol",status="CANCELLED"} 0.0' in text
    assert 'pdserve:prefix_index_lookups_total{model_name="smol"} 0.0' in text


def test_worker_counts_kv_bytes_per_request_by_cache_dtype() -> None:
    """Each successful transfer's bytes go to the total and to the per-request histogram,
    labelled with the worker's cache dtype; failures move neither."""
    from prometheus_client import generate_latest

    from kvtransfer.types import TransferResult
    from worker.engine_thread import Snapshot
    from worker.metrics import WorkerMetrics

    snap = Snapshot("decode", False, 0, 0, 0, 10, 10, 16)
    worker = WorkerMetrics("m", lambda: snap, "int8")
    ok = [
        TransferResult(f"t{i}", 0, "r", "recv", "p0", True, nbytes=n)
        for i, n in enumerate((300_000, 500_000))
    ]
    failed = TransferResult("t9", 0, "r", "recv", "p0", False, error="deadline", nbytes=7)
    worker.on_transfers([*ok, failed])
    text = generate_latest(worker.registry).decode()
    labels = 'cache_dtype="int8",model_name="m",side="recv"'
    assert f"pdserve:kv_transfer_bytes_total{{{labels}}} 800000.0" in text, text
    assert f"pdserve:kv_transfer_request_bytes_count{{{labels}}} 2.0" in text
    assert f"pdserve:kv_transfer_request_bytes_sum{{{labels}}} 800000.0" in text
    bucket = 'pdserve:kv_transfer_request_bytes_bucket{cache_dtype="int8",le="%s",model_name="m",'
    assert bucket % "262144.0" + 'side="recv"} 0.0' in text
    assert bucket % "1.048576e+06" + 'side="recv"} 2.0' in text


def test_the_served_weights_are_an_info_metric_on_router_and_worker() -> None:
    """`model_weights_info{weights}` says what the weights are (1 always); a worker adds the
    bytes they take."""
    from worker.engine_thread import Snapshot
    from worker.metrics import WorkerMetrics

    router = RouterMetrics("smol", Admission(1, 0), lambda: [], weights="Q4_1+Q8_0")
    text = router.exposition()[0].decode()
    assert 'pdserve:model_weights_info{model_name="smol",weights="Q4_1+Q8_0"} 1.0' in text
    snap = Snapshot("decode", False, 0, 0, 0, 10, 10, 16)
    worker = WorkerMetrics(
        "smol", lambda: snap, "bfloat16", weights="Q4_1+Q8_0", weight_bytes=96_000_000
    )
    text = generate_latest(worker.registry).decode()
    assert 'pdserve:model_weights_info{model_name="smol",weights="Q4_1+Q8_0"} 1.0' in text
    assert 'pdserve:model_weight_bytes{model_name="smol"} 9.6e+07' in text
