"""`TracingConfig` (the ``[tracing]`` table) and the effective export settings it gives with
the standard OpenTelemetry environment. Torch-free and OpenTelemetry-free: importing this
module costs nothing, whether tracing is on or off.

Every process of a cluster gets the same `TracingConfig` inside the one config document its
launcher already hands over (`RouterConfig.tracing`, `WorkerConfig.tracing`); each process
then fills what the table leaves unset from its own environment (`ExportSettings.resolve`):

- on / off: `enabled` (default off); ``OTEL_SDK_DISABLED=true`` turns it off;
- collector: `endpoint`, else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else
  ``OTEL_EXPORTER_OTLP_ENDPOINT``, else ``http://localhost:4317`` (grpc) /
  ``http://localhost:4318/v1/traces`` (http/protobuf);
- protocol: `protocol`, else ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, else
  ``OTEL_EXPORTER_OTLP_PROTOCOL``, else ``grpc``;
- service name: `service_name`, else ``OTEL_SERVICE_NAME``, else ``pdserve``;
- sampler: `sampler`, else ``OTEL_TRACES_SAMPLER``, else ``parentbased_always_on``;
- sampler argument: `sampler_arg`, else ``OTEL_TRACES_SAMPLER_ARG``, else 1.0.

As in the OpenTelemetry SDK, ``OTEL_EXPORTER_OTLP_ENDPOINT`` is a base URL: with
``http/protobuf`` the exporter appends ``/v1/traces`` to it, while a ``_TRACES_`` endpoint (or
`endpoint`) is used as it is. Headers (``OTEL_EXPORTER_OTLP_HEADERS``, e.g. a collector's API
key) are read by the exporter from the environment only: a secret never rides in a config
document.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

Protocol = Literal["grpc", "http/protobuf"]
Sampler = Literal[
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
]
PROTOCOLS: tuple[Protocol, ...] = ("grpc", "http/protobuf")
SAMPLERS: tuple[Sampler, ...] = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
C = TypeVar("C", bound=str)
DEFAULT_SERVICE_NAME = "pdserve"
DEFAULT_ENDPOINTS: dict[Protocol, str] = {
    "grpc": "http://localhost:4317",
    "http/protobuf": "http://localhost:4318/v1/traces",
}


class TracingConfig(BaseModel):
    """OpenTelemetry traces of every request (``[tracing]``; `docs/observability.md`).

    Unset fields (None, "") take the standard OpenTelemetry environment variable of the process
    that reads them, then the SDK's default (module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(
        default=False,
        description="Export a trace of every sampled request (router, prefill, KV transfer, "
        "decode spans). Off: no OpenTelemetry code is imported or run.",
    )
    endpoint: str = Field(
        default="",
        description="OTLP collector URL, e.g. 'http://jaeger:4317' (grpc) or "
        "'http://jaeger:4318/v1/traces' (http/protobuf); '' = $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT "
        "or $OTEL_EXPORTER_OTLP_ENDPOINT, else the protocol's localhost default.",
    )
    protocol: Protocol | None = Field(
        default=None,
        description="OTLP transport, 'grpc' or 'http/protobuf'; None = "
        "$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or $OTEL_EXPORTER_OTLP_PROTOCOL, else 'grpc'.",
    )
    service_name: str = Field(
        default="",
        description="The `service.name` of every process's spans; '' = $OTEL_SERVICE_NAME, else "
        "'pdserve' (the router and the workers tell themselves apart by `pdserve.component` and "
        "`service.instance.id`).",
    )
    sampler: Sampler | None = Field(
        default=None,
        description="Which requests are traced, as $OTEL_TRACES_SAMPLER names it "
        "(e.g. 'parentbased_traceidratio': a client's sampled trace is always continued, other "
        "requests with probability `sampler_arg`); None = $OTEL_TRACES_SAMPLER, else "
        "'parentbased_always_on'.",
    )
    sampler_arg: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="The ratio samplers' probability (0-1); None = $OTEL_TRACES_SAMPLER_ARG, "
        "else 1.0.",
    )
    capture_content: bool = Field(
        default=False,
        description="Put the prompt and the output text on the request's span "
        "(`gen_ai.input.messages` / `gen_ai.output.messages`). Off: no prompt text or token id "
        "is ever in a span. Credentials never are.",
    )
    max_queue_size: int = Field(
        default=2048,
        ge=1,
        description="Finished spans a process keeps while the exporter is busy; beyond it new "
        "spans are dropped and counted (`pdserve:tracing_spans_dropped_total{reason="
        "'queue_full'}`), never waited for.",
    )
    schedule_delay_ms: int = Field(
        default=1000,
        ge=1,
        description="Longest wait before a batch of finished spans is exported.",
    )
    max_export_batch_size: int = Field(
        default=512, ge=1, description="Spans per export call (at most `max_queue_size`)."
    )
    export_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="Bound on one export call (retries included); a batch that fails is "
        "dropped and counted (reason 'export_failed').",
    )
    shutdown_timeout_s: float = Field(
        default=2.0,
        ge=0,
        description="On stop, how long a process waits for its last spans to be exported "
        "(an unreachable collector never holds a stop longer).",
    )


@dataclass(frozen=True)
class ExportSettings:
    """What one process exports with: the config's values, the environment's where the config
    leaves them unset, the defaults last (`resolve`)."""

    endpoint: str
    protocol: Protocol
    service_name: str
    sampler: Sampler
    sampler_arg: float
    capture_content: bool
    max_queue_size: int
    schedule_delay_ms: int
    max_export_batch_size: int
    export_timeout_s: float
    shutdown_timeout_s: float

    @classmethod
    def resolve(
        cls, config: TracingConfig, env: Mapping[str, str] | None = None
    ) -> ExportSettings | None:
        """The effective settings, or None when tracing is off (`config.enabled` false, or
        ``OTEL_SDK_DISABLED=true``). Raises ValueError naming the environment variable whose
        value is not one of the allowed ones."""
        env = os.environ if env is None else env
        if not config.enabled or env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return None
        protocol = config.protocol or _choice(
            env,
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"),
            PROTOCOLS,
            "grpc",
        )
        endpoint = config.endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
        if not endpoint and (base := env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")):
            # the base URL of every signal: http/protobuf appends the traces path (as the SDK)
            endpoint = base if protocol == "grpc" else base.rstrip("/") + "/v1/traces"
        sampler = config.sampler or _choice(
            env, ("OTEL_TRACES_SAMPLER",), SAMPLERS, "parentbased_always_on"
        )
        arg = config.sampler_arg
        if arg is None:
            arg = _ratio(env.get("OTEL_TRACES_SAMPLER_ARG", ""), sampler)
        return cls(
            endpoint=endpoint or DEFAULT_ENDPOINTS[protocol],
            protocol=protocol,
            service_name=config.service_name
            or env.get("OTEL_SERVICE_NAME", "")
            or DEFAULT_SERVICE_NAME,
            sampler=sampler,
            sampler_arg=arg,
            capture_content=config.capture_content,
            max_queue_size=config.max_queue_size,
            schedule_delay_ms=config.schedule_delay_ms,
            max_export_batch_size=min(config.max_export_batch_size, config.max_queue_size),
            export_timeout_s=config.export_timeout_s,
            shutdown_timeout_s=config.shutdown_timeout_s,
        )


def _choice(
    env: Mapping[str, str], names: tuple[str, ...], allowed: tuple[C, ...], default: C
) -> C:
    """The first of `names` set in `env`, as one of `allowed`; else `default`."""
    for name in names:
        value = env.get(name, "").strip().lower()
        if not value:
            continue
        for choice in allowed:
            if value == choice:
                return choice
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
    return default


def _ratio(text: str, sampler: str) -> float:
    if not text.strip() or not sampler.endswith("traceidratio"):
        return 1.0
    try:
        value = float(text)
    except ValueError:
        raise ValueError(
            f"OTEL_TRACES_SAMPLER_ARG must be a number in [0, 1], got {text!r}"
        ) from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"OTEL_TRACES_SAMPLER_ARG must be a number in [0, 1], got {text!r}")
    return value
