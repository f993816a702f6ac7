"""Router configuration (`RouterSettings`, `RouterConfig`). Runs in the router and the CLI.

Frozen pydantic v2 model; every field described and defaulted where a default makes sense.
Values discovered at start-up (vocab size, context length) live in `app.ModelLimits`, never here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.hybrid import HybridConfig
from router.pair_scoring import PairScoringConfig
from router.policies import POLICIES
from router.prefix_index.config import MemoryIndexConfig, PrefixIndexConfig, RedisIndexConfig
from router.prefix_policy import PrefixRoutingConfig
from router.ratio.config import RatioConfig
from security.config import SecurityConfig
from tracing.config import TracingConfig

Mode = Literal["disagg", "colocated"]


def _check_address(addr: str) -> str:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"worker address must be 'host:port' with port 1..65535, got {addr!r}")
    return addr


class RouterSettings(BaseModel):
    """The router's own settings: what a cluster's ``[router]`` table holds
    (`deploy.config.RouterSection` derives from this model and changes only the port's
    default) and what `python -m router`'s flags set.
    A field (or nested section, e.g. ``[router.hybrid]``) added here is a ``[router]`` key of
    the cluster config and reaches the router process with no other code: the launchers hand
    the whole validated `RouterConfig` over as one JSON document."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_name: str | None = Field(
        default=None, description="Name reported by GetModelInfo; defaults to the folder's name."
    )
    policy: str = Field(
        default="prefix_aware", description=f"Routing policy, one of {sorted(POLICIES)}."
    )
    prefix_index: PrefixIndexConfig = Field(
        default_factory=MemoryIndexConfig,
        description="Where the prefix index lives: kind 'memory' (this router only) or "
        "'redis' (shared by router replicas). Fed by every prefill/colocated worker's KV events.",
    )
    prefix_routing: PrefixRoutingConfig = Field(
        default_factory=PrefixRoutingConfig,
        description="Weights of the 'prefix_aware' policy.",
    )
    pair_scoring: PairScoringConfig = Field(
        default_factory=PairScoringConfig,
        description="How 'least_load' and 'prefix_aware' price the KV move of a prefill/decode "
        "pair on different nodes (`router.pair_scoring`).",
    )
    hybrid: HybridConfig = Field(
        default_factory=HybridConfig,
        description="Conditional disaggregation (`router.hybrid`): which requests a decode "
        "worker prefills itself instead of a prefill worker; default off. Needs mode 'disagg'.",
    )
    host: str = Field(default="127.0.0.1", description="Interface the public gRPC server binds.")
    port: int = Field(default=0, ge=0, le=65535, description="Public port; 0 picks a free one.")
    http_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Port of the OpenAI-compatible HTTP front (and /metrics) on `host`; "
        "0 picks a free one; None serves no HTTP.",
    )
    http_header_timeout_s: float = Field(
        default=15.0,
        gt=0,
        description="HTTP front: a connection that has not sent a complete request head this "
        "long after connecting or after its previous response is closed (slow-header clients; "
        "also the idle keep-alive time).",
    )
    http_body_timeout_s: float = Field(
        default=60.0, gt=0, description="HTTP front: a request body must arrive within this (408)."
    )
    http_default_max_tokens: int | None = Field(
        default=None,
        ge=1,
        description="HTTP front: max_tokens of a chat request that sets neither max_tokens nor "
        "max_completion_tokens (vLLM's generation-config max_new_tokens); None: the rest of "
        "the context, as OpenAI.",
    )
    max_inflight: int = Field(
        default=64, ge=1, description="Requests running worker calls at once."
    )
    max_queued: int = Field(
        default=256,
        ge=0,
        description="Requests waiting for a running slot; beyond it RESOURCE_EXHAUSTED.",
    )
    default_timeout_s: float = Field(
        default=120.0, gt=0, description="Request deadline when the client sets none."
    )
    status_poll_interval_s: float = Field(
        default=0.5, gt=0, description="Period of the Worker.GetStatus poll."
    )
    status_poll_timeout_s: float = Field(
        default=0.5,
        gt=0,
        description="Timeout of one GetStatus call; a timeout is a miss (the worker is slow), "
        "not a failure.",
    )
    status_poll_misses: int = Field(
        default=3,
        ge=1,
        description="Consecutive GetStatus timeouts that mark a worker unhealthy; a refused "
        "connection or any other error marks it unhealthy at once.",
    )
    abort_timeout_s: float = Field(default=2.0, gt=0, description="Timeout of cleanup Abort calls.")
    shutdown_grace_s: float = Field(
        default=30.0,
        ge=0,
        description="On stop (SIGTERM): how long running streams may finish after the router "
        "stops accepting calls; the rest are then cancelled and aborted on every worker.",
    )
    max_route_attempts: int = Field(
        default=2,
        ge=1,
        description="Tries (different workers) while nothing was sent to the client.",
    )
    max_migrations: int = Field(
        default=1,
        ge=0,
        description="Times a request whose decode (or colocated) worker fails mid-stream moves "
        "to another one (prompt + tokens so far prefilled again there); 0 = never.",
    )
    stall_timeout_s: float = Field(
        default=3.0,
        gt=0,
        description="A worker a request waits on (Reserve, Prefill and its KV push, Decode, "
        "Generate: at any phase) that neither the call nor a status call heard from for this "
        "long is asked for its status (answered within `status_poll_timeout_s`, so the "
        "verdict comes by this time): a worker that does not answer is frozen (stopped, "
        "hung), is marked unhealthy, and the request moves to another worker as from a dead "
        "one (a retry before its first token; `max_migrations` after); one that answers "
        "(busy, queueing) keeps the call.",
    )

    @field_validator("policy")
    @classmethod
    def _policy(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {value!r}")
        return value


class RouterConfig(RouterSettings):
    """Everything the router needs to start: its settings plus what the deployment decides
    (model folder, mode, worker addresses, ratio controller, security). Invalid combinations
    fail here, naming the field. `deploy.config.ClusterConfig.router_config` builds it; a
    launched router process reads it whole from its ``--config`` document."""

    model_dir: Path = Field(description="HF model folder (config.json + tokenizer.json).")
    mode: Mode = Field(
        default="disagg", description="'disagg' (prefill + decode workers) or 'colocated'."
    )
    ratio: RatioConfig = Field(
        default_factory=RatioConfig,
        description="Prefill:decode ratio controller (`router.ratio`); default mode 'fixed' "
        "(off). 'adaptive' / 'advisory' need mode 'disagg' and start with the configured "
        "prefill/decode counts inside its bounds.",
    )
    prefill_addrs: tuple[str, ...] = Field(
        default=(), description="Prefill workers' host:port (disagg)."
    )
    decode_addrs: tuple[str, ...] = Field(
        default=(), description="Decode workers' host:port (disagg)."
    )
    colocated_addrs: tuple[str, ...] = Field(
        default=(), description="Colocated workers' host:port (colocated mode)."
    )
    security: SecurityConfig = Field(
        default_factory=SecurityConfig,
        description="TLS, mutual TLS and bearer tokens on the public API; the worker plane's "
        "mutual TLS and cluster secret file (`security.config`). A non-loopback `host` needs "
        "TLS and a token file unless security.insecure.",
    )
    tracing: TracingConfig = Field(
        default_factory=TracingConfig,
        description="OpenTelemetry traces of every request (the cluster's [tracing]; unset keys "
        "from the router process's OTEL_* environment); default off.",
    )

    @field_validator("prefill_addrs", "decode_addrs", "colocated_addrs")
    @classmethod
    def _addresses(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for addr in value:
            _check_address(addr)
        if len(set(value)) != len(value):
            raise ValueError(f"duplicate worker address in {list(value)}")
        return value

    @model_validator(mode="after")
    def _mode_workers(self) -> RouterConfig:
        if self.mode == "disagg":
            if not self.prefill_addrs or not self.decode_addrs:
                raise ValueError("mode 'disagg' needs prefill_addrs and decode_addrs (>= 1 each)")
            if self.colocated_addrs:
                raise ValueError("colocated_addrs must be empty in mode 'disagg'")
            both = set(self.prefill_addrs) & set(self.decode_addrs)
            if both:
                raise ValueError(f"addresses listed as prefill and decode: {sorted(both)}")
        else:
            if not self.colocated_addrs:
                raise ValueError("mode 'colocated' needs colocated_addrs (>= 1)")
            if self.prefill_addrs or self.decode_addrs:
                raise ValueError("prefill_addrs/decode_addrs must be empty in mode 'colocated'")
        return self

    @model_validator(mode="after")
    def _hybrid(self) -> RouterConfig:
        if self.hybrid.enabled and self.mode != "disagg":
            raise ValueError(
                "hybrid.local_prefill_max_tokens > 0 lets decode workers prefill; it needs "
                f"mode 'disagg', got mode={self.mode!r}"
            )
        if self.hybrid.adaptive and not self.ratio.enabled:
            raise ValueError(
                "hybrid.max_local_prefill_max_tokens > 0 asks the ratio controller to move the "
                "threshold; it needs ratio.mode 'adaptive' or 'advisory', got 'fixed' (set "
                "max_local_prefill_max_tokens = 0 for a fixed threshold)"
            )
        return self

    @model_validator(mode="after")
    def _bind(self) -> RouterConfig:
        self.security.check_bind(self.host, "host")
        return self

    @model_validator(mode="after")
    def _ratio(self) -> RouterConfig:
        r = self.ratio
        if not r.enabled:
            return self
        if self.mode != "disagg":
            raise ValueError(
                f"ratio.mode={r.mode!r} tunes prefill:decode workers; it needs mode 'disagg', "
                f"got mode={self.mode!r}"
            )
        try:
            r.check_counts(len(self.prefill_addrs), len(self.decode_addrs))
        except ValueError as exc:
            raise ValueError(f"prefill_addrs / decode_addrs: {exc}") from None
        return self

    @classmethod
    def prefix_index_from_url(cls, url: str | None) -> MemoryIndexConfig | RedisIndexConfig:
        """`--redis-url` semantics: a Redis index at `url`, or the in-memory one for None."""
        return MemoryIndexConfig() if not url else RedisIndexConfig(url=url)

    @property
    def served_model_name(self) -> str:
        """`model_name`, or the model folder's name."""
        return self.model_name or self.model_dir.resolve().name
