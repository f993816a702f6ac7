"""The span counters on a process's Prometheus ``/metrics`` (the router's and each worker's),
read at scrape time from its tracer (`Tracer.counts`): ``pdserve:tracing_spans_exported_total``
(the collector took them) and ``pdserve:tracing_spans_dropped_total{reason}`` (``queue_full``:
the export queue was full, the exporter being slow or down; ``export_failed``: an export call
failed or timed out). Registered only while tracing is on. Torch-free; no OpenTelemetry import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

DROP_REASONS = ("queue_full", "export_failed")


class SpanCounters(Collector):
    """Counters of `counts()` (a `tracing.Tracer.counts`), labelled by `model_name`."""

    def __init__(self, model: str, counts: Callable[[], Mapping[str, int]]) -> None:
        self._model = model
        self._counts = counts

    def collect(self) -> Iterable[Metric]:
        counts = self._counts()
        exported = CounterMetricFamily(
            "pdserve:tracing_spans_exported",
            "Spans the trace collector accepted.",
            labels=["model_name"],
        )
        exported.add_metric([self._model], counts.get("exported", 0))
        dropped = CounterMetricFamily(
            "pdserve:tracing_spans_dropped",
            "Spans dropped instead of waited for: the export queue was full (queue_full) or "
            "their export failed or timed out (export_failed).",
            labels=["model_name", "reason"],
        )
        for reason in DROP_REASONS:
            dropped.add_metric([self._model, reason], counts.get(reason, 0))
        return [exported, dropped]
