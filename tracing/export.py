"""Bounded, counted span export: what keeps a slow or dead collector from ever costing a
request anything. Runs in every process with tracing on; imports the OpenTelemetry SDK.

A finished span is handed to the SDK's `BatchSpanProcessor`, whose own thread exports batches
(`schedule_delay_ms`, `max_export_batch_size`) — the request's thread (the router's event loop,
a worker's gRPC loop) only appends to a queue. `BoundedSpanProcessor` in front of it keeps at
most `max_queue_size` spans waiting: one more is dropped at once and counted, never waited for.
`CountingExporter` behind it counts what the collector took and what failed (an unreachable or
hanging collector fails each export within `export_timeout_s`; its batch is dropped).

Counting is exact: the processor counts a span as waiting when it passes it on, and the exporter
stops counting it when the SDK hands it over in a batch, so "waiting" never undercounts the
SDK's own queue (which therefore never overflows and never drops silently).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

log = logging.getLogger(__name__)


class SpanStats:
    """Counters of one process's spans (thread-safe): `exported` (the collector took them),
    `queue_full` (dropped before export: the queue was full), `export_failed` (dropped: their
    export failed or timed out), and `waiting` (queued now)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.exported = 0
        self.queue_full = 0
        self.export_failed = 0
        self.waiting = 0

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {
                "exported": self.exported,
                "queue_full": self.queue_full,
                "export_failed": self.export_failed,
            }

    def admit(self, limit: int) -> bool:
        """One more span may wait (else it is counted as dropped)."""
        with self._lock:
            if self.waiting >= limit:
                self.queue_full += 1
                return False
            self.waiting += 1
            return True

    def taken(self, n: int) -> None:
        """`n` spans left the queue for an export call."""
        with self._lock:
            self.waiting -= n

    def done(self, n: int, ok: bool) -> int:
        """`n` spans were exported (`ok`) or dropped; returns the drops so far."""
        with self._lock:
            if ok:
                self.exported += n
            else:
                self.export_failed += n
            return self.export_failed


class CountingExporter(SpanExporter):
    """`inner`, counting each batch in `stats`. An export that raises counts as failed (the
    SDK's thread would only log it). Failures are logged at WARNING once, then once per
    1000 spans dropped, so a collector that stays down does not flood the log."""

    def __init__(self, inner: SpanExporter, stats: SpanStats) -> None:
        self._inner = inner
        self._stats = stats
        self._warned_at = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        n = len(spans)
        self._stats.taken(n)
        try:
            result = self._inner.export(spans)
        except Exception as exc:  # an exporter bug must not kill the export thread
            log.warning("span export raised %r", exc)
            result = SpanExportResult.FAILURE
        ok = result is SpanExportResult.SUCCESS
        failed = self._stats.done(n, ok)
        if not ok and (self._warned_at == 0 or failed - self._warned_at >= 1000):
            self._warned_at = failed
            log.warning(
                "trace export failed: %d spans dropped so far (serving is not affected)", failed
            )
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class BoundedSpanProcessor(SpanProcessor):
    """A `BatchSpanProcessor` over a `CountingExporter`, with at most `max_queue_size` spans
    waiting (module docstring). Unsampled spans are ignored, as the SDK's processor does."""

    def __init__(
        self,
        exporter: SpanExporter,
        stats: SpanStats,
        max_queue_size: int,
        schedule_delay_ms: int,
        max_export_batch_size: int,
    ) -> None:
        self._stats = stats
        self._limit = max_queue_size
        self._batch = BatchSpanProcessor(
            CountingExporter(exporter, stats),
            # the SDK's queue holds at most what `admit` lets through: it never drops itself
            max_queue_size=max_queue_size + max_export_batch_size,
            schedule_delay_millis=schedule_delay_ms,
            max_export_batch_size=max_export_batch_size,
        )

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is None or not span.context.trace_flags.sampled:
            return
        if self._stats.admit(self._limit):
            self._batch.on_end(span)

    def shutdown(self) -> None:
        self._batch.shutdown()  # type: ignore[no-untyped-call]

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._batch.force_flush(timeout_millis)
