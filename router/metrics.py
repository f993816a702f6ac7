"""The router's Prometheus metrics. Runs in the router process; served at the HTTP front's
`/metrics`: the text exposition format, or OpenMetrics when the scrape asks for it
(``Accept: application/openmetrics-text``; `exposition`).

Names follow vLLM's with a ``pdserve:`` prefix (and its ``model_name`` label), so a vLLM
dashboard needs only the prefix changed. Each router has its own `CollectorRegistry` (several
routers can share a test process). What is counted where:

- request histograms `time_to_first_token_seconds`, `time_per_output_token_seconds`,
  `inter_token_latency_seconds`, `e2e_request_latency_seconds`, `request_queue_time_seconds`,
  and for requests that end OK `request_prompt_tokens`, `request_generation_tokens`; counters
  `request_success_total{finished_reason}` and `request_failure_total{status}` (the gRPC status
  name; a client that went away is `CANCELLED`): `record(RequestRecord)`, once per request,
  from the request lifecycle (gRPC and HTTP alike; a body the HTTP front refuses before that —
  not JSON, an unsupported field, an unknown model — is not a request here);
- gauges `num_requests_running`, `num_requests_waiting` (the admission queue) and
  `num_workers{role,state}` (state: healthy, draining, unhealthy; the worker pool's views),
  read at scrape time;
- `prefix_index_lookups_total`, `prefix_index_hits_total`, `prefix_index_matched_tokens_total`,
  `prefix_index_lookup_failures_total{reason}`, histogram `prefix_index_lookup_seconds`:
  `observe_prefix_lookup`, from the guarded prefix index on the request path;
- `ratio_decisions_total{action}`: `observe_ratio_decision`, every ratio-controller decision
  (`hold` included).
- gauge `hybrid_local_prefill_max_tokens`: the live hybrid threshold (`router.hybrid.
  LiveThreshold`, which the ratio controller may move), read at scrape time; only with hybrid on;
- `prefill_path_total{path,reason}`: `record`, once per request that reached a worker in
  mode 'disagg': where its prompt was prefilled (``remote``: a prefill worker; ``local``: its
  decode worker, `[router.hybrid]`) and why (`router.hybrid.choose_prefill_path`'s reason);
- `model_weights_info{weights}`, always 1: what the served weights are (e.g. ``Q4_1+Q8_0``
  for a folder kept quantized, else the checkpoint's dtype), read from the model's config.json.

Every labelled series of the served model exists from start-up, at zero (vLLM does the same),
so `rate()` and quantile queries work from the first scrape.

TTFT, TPOT and inter-token gaps are the router's view: arrival to the first token handed to
the edge, and between messages carrying tokens.

Exemplars: with tracing on (`[tracing]`), a traced request's TTFT, TPOT and end-to-end
observations carry its trace id (``{trace_id="<32 hex>"}``), so a dashboard jumps from a slow
bucket to that request's trace; they are in the OpenMetrics exposition only (the text format
has no exemplars). The tracer's span counters (`tracing.metrics.SpanCounters`:
`tracing_spans_exported_total`, `tracing_spans_dropped_total{reason}`) are here too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics import exposition as om_exposition
from prometheus_client.registry import Collector

from router.admission import Admission
from router.hybrid import REASONS
from router.lifecycle import RequestRecord
from router.policy import WorkerView
from tracing.metrics import SpanCounters

TTFT_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5)
TTFT_BUCKETS += (0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_GAP_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03)
TOKEN_GAP_BUCKETS += (0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
REQUEST_BUCKETS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS += (15.0, 20.0, 30.0, 60.0, 120.0, 240.0)
TOKEN_COUNT_BUCKETS: tuple[float, ...] = (
    1,
    2,
    5,
    10,
    20,
    50,
    100,
    200,
    500,
    1000,
    2000,
    5000,
    10000,
    20000,
    50000,
)
LOOKUP_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
)

P = "pdserve:"
# Label values created at start-up (`RouterMetrics._init_series`); others still appear when used.
FINISH_REASONS = ("stop", "length")
FAILURE_STATUSES = (
    "CANCELLED",
    "DEADLINE_EXCEEDED",
    "INVALID_ARGUMENT",
    "RESOURCE_EXHAUSTED",
    "UNAVAILABLE",
    "INTERNAL",
)
LOOKUP_FAILURE_REASONS = ("skipped", "timeout", "error")
RATIO_ACTIONS = ("hold", "switch", "add", "remove", "threshold")


class _LiveState(Collector):
    """Gauges read at scrape time: admission queue, worker counts, the hybrid threshold."""

    def __init__(
        self,
        model: str,
        admission: Admission,
        views: Callable[[], Iterable[WorkerView]],
        threshold: Callable[[], int] | None = None,
    ) -> None:
        self._model = model
        self._admission = admission
        self._views = views
        self._threshold = threshold

    def collect(self) -> Iterable[Metric]:
        m = [self._model]
        running = GaugeMetricFamily(
            P + "num_requests_running", "Requests running worker calls.", labels=["model_name"]
        )
        running.add_metric(m, self._admission.running)
        waiting = GaugeMetricFamily(
            P + "num_requests_waiting",
            "Requests waiting in the router's admission queue.",
            labels=["model_name"],
        )
        waiting.add_metric(m, self._admission.queued)
        workers = GaugeMetricFamily(
            P + "num_workers",
            "Workers known to the router, by role and state.",
            labels=["model_name", "role", "state"],
        )
        counts: dict[tuple[str, str], int] = {}
        for role in ("prefill", "decode", "colocated"):
            for state in ("healthy", "draining", "unhealthy"):
                counts[(role, state)] = 0
        for v in self._views():
            state = "unhealthy" if not v.healthy else "draining" if v.draining else "healthy"
            counts[(v.role, state)] = counts.get((v.role, state), 0) + 1
        for (role, state), n in counts.items():
            workers.add_metric([*m, role, state], n)
        if self._threshold is None:
            return [running, waiting, workers]
        threshold = GaugeMetricFamily(
            P + "hybrid_local_prefill_max_tokens",
            "The live hybrid threshold: prompts with at most this many uncached tokens prefill "
            "on their decode worker (the ratio controller may move it).",
            labels=["model_name"],
        )
        threshold.add_metric(m, self._threshold())
        return [running, waiting, workers, threshold]


class RouterMetrics:
    """One router's metrics (module docstring). `record`, `observe_*` are cheap and never
    block; `exposition()` renders the registry."""

    def __init__(
        self,
        model: str,
        admission: Admission,
        views: Callable[[], Iterable[WorkerView]],
        threshold: Callable[[], int] | None = None,
        span_counts: Callable[[], Mapping[str, int]] | None = None,
        weights: str = "",
    ) -> None:
        """`threshold`: reads the live hybrid threshold (None: hybrid off, no gauge);
        `span_counts`: the tracer's span counts (None: tracing off, no span counters);
        `weights`: what the served weights are (`ModelConfig.weights_label`), exported as
        `model_weights_info{weights}` (always 1)."""
        self.registry = CollectorRegistry()
        self._model = model
        r, lm = self.registry, ["model_name"]
        Gauge(
            P + "model_weights_info",
            "What the served weights are (quantized types, or the dtype); always 1.",
            [*lm, "weights"],
            registry=r,
        ).labels(model, weights).set(1)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(P + name, doc, lm, registry=r, buckets=buckets)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tpot = hist(
            "time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            TOKEN_GAP_BUCKETS,
        )
        self.itl = hist(
            "inter_token_latency_seconds", "Time between token messages.", TOKEN_GAP_BUCKETS
        )
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end latency.", REQUEST_BUCKETS)
        self.queue = hist(
            "request_queue_time_seconds", "Time in the router's admission queue.", REQUEST_BUCKETS
        )
        self.prompt_tokens = hist(
            "request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_COUNT_BUCKETS
        )
        self.generation_tokens = hist(
            "request_generation_tokens",
            "Tokens generated per finished request.",
            TOKEN_COUNT_BUCKETS,
        )
        self.success = Counter(
            P + "request_success",
            "Requests that ended OK, by finish reason.",
            [*lm, "finished_reason"],
            registry=r,
        )
        self.failure = Counter(
            P + "request_failure",
            "Requests that ended with an error, by gRPC status.",
            [*lm, "status"],
            registry=r,
        )
        self.lookups = Counter(P + "prefix_index_lookups", "Prefix-index lookups.", lm, registry=r)
        self.lookup_hits = Counter(
            P + "prefix_index_hits", "Lookups that matched at least one block.", lm, registry=r
        )
        self.matched_tokens = Counter(
            P + "prefix_index_matched_tokens",
            "Prompt tokens the best match covered.",
            lm,
            registry=r,
        )
        self.lookup_failures = Counter(
            P + "prefix_index_lookup_failures",
            "Lookups without an answer (breaker open, timeout, error).",
            [*lm, "reason"],
            registry=r,
        )
        self.lookup_seconds = hist(
            "prefix_index_lookup_seconds", "Latency of answered lookups.", LOOKUP_BUCKETS
        )
        self.ratio_decisions = Counter(
            P + "ratio_decisions",
            "Ratio-controller decisions, by action.",
            [*lm, "action"],
            registry=r,
        )
        self.prefill_path = Counter(
            P + "prefill_path",
            "Disaggregated requests by where their prompt was prefilled (remote: a prefill "
            "worker; local: the decode worker) and why.",
            [*lm, "path", "reason"],
            registry=r,
        )
        r.register(_LiveState(model, admission, views, threshold))
        if span_counts is not None:
            r.register(SpanCounters(model, span_counts))
        self._init_series()

    def _init_series(self) -> None:
        """Create every labelled series for the served model now, at zero, as vLLM does: a
        dashboard's `rate()` and `histogram_quantile()` see the series from the first scrape
        instead of "no data" until the first request ends."""
        model = self._model
        for h in (self.ttft, self.tpot, self.itl, self.e2e, self.queue, self.lookup_seconds):
            h.labels(model)
        for h in (self.prompt_tokens, self.generation_tokens):
            h.labels(model)
        for c in (self.lookups, self.lookup_hits, self.matched_tokens):
            c.labels(model)
        for reason in FINISH_REASONS:
            self.success.labels(model, reason)
        for status in FAILURE_STATUSES:
            self.failure.labels(model, status)
        for why in LOOKUP_FAILURE_REASONS:
            self.lookup_failures.labels(model, why)
        for action in RATIO_ACTIONS:
            self.ratio_decisions.labels(model, action)
        for path, reasons in REASONS.items():
            for reason in reasons:
                self.prefill_path.labels(model, path, reason)

    def record(self, rec: RequestRecord) -> None:
        """One finished request (the lifecycle's `RequestRecorder`)."""
        model = self._model
        if rec.status == "OK":
            self.success.labels(model, rec.finish_reason or "unknown").inc()
            self.prompt_tokens.labels(model).observe(rec.prompt_tokens)
            self.generation_tokens.labels(model).observe(rec.completion_tokens)
        else:
            self.failure.labels(model, rec.status).inc()
        exemplar = {"trace_id": rec.trace_id} if rec.trace_id else None
        self.e2e.labels(model).observe(rec.e2e_s, exemplar)
        if rec.queue_s is not None:
            self.queue.labels(model).observe(rec.queue_s)
        if rec.ttft_s is not None:
            self.ttft.labels(model).observe(rec.ttft_s, exemplar)
        if rec.tpot_s is not None:
            self.tpot.labels(model).observe(rec.tpot_s, exemplar)
        if rec.prefill_path:
            self.prefill_path.labels(model, rec.prefill_path, rec.prefill_path_reason).inc()
        itl = self.itl.labels(model)
        for gap in rec.inter_token_s:
            itl.observe(gap)

    def observe_prefix_lookup(
        self, outcome: str, latency_s: float | None, matched_tokens: int
    ) -> None:
        """One lookup on the request path: outcome 'hit' / 'miss', or why it has no answer
        ('skipped' breaker open, 'timeout', 'error'); latency of answered ones."""
        model = self._model
        self.lookups.labels(model).inc()
        if outcome == "hit":
            self.lookup_hits.labels(model).inc()
            self.matched_tokens.labels(model).inc(matched_tokens)
        elif outcome != "miss":
            self.lookup_failures.labels(model, outcome).inc()
        if latency_s is not None:
            self.lookup_seconds.labels(model).observe(latency_s)

    def observe_ratio_decision(self, action: str) -> None:
        self.ratio_decisions.labels(self._model, action).inc()

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """(body, content type) of a scrape whose Accept header is `accept`: OpenMetrics
        (exemplars included) when it asks for ``application/openmetrics-text``, else the text
        format."""
        if not wants_openmetrics(accept):
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        # Names as they are (colons are valid OpenMetrics 1.0 names): prometheus_client's
        # default escaping for this format would turn the samples' ':' into '_' and leave
        # them out of their own families.
        body = om_exposition.generate_latest(  # type: ignore[no-untyped-call]
            self.registry, escaping=om_exposition.ALLOWUTF8
        )
        return body, om_exposition.CONTENT_TYPE_LATEST


def wants_openmetrics(accept: str) -> bool:
    """The scrape's Accept header lists ``application/openmetrics-text``."""
    return any(
        part.split(";")[0].strip() == "application/openmetrics-text" for part in accept.split(",")
    )
