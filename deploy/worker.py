"""One worker process: config, server object and command line.

Runs in a worker process (started by `pdserve up`, a Ray actor, or a test fixture)::

    python -m deploy.worker --model DIR --role prefill|decode|colocated [--port 0]
        [--worker-id ID] [--engine-json JSON] [--torch-threads N] [--host H] [--kv-host H]
        [--kv-port P] [--transfer-timeout-s S] [--stop-grace-s S] [--log-level LEVEL]

prints exactly one line ``PDSERVE_WORKER_READY host:port`` on stdout once its gRPC server
answers health checks with SERVING (logs go to stderr), and stops cleanly on SIGTERM / SIGINT:
no new work, in-flight work gets `--stop-grace-s` to finish, the rest is aborted, every KV
block released, the transport closed.

`WorkerServer(config).start()` is the same thing as a plain object (the Ray actor wraps it):
it loads the model once, starts the engine thread (`decode_worker.engine_thread`) and a
grpc.aio server on its own event-loop thread, and returns ``"host:port"``. `WorkerProcess`
is the other side of the command line: spawn, wait for READY, stop by PID (tests use it).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import grpc
import torch
from grpc_health.v1 import health, health_pb2_grpc
from pydantic import BaseModel, ConfigDict, Field, field_validator

from decode_worker.engine_thread import EngineThread
from decode_worker.kv_events import KVEventPublisher
from decode_worker.roles import RoleContext
from decode_worker.service import WorkerService
from kvtransfer.torch_dist import TorchDistTransport
from model_runtime.engine import LLMEngine
from model_runtime.engine_config import EngineConfig
from proto.pdserve.v1 import worker_pb2_grpc

log = logging.getLogger("pdserve.worker")
READY_PREFIX = "PDSERVE_WORKER_READY"
Role = Literal["prefill", "decode", "colocated"]


class WorkerConfig(BaseModel):
    """Everything one worker process is started with. Frozen; discovered values (bound ports,
    epoch, KV block count) live on `WorkerServer`, never here."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    worker_id: str = Field(
        default_factory=lambda: f"worker-{uuid.uuid4().hex[:8]}",
        description="Unique id of this worker (no '/' or '@'); names it in tickets and logs.",
    )
    model_dir: Path = Field(description="HF model folder (config.json + safetensors).")
    role: Role = Field(description="Initial role; SetRole changes it without a restart.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Engine sizing.")
    host: str = Field(default="127.0.0.1", description="gRPC bind address.")
    port: int = Field(default=0, ge=0, le=65535, description="gRPC port; 0 = pick a free one.")
    torch_threads: int | None = Field(
        default=None, gt=0, description="torch.set_num_threads; None keeps torch's default."
    )
    nice: int = Field(
        default=0,
        ge=0,
        le=19,
        description="Niceness to run at (raised at start, never lowered): on hosts where the "
        "router and Redis share CPUs with workers, their latency-critical work goes first.",
    )
    sched_idle: bool = Field(
        default=False,
        description="Run under SCHED_IDLE (Linux): the worker gets a CPU only when no "
        "normal-priority task wants it, so the router and Redis sharing its CPUs are never "
        "kept waiting by model compute. Stronger than `nice`; use it only on a host that serves "
        "nothing else, since any busy normal task starves the worker.",
    )
    transfer_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Reservation lifetime and KV transfer deadline when a Reserve carries no "
        "timeout_s.",
    )
    kv_host: str = Field(
        default="127.0.0.1", description="Address of this worker's KV transport (store + pairs)."
    )
    kv_port: int = Field(default=0, ge=0, le=65535, description="KV store port; 0 = pick.")
    kv_shared_memory: bool = Field(
        default=True,
        description="Keep the KV cache in shared memory and use the same-host data plane "
        "with peers that do too (CPU only; see kvtransfer.shm).",
    )
    kv_connect_timeout_s: float = Field(
        default=10.0, gt=0, description="Bound on joining a KV peer (never above a deadline)."
    )
    default_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="Deadline of a request that carries neither timeout_s nor a gRPC deadline.",
    )

    @field_validator("worker_id")
    @classmethod
    def _check_worker_id(cls, v: str) -> str:
        if not v or "/" in v or "@" in v or any(c.isspace() for c in v):
            raise ValueError(f"worker_id must be non-empty without '/', '@' or spaces, got {v!r}")
        return v


class WorkerServer:
    """A worker's engine thread + gRPC server in this process. `start()` once, `stop()` once."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.epoch = time.time_ns()  # changes on every start of a worker process
        self.address = ""
        self.kv_endpoint = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._engine_thread: EngineThread | None = None
        self._service: WorkerService | None = None
        self.kv_events = KVEventPublisher(config.worker_id, self.epoch)

    def start(self) -> str:
        """Load the model, start serving; return "host:port" once health says SERVING.

        Raises ValueError for an unusable config (e.g. host still "auto") and whatever model
        loading or binding raises; nothing is left running then.
        """
        cfg = self.config
        for name in ("host", "kv_host"):
            if getattr(cfg, name) == "auto":
                raise ValueError(f"{name} 'auto' must be resolved to an address before start()")
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
        )
        self.kv_endpoint = f"{transport.endpoint.host}:{transport.endpoint.port}"
        ctx = RoleContext(
            engine=engine,
            transport=transport,
            worker_id=cfg.worker_id,
            epoch=self.epoch,
            transfer_timeout_s=cfg.transfer_timeout_s,
            default_timeout_s=cfg.default_timeout_s,
        )
        engine_thread = EngineThread(ctx, cfg.role)
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
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_servicer = health.aio.HealthServicer()
        service = WorkerService(
            self._engine_thread,
            health_servicer,
            self.config.worker_id,
            self.kv_endpoint,
            self.epoch,
            self.kv_events,
        )
        worker_pb2_grpc.add_WorkerServicer_to_server(service, server)  # type: ignore[no-untyped-call]
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = int(server.add_insecure_port(f"{self.config.host}:{self.config.port}"))
        if port == 0:
            raise OSError(f"could not bind {self.config.host}:{self.config.port}")
        await server.start()
        self._server, self._service = server, service
        await service.set_serving(True)
        return port

    def stop(self, grace_s: float = 5.0) -> None:
        """NOT_SERVING; refuse new work; give in-flight work `grace_s` to finish, abort the
        rest (every block released); close the KV transport; stop the gRPC server."""
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
            self._loop = self._server = self._service = None
        log.info("worker %s stopped", self.config.worker_id)


class WorkerProcess:
    """A ``python -m deploy.worker`` child: `spawn` waits for its READY line; `stop` sends
    SIGTERM (SIGKILL after `timeout_s`), `kill` SIGKILL — always by PID."""

    def __init__(self, popen: subprocess.Popen[str], address: str) -> None:
        self.popen = popen
        self.address = address
        self.pid = popen.pid

    @classmethod
    def spawn(cls, args: Sequence[str], ready_timeout_s: float = 120.0) -> WorkerProcess:
        """Start ``python -m deploy.worker *args`` (stderr inherited) and wait for READY."""
        popen = subprocess.Popen(
            [sys.executable, "-m", "deploy.worker", *args],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()

        def pump() -> None:  # keeps reading, so the pipe never fills
            assert popen.stdout is not None
            for line in popen.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, name=f"worker-{popen.pid}-stdout", daemon=True).start()
        deadline = time.monotonic() + ready_timeout_s
        while True:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                popen.kill()
                popen.wait()
                raise TimeoutError(
                    f"worker pid {popen.pid} not ready in {ready_timeout_s} s"
                ) from None
            if line is None:
                raise RuntimeError(f"worker pid {popen.pid} exited ({popen.wait()}) before READY")
            if line.startswith(READY_PREFIX + " "):
                return cls(popen, line.split()[1])

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL; return the exit status."""
        if self.popen.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                return self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.error(
                    "worker pid %d ignored SIGTERM for %.0f s; killing it", self.pid, timeout_s
                )
        return self.kill()

    def kill(self) -> int:
        if self.popen.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        return self.popen.wait()


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


def parse_args(argv: Sequence[str] | None = None) -> tuple[WorkerConfig, float]:
    """(config, stop grace in seconds) from the command line; argparse exits on bad input."""
    p = argparse.ArgumentParser(prog="python -m deploy.worker", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF model folder")
    p.add_argument("--role", required=True, choices=["prefill", "decode", "colocated"])
    p.add_argument("--worker-id", help="unique worker id (default: worker-<random>)")
    p.add_argument("--host", default="127.0.0.1", help="gRPC bind address")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0 = pick)")
    p.add_argument("--engine-json", default="{}", help="EngineConfig as JSON")
    p.add_argument("--torch-threads", type=int, help="torch.set_num_threads")
    p.add_argument("--nice", type=int, default=0, help="niceness to run at (0-19)")
    p.add_argument(
        "--sched-idle", action="store_true", help="run under SCHED_IDLE (see WorkerConfig)"
    )
    p.add_argument("--kv-host", default="127.0.0.1", help="KV transport address")
    p.add_argument("--kv-port", type=int, default=0, help="KV store port (0 = pick)")
    p.add_argument(
        "--kv-shared-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="same-host shared-memory KV data plane (CPU)",
    )
    p.add_argument("--transfer-timeout-s", type=float, default=30.0)
    p.add_argument("--stop-grace-s", type=float, default=5.0, help="drain time on SIGTERM")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    logging.getLogger().setLevel(args.log_level)
    fields = {
        "model_dir": args.model,
        "role": args.role,
        "host": args.host,
        "port": args.port,
        "engine": EngineConfig.model_validate_json(args.engine_json),
        "torch_threads": args.torch_threads,
        "nice": args.nice,
        "sched_idle": args.sched_idle,
        "kv_host": args.kv_host,
        "kv_port": args.kv_port,
        "kv_shared_memory": args.kv_shared_memory,
        "transfer_timeout_s": args.transfer_timeout_s,
    }
    if args.worker_id:
        fields["worker_id"] = args.worker_id
    return WorkerConfig(**fields), args.stop_grace_s


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    try:
        config, grace_s = parse_args(argv)
    except ValueError as exc:  # pydantic ValidationError included
        print(f"deploy.worker: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = WorkerServer(config)
    server.start()
    print(f"{READY_PREFIX} {server.address}", flush=True)
    stop.wait()
    log.info("signal received; stopping (grace %.1f s)", grace_s)
    server.stop(grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
