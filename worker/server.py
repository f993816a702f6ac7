"""`WorkerServer`: one worker's engine thread + gRPC server in this process.

Runs in a worker process (`python -m worker_main`, a Ray actor, or a test fixture). `start()`
loads the model once, starts the engine thread (`worker.engine_thread`) with the roles it was
given plugged in (the table of every role, `worker_main.ROLES`, lives in the package above both
the host and the role packages: the composition root), the Prometheus exporter
(`worker.metrics`, unless `metrics_port` is None) and a grpc.aio server on its own event-loop
thread, and returns ``"host:port"``. With `[tracing]` on it also gets an OpenTelemetry tracer
(`tracing.make_tracer`), whose spans of this worker's RPCs the service builds
(`worker.tracing`). The `worker` package knows no role package.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping

import grpc
import torch
from grpc_health.v1 import health, health_pb2_grpc

from kvtransfer.torch_dist import TorchDistTransport
from model_runtime.engine import LLMEngine
from model_runtime.speculative.speculator import SpecStats
from proto.pdserve.v1 import worker_pb2_grpc
from security.channels import InternalAuth
from security.config import is_loopback
from security.kvseal import RecordSeal
from security.secret import ClusterSecret
from tracing import NO_TRACER, Tracer, make_tracer
from worker.config import WorkerConfig
from worker.engine_thread import EngineThread
from worker.kv_events import KVEventPublisher
from worker.kv_handoff import KVHandoff
from worker.metrics import WorkerMetrics
from worker.roles import RoleContext, RoleHandler
from worker.service import WorkerService

log = logging.getLogger("pdserve.worker")


class WorkerServer:
    """A worker's engine thread + gRPC server in this process. `start()` once, `stop()` once.

    `cluster_secret` closes the internal planes: every call but health needs the cluster's
    worker token (else UNAUTHENTICATED, before any handler runs), and the KV rendezvous takes
    only join/transfer records signed with it. None leaves both open, which `start` allows
    only on loopback addresses unless `config.insecure`."""

    def __init__(
        self,
        config: WorkerConfig,
        roles: Mapping[str, type[RoleHandler]],
        cluster_secret: ClusterSecret | None = None,
    ) -> None:
        """`roles`: every role this worker can take, by name (what `--role` and `SetRole`
        accept; `worker_main.ROLES`)."""
        self.config = config
        self.roles = dict(roles)
        self._internal = InternalAuth(cluster_secret, config.internal_tls)
        self._secret = cluster_secret
        self.epoch = time.time_ns()  # changes on every start of a worker process
        self.address = ""
        self.kv_endpoint = ""
        self._transport: TorchDistTransport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._engine_thread: EngineThread | None = None
        self._service: WorkerService | None = None
        self.kv_events = KVEventPublisher(config.worker_id, self.epoch)
        self.metrics: WorkerMetrics | None = None
        self.metrics_port = 0
        self.tracer: Tracer = NO_TRACER

    def start(self) -> str:
        """Load the model, start serving; return "host:port" once health says SERVING.

        Raises ValueError for an unusable config (e.g. host still "auto") and whatever model
        loading or binding raises; nothing is left running then.
        """
        cfg = self.config
        for name in ("host", "kv_host"):
            if getattr(cfg, name) == "auto":
                raise ValueError(f"{name} 'auto' must be resolved to an address before start()")
            if self._secret is None and not cfg.insecure and not is_loopback(getattr(cfg, name)):
                raise ValueError(
                    f"{name}={getattr(cfg, name)!r} is not a loopback address and this worker has "
                    "no cluster secret: anyone on the network could call its API and join its KV "
                    "rendezvous. Give it the secret (PDSERVE_CLUSTER_SECRET or "
                    "--cluster-secret-file), bind 127.0.0.1, or pass --insecure."
                )
        log.info("worker config %s", cfg.model_dump_json())
        lower_priority(cfg.nice, cfg.sched_idle)
        if cfg.torch_threads is not None:
            torch.set_num_threads(cfg.torch_threads)
        engine = LLMEngine.from_model_dir(cfg.model_dir, cfg.engine, self.kv_events.on_event)
        transport = TorchDistTransport(
            engine.runner.kv_cache,
            cfg.worker_id,
            host=cfg.kv_host,
            port=cfg.kv_port,
            connect_timeout_s=cfg.kv_connect_timeout_s,
            shared_memory=cfg.kv_shared_memory,
            node=cfg.node,
            seal=None if self._secret is None else RecordSeal(self._secret),
        )
        self.kv_endpoint = f"{transport.endpoint.host}:{transport.endpoint.port}"
        self._transport = transport
        ctx = RoleContext(
            engine=engine,
            handoff=KVHandoff(engine, transport, self.epoch),
            worker_id=cfg.worker_id,
            transfer_timeout_s=cfg.transfer_timeout_s,
            default_timeout_s=cfg.default_timeout_s,
        )
        model_name = cfg.model_dir.resolve().name
        engine_thread = EngineThread(ctx, self.roles, cfg.role)
        # OpenTelemetry only with [tracing] on; its export thread starts at this niceness
        self.tracer = make_tracer(cfg.tracing, "worker", cfg.worker_id)
        if cfg.metrics_port is not None:
            self.metrics = WorkerMetrics(
                model_name,
                lambda: engine_thread.snapshot,
                engine.runner.kv_cache.cache_dtype,
                self.tracer.counts if self.tracer.enabled else None,
                _spec_stats(engine),
                weights=engine.runner.weights_label,
                weight_bytes=engine.runner.weight_bytes(),
            )
            engine_thread.metrics = self.metrics
            self.metrics_port = self.metrics.serve(cfg.host, cfg.metrics_port)
        engine_thread.start()
        self._engine_thread = engine_thread
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._loop_thread = threading.Thread(target=loop.run_forever, name="grpc-loop", daemon=True)
        self._loop_thread.start()
        try:
            port = asyncio.run_coroutine_threadsafe(self._serve(), loop).result(timeout=60)
        except BaseException:
            self.stop(0.0)
            raise
        self.address = f"{cfg.host}:{port}"
        log.info(
            "worker %s serving on %s as %s; KV endpoint %s; %d KV blocks",
            cfg.worker_id,
            self.address,
            cfg.role,
            self.kv_endpoint,
            engine.num_kv_blocks,
        )
        return self.address

    async def _serve(self) -> int:
        assert self._engine_thread is not None, "start() creates the engine thread first"
        server = grpc.aio.server(
            options=[("grpc.so_reuseport", 0)], interceptors=self._internal.server_interceptors()
        )
        health_servicer = health.aio.HealthServicer()
        service = WorkerService(
            self._engine_thread,
            health_servicer,
            self.config.worker_id,
            self.kv_endpoint,
            self.epoch,
            self.kv_events,
            node=self.config.node,
            metrics_port=self.metrics_port,
            tracer=self.tracer,
        )
        worker_pb2_grpc.add_WorkerServicer_to_server(service, server)  # type: ignore[no-untyped-call]
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = self._internal.add_port(server, f"{self.config.host}:{self.config.port}")
        if port == 0:
            raise OSError(f"could not bind {self.config.host}:{self.config.port}")
        await server.start()
        self._server, self._service = server, service
        await service.set_serving(True)
        return port

    def kv_shared_memory_peers(self) -> list[str]:
        """Receivers this worker sends KV to through shared memory now (empty before start)."""
        return [] if self._transport is None else self._transport.shared_memory_peers()

    def stop(self, grace_s: float = 5.0) -> None:
        """NOT_SERVING; refuse new work; give in-flight work `grace_s` to finish, abort the
        rest (every block released); close the KV transport; stop the gRPC server and the
        service's compile thread."""
        loop = self._loop
        if loop is not None and self._service is not None:
            asyncio.run_coroutine_threadsafe(self._service.set_serving(False), loop).result(5)
        if self._engine_thread is not None:
            self._engine_thread.stop(grace_s)  # streams end while the loop still runs
            self._engine_thread = None
        if loop is not None:
            server = self._server
            if server is not None:
                asyncio.run_coroutine_threadsafe(server.stop(1.0), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(10)
            loop.close()
            if self._service is not None:
                self._service.close()
            self._loop = self._server = self._service = None
        if self.metrics is not None:
            self.metrics.stop()
        self.tracer.shutdown()  # bounded: tracing.shutdown_timeout_s
        log.info("worker %s stopped", self.config.worker_id)


def lower_priority(nice: int, sched_idle: bool = False) -> int:
    """Raise the calling thread's niceness to `nice` (no-op if already at or above it) and, with
    `sched_idle`, move it to the SCHED_IDLE policy; return the niceness now. Linux niceness and
    scheduling policy are per thread and inherited by threads started later, so call it before
    the engine, torch and gRPC threads exist (`WorkerServer.start` does)."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if nice > current:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    if sched_idle:
        if not hasattr(os, "SCHED_IDLE"):
            raise ValueError("sched_idle needs Linux's SCHED_IDLE scheduling policy")
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    return os.getpriority(os.PRIO_PROCESS, 0)


def _spec_stats(engine: LLMEngine) -> Callable[[], SpecStats] | None:
    """What the metrics read of the engine's speculative decoding (None when it is off): its
    counters, one object mutated in place for the engine's life."""
    if engine.speculator is None:
        return None
    stats = engine.speculator.stats
    return lambda: stats
