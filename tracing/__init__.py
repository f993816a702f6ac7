"""OpenTelemetry traces of pdserve's requests: one trace per request, across the router, the
prefill worker, the KV transfer and the decode worker (`docs/observability.md`).

Torch-free; shared by the router and the worker host (which may not import each other).
`config` (`TracingConfig`, the ``[tracing]`` table, and `ExportSettings`, its effective values
with the standard ``OTEL_*`` environment), `spans` (the `Span` / `Tracer` seam and the no-op
pair used while tracing is off), and — imported only when tracing is on — `sdk` (the
OpenTelemetry SDK behind the seam) and `export` (bounded, counted export). `receiver` is an
in-process OTLP trace receiver (tests, benchmarks, a quick look without a backend).
"""

from __future__ import annotations

from collections.abc import Mapping

from tracing.config import ExportSettings, TracingConfig
from tracing.spans import NO_SPAN, NO_TRACER, Span, Tracer

__all__ = ["NO_SPAN", "NO_TRACER", "Span", "Tracer", "TracingConfig", "make_tracer"]


def make_tracer(
    config: TracingConfig,
    component: str,
    instance: str,
    env: Mapping[str, str] | None = None,
) -> Tracer:
    """This process's tracer: `NO_TRACER` when tracing is off (nothing of OpenTelemetry is
    imported), else an SDK tracer exporting as `config` and the environment say
    (`ExportSettings.resolve`). `component`: 'router' or 'worker'; `instance`: the process's
    id (router address, worker id). Raises ValueError for an unusable ``OTEL_*`` value."""
    settings = ExportSettings.resolve(config, env)
    if settings is None:
        return NO_TRACER
    from tracing.sdk import OtelTracer  # only with tracing on: the SDK stays unimported else

    return OtelTracer(settings, component, instance)
