"""Router assembly: `start_router(config) -> RouterHandle`. Runs in the router process.

Start-up order: read the model's config and tokenizer (torch-free) -> register the configured
workers and poll each once (so health is right from the first call) -> build the prefix index
(in-memory, or Redis with `prefix_index.kind = "redis"`; no I/O yet: Redis being down only
means load-only routing) and start one indexer per prefill/colocated worker -> start the
grpc.aio server with the `Inference` service, the standard `grpc.health.v1.Health` service and
gRPC server reflection (so `grpcurl` and other generic clients need no .proto files) -> with
`http_port` set, the OpenAI HTTP front (`router.http`) and `/metrics` on the same loop -> with
`ratio.mode` 'adaptive' or 'advisory', start the ratio controller (`make_ratio_controller`).
The router's Prometheus metrics (`router.metrics`) are fed by the request lifecycle, the
prefix index's lookups and the ratio controller's decisions.

Tracing (`[tracing]`, `docs/observability.md`): with it on, the router gets an OpenTelemetry
tracer of its own (`tracing.make_tracer`; nothing of OpenTelemetry is imported otherwise), the
lifecycle traces every request (`router.request_trace`) and the metrics carry its span counters
and trace-id exemplars; `stop` exports what is queued, bounded by `shutdown_timeout_s`.

Security (`docs/security.md`): the public port is TLS / mutual TLS and the `Inference` service
needs a bearer token when `security` says so (`router.auth.PublicAuth`: interceptor, token-file
watcher; health open); every call to a worker carries the cluster secret's token and, with
`security.internal`, goes over mutual TLS (`security.channels.InternalAuth`, in the pool).

Ratio controller: one `RatioController` task on the router's loop (`handle.ratio`), fed every
finished request by the request lifecycle (`lifecycle.OutcomeObserver`) and the pool's views.
'adaptive' acts through a `PoolActuator` (Worker.SetRole) whose role-change callback keeps the
indexers right: a worker that becomes prefill (or colocated) gets an indexer, one that stops
being prefill loses it. 'advisory' gets no actuator at all: it records decisions, never calls
SetRole. Decisions go to the log and, with `ratio.decisions_path`, to a JSONL file.

Health: both the overall service ("") and `pdserve.v1.Inference` report SERVING while at least
one usable route exists (disagg: a usable prefill *and* a usable decode worker; colocated: a
usable colocated worker), NOT_SERVING otherwise; recomputed after every status poll and every
worker failure the request path reports.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from model_runtime.config import ModelConfig
from model_runtime.tokenizer import Tokenizer
from router.auth import PublicAuth
from router.config import RouterConfig
from router.http.server import HttpFront, start_http_front
from router.hybrid import LiveThreshold
from router.indexer import Indexers, KVEventSource
from router.kv_source import GrpcKVEventSource
from router.lifecycle import RequestLifecycle
from router.metrics import RouterMetrics
from router.pair_scoring import PairScoringConfig
from router.policies import make_policy
from router.policy import Role, WorkerView
from router.pool import WorkerPool
from router.prefix_index.config import make_index
from router.prefix_index.guard import GuardedPrefixIndex
from router.ratio.actuator import PoolActuator
from router.ratio.driver import RatioController
from router.registry import InMemoryWorkerRegistry, WorkerRegistry
from router.server import SERVICE_NAME, InferenceService
from router.validation import ModelLimits
from security.channels import InternalAuth
from security.secret import ClusterSecret, resolve_cluster_secret
from tracing import NO_TRACER, Tracer, make_tracer

log = logging.getLogger(__name__)

MIN_RECEIVE_BYTES = 64 * 2**20
"""The router reads requests up to this size at least (then refuses those over the model's
`ModelLimits.max_request_bytes` itself); larger ones get the transport's RESOURCE_EXHAUSTED."""
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def pair_scoring(config: RouterConfig, model: ModelConfig) -> PairScoringConfig:
    """The configured pair scoring, with the KV bytes per token and the layer count taken from
    the model where the config leaves them 0 (K and V of every layer in the model's dtype)."""
    ps = config.pair_scoring
    update: dict[str, float | int] = {}
    if ps.kv_bytes_per_token == 0:
        width = {"float32": 4, "bfloat16": 2, "float16": 2}[model.torch_dtype]
        layers, heads = model.num_hidden_layers, model.num_key_value_heads
        update["kv_bytes_per_token"] = float(2 * layers * heads * model.head_dim * width)
    if ps.num_layers == 0:
        update["num_layers"] = model.num_hidden_layers
    return ps.model_copy(update=update)


def has_usable_route(mode: str, views: list[WorkerView]) -> bool:
    """True when a request could be routed now (ignoring capacity)."""
    return not route_problem(mode, views)


def route_problem(mode: str, views: list[WorkerView]) -> str:
    """Why no request can be routed now, in words ("" when one can): each role without a
    usable worker, with why each of its workers is unusable."""
    roles = ("colocated",) if mode == "colocated" else ("prefill", "decode")
    problems = []
    for role in roles:
        mine = [v for v in views if v.role == role]
        if not any(v.usable for v in mine):
            why = "; ".join(v.why_unusable() for v in mine) or "none registered"
            problems.append(f"no usable {role} worker ({why})")
    return ", ".join(problems)


class RouterHealth:
    """Pushes SERVING / NOT_SERVING into the health servicer when routability changes; the
    reason for NOT_SERVING is logged and kept in `reason`."""

    def __init__(self, mode: str, servicer: health.aio.HealthServicer) -> None:
        self._mode = mode
        self._servicer = servicer
        self.serving: bool | None = None
        self.reason = "not started"

    async def __call__(self, views: list[WorkerView]) -> None:
        self.reason = route_problem(self._mode, views)
        serving = not self.reason
        if serving == self.serving:
            return
        first, self.serving = self.serving is None, serving
        status = _SERVING if serving else _NOT_SERVING
        if serving or first:  # at start, NOT_SERVING until the first poll is no news
            log.info("router health -> %s", "SERVING" if serving else "NOT_SERVING")
        else:
            log.warning("router health -> NOT_SERVING: %s", self.reason)
        for name in ("", SERVICE_NAME):
            await self._servicer.set(name, status)


@dataclass
class RouterHandle:
    """A running router. `port` is the bound public port; `stop()` shuts everything down."""

    config: RouterConfig
    port: int
    server: grpc.aio.Server
    pool: WorkerPool
    service: InferenceService
    health: health.aio.HealthServicer
    prefix_index: GuardedPrefixIndex
    indexers: Indexers
    metrics: RouterMetrics
    ratio: RatioController | None = None  # None: ratio.mode 'fixed'
    http: HttpFront | None = None  # None: no http_port configured
    routability: RouterHealth | None = None
    auth: PublicAuth | None = None
    tracer: Tracer = NO_TRACER

    @property
    def health_reason(self) -> str:
        """Why the router says NOT_SERVING now, in words ("" while it serves)."""
        return self.routability.reason if self.routability is not None else ""

    @property
    def address(self) -> str:
        """host:port clients dial."""
        return f"{self.config.host}:{self.port}"

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop the ratio controller (no role change starts from here on), NOT_SERVING, stop
        the HTTP front, stop taking gRPC calls (running streams get `grace_s`, default
        `config.shutdown_grace_s`, to finish; the rest are cancelled and aborted on their
        workers), send pending aborts, stop the indexers, stop polling and close the worker
        channels."""
        if self.ratio is not None:
            await self.ratio.stop()
        await self.health.enter_graceful_shutdown()
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        log.info("router stopping: running streams get %.1f s to finish", grace)
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(grace)
        self.service.lifecycle.close()
        await self.service.wait_cleanup(self.config.abort_timeout_s + 1.0)
        await self.indexers.stop()
        await self.prefix_index.close()
        await self.pool.stop()
        if self.auth is not None:
            await self.auth.stop()
        await asyncio.to_thread(self.tracer.shutdown)  # bounded: tracing.shutdown_timeout_s

    async def wait_for_termination(self) -> None:
        """Block until the server stops."""
        await self.server.wait_for_termination()


def registry_ttl_s(config: RouterConfig) -> float:
    """How long a worker stays healthy without an answer: longer than the `status_poll_misses`
    slow polls the health rule allows (at least 5 s, and ten poll periods)."""
    per_poll = config.status_poll_interval_s + config.status_poll_timeout_s
    return max(5.0, 10 * config.status_poll_interval_s, 2 * config.status_poll_misses * per_poll)


def _config_for_log(config: RouterConfig) -> str:
    """The effective config as JSON (a Redis password is masked by the config itself)."""
    return config.model_dump_json()


async def start_router(
    config: RouterConfig,
    registry: WorkerRegistry | None = None,
    kv_sources: Callable[[str], KVEventSource] | None = None,
    cluster_secret: ClusterSecret | None = None,
) -> RouterHandle:
    """Start a router for `config`; return once it is listening and workers were polled once.

    Raises ValueError for an unusable model folder or security file, RuntimeError if the port
    cannot be bound. `registry` defaults to an `InMemoryWorkerRegistry`; `kv_sources(address)`
    gives a worker's KV event source (default: the worker's `StreamKVEvents` / `GetKVSnapshot`
    RPCs). `cluster_secret` is what every call to a worker carries; None takes
    `security.cluster_secret_file`, else ``PDSERVE_CLUSTER_SECRET``, else none (workers
    started without a secret).
    """
    log.debug("router config: %s", _config_for_log(config))
    tracer = make_tracer(config.tracing, "router", f"router-{os.getpid()}@{socket.gethostname()}")
    auth = PublicAuth(config.security)
    secret = cluster_secret or resolve_cluster_secret(config.security.cluster_secret_file)
    internal = InternalAuth(secret, config.security.internal)
    model = ModelConfig.from_model_dir(config.model_dir)
    tokenizer = Tokenizer.from_model_dir(config.model_dir)
    limits = ModelLimits.for_model(
        model.vocab_size, model.max_position_embeddings, tokenizer.max_token_chars
    )
    health_servicer = health.aio.HealthServicer()
    updater = RouterHealth(config.mode, health_servicer)
    await updater([])  # NOT_SERVING until the first poll says otherwise
    pool = WorkerPool(
        registry if registry is not None else InMemoryWorkerRegistry(ttl_s=registry_ttl_s(config)),
        poll_interval_s=config.status_poll_interval_s,
        poll_timeout_s=config.status_poll_timeout_s,
        poll_misses=config.status_poll_misses,
        on_change=updater,
        internal=internal,
    )
    roles: list[tuple[Role, tuple[str, ...]]] = [
        ("prefill", config.prefill_addrs),
        ("decode", config.decode_addrs),
        ("colocated", config.colocated_addrs),
    ]
    for role, addrs in roles:
        for addr in addrs:
            await pool.add(addr, role)
    await pool.start()
    prefix_index = make_index(config.prefix_index)
    indexers = Indexers(prefix_index, config.prefix_index.heartbeat_s, config.prefix_index.ttl_s)

    def grpc_source(addr: str) -> KVEventSource:
        return GrpcKVEventSource(addr, lambda: pool.stub(addr))

    sources = kv_sources if kv_sources is not None else grpc_source
    # A hybrid cluster's decode workers prefill too: their prefix caches price the local path.
    decode_indexed = config.decode_addrs if config.hybrid.enabled else ()
    for addr in (*config.prefill_addrs, *config.colocated_addrs, *decode_indexed):
        indexers.add(addr, sources(addr))
    # The live hybrid threshold: the request path reads it, only the ratio controller sets it.
    threshold = LiveThreshold(config.hybrid) if config.hybrid.enabled else None
    ratio = make_ratio_controller(config, pool, indexers, sources, threshold)
    policy = make_policy(config.policy, config.prefix_routing, pair_scoring(config, model))
    lifecycle = RequestLifecycle(
        config,
        tokenizer,
        limits,
        pool,
        policy,
        prefix_index,
        ratio,
        threshold=threshold,
        tracer=tracer,
    )
    metrics = RouterMetrics(
        config.served_model_name,
        lifecycle.admission,
        pool.views,
        threshold=None if threshold is None else (lambda: threshold.value),
        span_counts=tracer.counts if tracer.enabled else None,
        weights=model.weights_label(),
    )
    lifecycle.recorder = metrics
    prefix_index.observer = metrics.observe_prefix_lookup
    if ratio is not None:
        ratio.on_decision = metrics.observe_ratio_decision
    service = InferenceService(lifecycle)
    # Receive requests well over the model's own limit, so the service can refuse them
    # naming that limit (INVALID_ARGUMENT) instead of the transport's RESOURCE_EXHAUSTED.
    receive = max(MIN_RECEIVE_BYTES, 2 * limits.max_request_bytes)
    server = grpc.aio.server(
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", receive)],
        interceptors=auth.interceptors(),
    )
    server.add_generic_rpc_handlers((service.rpc_handlers(),))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    try:
        port = auth.add_port(server, f"{config.host}:{config.port}")
    except RuntimeError as exc:
        await indexers.stop()
        await prefix_index.close()
        await pool.stop()
        await asyncio.to_thread(tracer.shutdown)
        raise RuntimeError(f"router cannot bind {config.host}:{config.port}: {exc}") from exc
    await server.start()
    auth.start()
    log.info(
        "router listening on %s:%d (mode=%s; %s; worker calls %s; tracing %s)",
        config.host,
        port,
        config.mode,
        auth.describe(),
        "authenticated" if secret is not None else "NOT authenticated (no cluster secret)",
        "on" if tracer.enabled else "off",
    )
    http: HttpFront | None = None
    if config.http_port is not None:
        try:
            http = await start_http_front(
                lifecycle,
                config.host,
                config.http_port,
                lambda: bool(updater.serving),
                metrics.exposition,
                middlewares=[auth.http_middleware()],
                ssl_context=auth.ssl_context(),
                header_timeout_s=config.http_header_timeout_s,
                body_timeout_s=config.http_body_timeout_s,
            )
        except (RuntimeError, ValueError):
            await server.stop(None)
            await indexers.stop()
            await prefix_index.close()
            await pool.stop()
            await auth.stop()
            await asyncio.to_thread(tracer.shutdown)
            raise
    if ratio is not None:
        ratio.start()
    return RouterHandle(
        config,
        port,
        server,
        pool,
        service,
        health_servicer,
        prefix_index,
        indexers,
        metrics,
        ratio,
        http,
        updater,
        auth,
        tracer,
    )


def make_ratio_controller(
    config: RouterConfig,
    pool: WorkerPool,
    indexers: Indexers,
    sources: Callable[[str], KVEventSource],
    threshold: LiveThreshold | None = None,
) -> RatioController | None:
    """The (not yet started) ratio controller for `config.ratio`: None in mode 'fixed';
    'advisory' without an actuator; 'adaptive' with a `PoolActuator` whose `on_role_change`
    adds an indexer for a worker that became prefill/colocated (or decode, in a hybrid cluster)
    and removes the indexer of one that became anything else. With `[router.hybrid]`'s bounds
    set (`HybridConfig.adaptive`) it also moves `threshold`, the router's live one."""
    if not config.ratio.enabled:
        return None
    moved = threshold if config.hybrid.adaptive else None
    if config.ratio.mode == "advisory":
        return RatioController(config.ratio, pool, threshold=moved)

    indexed: tuple[Role, ...] = ("prefill", "colocated")
    if config.hybrid.enabled:
        indexed += ("decode",)

    async def on_role_change(address: str, role: Role) -> None:
        if role in indexed:
            indexers.add(address, sources(address))
        else:
            await indexers.remove(address)

    actuator = PoolActuator(pool, on_role_change=on_role_change)
    return RatioController(config.ratio, pool, actuator, threshold=moved)
