"""A worker's Prometheus metrics and the small HTTP server that exports them. Runs in every
worker process: counters are fed on the engine thread, the server runs on its own daemon
thread (prometheus_client's WSGI server), and the port is reported by `GetStatus`
(`WorkerStatus.metrics_port`); the router does not proxy it.

Names follow vLLM's with a ``pdserve:`` prefix and its ``model_name`` label:

- gauges read from the engine thread's latest `Snapshot` at scrape time:
  `num_requests_running`, `num_requests_waiting`, `kv_cache_usage_perc` (used blocks / all,
  0-1; evictable prefix-cache blocks count as free) and `worker_role{role}` (1 for the role
  the worker has now, 0 for the others);
- counters fed by `on_outputs` after each engine step: `prompt_tokens_total` and
  `prefix_cache_queries_total` (prompt tokens of requests prefilled here, counted at their first
  token), `prefix_cache_hits_total` (of those, tokens served from the local prefix cache),
  `generation_tokens_total` (tokens sampled here: a prefill worker samples each request's first
  token, its decode worker the rest);
- what the served weights are: `model_weights_info{weights}` (always 1; `weights` is e.g.
  "Q4_1+Q8_0" for a folder kept quantized, else the dtype) and `model_weight_bytes` (bytes
  the weights take in memory, every packed copy counted);
- KV transfers, fed by `on_transfers` with every `TransferResult` (`side` = send | recv):
  `kv_transfer_bytes_total{cache_dtype}` and histogram `kv_transfer_request_bytes{cache_dtype}`
  (the KV bytes of each request's transfer: its blocks as the cache stores them, so an int8
  cache's are about half a bfloat16 one's; `cache_dtype` is this worker's `KVLayout.cache_dtype`,
  which both sides of a transfer share), histogram `kv_transfer_seconds` (successful ones) and
  `kv_transfer_failures_total{reason}` (reason: cancelled, timeout, closed, layout, error);
- with speculative decoding on (`[engine.speculative]`), the engine's counters read at scrape
  time, under vLLM's names: `spec_decode_num_drafts_total` (verified steps of a request that
  had proposals), `spec_decode_num_draft_tokens_total` (proposed),
  `spec_decode_num_accepted_tokens_total` (accepted),
  `spec_decode_num_accepted_tokens_per_pos_total{position}`, and the two ratios
  vLLM logs from them, as gauges since start: `spec_decode_acceptance_rate` (accepted /
  proposed) and `spec_decode_mean_acceptance_length` (1 + accepted / drafts: tokens per
  verified step);
- with tracing on, the span counters `tracing_spans_exported_total` and
  `tracing_spans_dropped_total{reason}` (`tracing.metrics`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtransfer.types import TransferResult
from model_runtime.request import RequestOutput
from model_runtime.speculative.speculator import SpecStats
from proto.pdserve.v1.roles import ROLE_NAMES
from tracing.metrics import SpanCounters
from worker.engine_thread import Snapshot

P = "pdserve:"
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
REQUEST_BYTES_BUCKETS = tuple(float(4**i) for i in range(8, 16))  # 64 KiB .. 1 GiB

_REASONS = (
    ("cancelled", re.compile(r"cancel", re.I)),
    ("timeout", re.compile(r"deadline|timed? ?out|expired", re.I)),
    ("closed", re.compile(r"clos|shut ?down|stopp", re.I)),
    ("layout", re.compile(r"layout|mismatch", re.I)),
)


def failure_reason(error: str | None) -> str:
    """A transfer error's text -> one of a few label values (bounded cardinality)."""
    for reason, pattern in _REASONS:
        if error and pattern.search(error):
            return reason
    return "error"


class _SnapshotGauges(Collector):
    def __init__(self, model: str, snapshot: Callable[[], Snapshot]) -> None:
        self._model = model
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        s = self._snapshot()
        m = [self._model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(P + name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        used = 1.0 - s.free_blocks / s.total_blocks if s.total_blocks else 0.0
        role = GaugeMetricFamily(
            P + "worker_role", "1 for the worker's current role.", labels=["model_name", "role"]
        )
        for r in ROLE_NAMES:
            role.add_metric([*m, r], 1.0 if s.role == r else 0.0)
        return [
            gauge("num_requests_running", "Requests running in the engine.", s.num_running),
            gauge("num_requests_waiting", "Requests waiting for the engine.", s.num_waiting),
            gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", used),
            role,
        ]


class _SpecCounters(Collector):
    """The engine's speculative-decoding counters (`SpecStats`), read at scrape time."""

    def __init__(self, model: str, stats: Callable[[], SpecStats]) -> None:
        self._model = model
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        m = [self._model]
        out: list[Metric] = []
        for name, doc, value in (
            ("num_drafts", "Verified steps of a request that had proposals.", s.num_drafts),
            ("num_draft_tokens", "Tokens proposed and verified.", s.num_draft_tokens),
            ("num_accepted_tokens", "Proposed tokens accepted.", s.num_accepted_tokens),
        ):
            c = CounterMetricFamily(P + "spec_decode_" + name, doc, labels=["model_name"])
            c.add_metric(m, value)
            out.append(c)
        per_pos = CounterMetricFamily(
            P + "spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose proposal at this position (0-based) was accepted.",
            labels=["model_name", "position"],
        )
        for i, n in enumerate(list(s.accepted_per_pos)):
            per_pos.add_metric([*m, str(i)], n)
        out.append(per_pos)
        ratios: tuple[tuple[str, str, float], ...] = (
            ("acceptance_rate", "Accepted / proposed tokens since start.", s.acceptance_rate),
            (
                "mean_acceptance_length",
                "Tokens per verified step with proposals since start (1 + accepted / drafts).",
                s.mean_acceptance_length,
            ),
        )
        for name, doc, ratio in ratios:
            g = GaugeMetricFamily(P + "spec_decode_" + name, doc, labels=["model_name"])
            g.add_metric(m, ratio)
            out.append(g)
        return out


class WorkerMetrics:
    """One worker's metrics (module docstring). `on_*` run on the engine thread."""

    def __init__(
        self,
        model: str,
        snapshot: Callable[[], Snapshot],
        cache_dtype: str,
        span_counts: Callable[[], Mapping[str, int]] | None = None,
        spec_stats: Callable[[], SpecStats] | None = None,
        weights: str = "",
        weight_bytes: int = 0,
    ) -> None:
        """`cache_dtype`: the worker's `KVLayout.cache_dtype` (the transfer metrics' label).
        `span_counts`: the tracer's span counts (None: tracing off, no span counters:
        `tracing.metrics.SpanCounters`). `spec_stats`: the engine's speculative-decoding
        counters (None: speculation off, no such metrics). `weights`, `weight_bytes`: what the
        weights are and take (`ModelRunner.weights_label`, `weight_bytes`)."""
        self.registry = CollectorRegistry()
        self._model = model
        self._cache_dtype = cache_dtype
        r, lm = self.registry, ["model_name"]
        Gauge(
            P + "model_weights_info",
            "What the served weights are (quantized types, or the dtype); always 1.",
            [*lm, "weights"],
            registry=r,
        ).labels(model, weights).set(1)
        Gauge(
            P + "model_weight_bytes", "Bytes the model's weights take in memory.", lm, registry=r
        ).labels(model).set(weight_bytes)
        self.prompt_tokens = Counter(
            P + "prompt_tokens", "Prompt tokens prefilled here.", lm, registry=r
        ).labels(model)
        self.generation_tokens = Counter(
            P + "generation_tokens", "Tokens sampled here.", lm, registry=r
        ).labels(model)
        self.cache_queries = Counter(
            P + "prefix_cache_queries",
            "Prompt tokens looked up in the local prefix cache.",
            lm,
            registry=r,
        ).labels(model)
        self.cache_hits = Counter(
            P + "prefix_cache_hits",
            "Prompt tokens found in the local prefix cache.",
            lm,
            registry=r,
        ).labels(model)
        self.transfer_bytes = Counter(
            P + "kv_transfer_bytes",
            "KV bytes moved by successful transfers, by the cache dtype they are stored in.",
            [*lm, "side", "cache_dtype"],
            registry=r,
        )
        self.transfer_request_bytes = Histogram(
            P + "kv_transfer_request_bytes",
            "KV bytes of one request's successful transfer, by cache dtype.",
            [*lm, "side", "cache_dtype"],
            registry=r,
            buckets=REQUEST_BYTES_BUCKETS,
        )
        self.transfer_seconds = Histogram(
            P + "kv_transfer_seconds",
            "Duration of successful KV transfers.",
            [*lm, "side"],
            registry=r,
            buckets=TRANSFER_BUCKETS,
        )
        self.transfer_failures = Counter(
            P + "kv_transfer_failures",
            "Failed KV transfers, by reason.",
            [*lm, "side", "reason"],
            registry=r,
        )
        r.register(_SnapshotGauges(model, snapshot))
        if span_counts is not None:
            r.register(SpanCounters(model, span_counts))
        if spec_stats is not None:
            r.register(_SpecCounters(model, spec_stats))
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def on_outputs(self, outputs: Sequence[RequestOutput]) -> None:
        """Count one engine step's outputs."""
        for out in outputs:
            new = len(out.new_token_ids)
            self.generation_tokens.inc(new)
            if new == len(out.output_token_ids):  # this step sampled its first token here
                n = len(out.prompt_token_ids)
                self.prompt_tokens.inc(n)
                self.cache_queries.inc(n)
                self.cache_hits.inc(out.num_cached_tokens)

    def on_transfers(self, results: Sequence[TransferResult]) -> None:
        """Count KV transfer results (both sides)."""
        for r in results:
            if r.ok:
                self.transfer_bytes.labels(self._model, r.role, self._cache_dtype).inc(r.nbytes)
                by_request = self.transfer_request_bytes.labels(
                    self._model, r.role, self._cache_dtype
                )
                by_request.observe(r.nbytes)
                self.transfer_seconds.labels(self._model, r.role).observe(r.elapsed_s)
            else:
                reason = failure_reason(r.error)
                self.transfer_failures.labels(self._model, r.role, reason).inc()

    def serve(self, host: str, port: int) -> int:
        """Start the exporter on `host:port` (0: a free one); return the bound port."""
        self._server, self._thread = start_http_server(port, host, self.registry)
        return int(self._server.server_port)

    def stop(self) -> None:
        """Stop the exporter (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
