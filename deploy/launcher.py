"""Local-process launcher: a pdserve cluster as plain subprocesses, without Ray.

Runs in the process that launches (`pdserve up --no-ray`, e2e test fixtures). Children are
started, awaited and stopped by `deploy.processes` (own session, log file, stop by PID, atexit
clean-up); a cluster stops in order: router first, then workers.

    workers = launch_workers(config)             # N x `python -m worker_main`, READY parsed
    workers.addresses()                          # {"prefill": ["127.0.0.1:4711"], ...}
    router = launch_router_process(config.router_config(workers.addresses(), port=0))
    cluster = launch_local_cluster(config)       # both of the above: LocalCluster
    cluster.address; cluster.pids(); cluster.stop()

Config: each child gets its whole config as one JSON document, a file next to its log
(``<name>.config.json``) named by ``--config``: a worker its `WorkerConfig`
(`ClusterConfig.worker_config`, the same document the Ray launcher hands its actors), a router
its `RouterConfig` (`ClusterConfig.router_config`). No config field travels as a flag.

Readiness is each process's own announcement (`PDSERVE_WORKER_READY host:port`, printed once
the worker's gRPC health service says SERVING; `pdserve-router ready host=H port=P`) followed by
a `grpc.health.v1` check; never a sleep.

Security: `launch_workers` takes the cluster secret (`security.cluster_secret_file`, else
``PDSERVE_CLUSTER_SECRET``, else a fresh one) and hands it to every child through its
environment, never its command line; `ProcessWorkers.internal` is what a process needs to call
those workers (their token, the cluster certificate). A Redis password reaches a router child
through ``PDSERVE_REDIS_PASSWORD``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy.config import ClusterConfig, check_model_dir
from deploy.processes import (
    ManagedProcess,
    child_env,
    spawn,
    stop_processes,
    wait_for_lines,
    wait_serving,
)
from deploy.supervision import (
    EventLog,
    ProcessSupervisor,
    Supervised,
    SupervisionEvent,
)
from proto.pdserve.v1.roles import Role
from router.config import RouterConfig
from router.prefix_index.config import REDIS_PASSWORD_ENV, RedisIndexConfig, strip_password
from router.ratio.config import RatioConfig
from security.channels import ClientSecurity, InternalAuth
from security.secret import ClusterSecret, resolve_cluster_secret
from tooling.launch import WorkerRef
from worker.config import thread_env
from worker.parent_watch import PARENT_PID_ENV

log = logging.getLogger(__name__)

WORKER_READY = re.compile(r"^PDSERVE_WORKER_READY (\S+:\d+)\s*$", re.M)
ROUTER_READY = re.compile(
    r"^pdserve-router ready host=(\S+) port=(\d+)(?: http_port=(\d+))?\s*$", re.M
)


def write_document(log_dir: Path, name: str, document: str) -> Path:
    """Write a child's config `document` (JSON) to ``log_dir/<name>.config.json`` (mode 0600:
    it names security files; secrets themselves go through the environment) and return its
    path."""
    path = log_dir / f"{name}.config.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(document)
    return path


def worker_host(config: ClusterConfig) -> str:
    """The interface process-launched workers bind ("auto" = 127.0.0.1: one host)."""
    return "127.0.0.1" if config.worker_host == "auto" else config.worker_host


def spawn_worker(
    config: ClusterConfig, worker_id: str, role: Role, name: str, logs: Path,
    env: dict[str, str], port: int = 0,
) -> ManagedProcess:  # fmt: skip
    """Start `python -m worker_main --config <its WorkerConfig document>` as `name`; `port` 0
    picks one (a restart passes the worker's old port, so the router's address list stays
    valid)."""
    wc = config.worker_config(worker_id, role, worker_host(config), port)
    doc = write_document(logs, name, wc.model_dump_json())
    argv = [sys.executable, "-m", "worker_main", "--config", str(doc)]
    return spawn(name, argv, logs, {**env, **thread_env(wc)})


@dataclass
class LaunchedWorker:
    """One running worker: its id, role (at launch), address and process."""

    worker_id: str
    role: Role
    address: str
    process: ManagedProcess


@dataclass
class ProcessWorkers:
    """`tooling.launch.Workers` as local processes: the worker processes of one cluster
    (`config`), watched by a `ProcessSupervisor` (a dead worker is
    reaped, logged and restarted on its address; `events` says what happened); `stop()` ends
    them all (idempotent). `internal`: how to call them (the cluster secret's token, the
    cluster certificate)."""

    workers: list[LaunchedWorker]
    log_dir: Path
    config: ClusterConfig
    supervisor: ProcessSupervisor | None = None
    internal: InternalAuth = field(default_factory=InternalAuth)

    @property
    def drain_timeout_s(self) -> float:
        """How long each worker drains on SIGTERM (`worker.stop_grace_s`)."""
        return self.config.worker.stop_grace_s

    @property
    def router_config(self) -> RouterConfig:
        """The config of a router in front of these workers (`tooling.launch.Workers`)."""
        return self.config.router_config(self.addresses())

    @property
    def events(self) -> list[SupervisionEvent]:
        """Deaths, restarts and role changes seen so far (empty without a supervisor)."""
        return self.supervisor.events.events if self.supervisor is not None else []

    def addresses(self) -> dict[str, list[str]]:
        """role -> worker addresses, as launched (roles can change later via SetRole)."""
        out: dict[str, list[str]] = {"prefill": [], "decode": [], "colocated": []}
        for w in self.workers:
            out[w.role].append(w.address)
        return out

    def pids(self) -> list[int]:
        """The workers' current pids (a restarted worker has a new one)."""
        return [w.process.pid for w in self.workers]

    def members(self) -> list[WorkerRef]:
        """The workers, in launch order (`tooling.launch.Workers`)."""
        return [WorkerRef(w.worker_id, w.role, w.address) for w in self.workers]

    def live_pid(self, worker_id: str) -> int | None:
        """The pid running `worker_id` now; None while it is dead (before its restart)."""
        w = next(w for w in self.workers if w.worker_id == worker_id)
        return w.process.pid if w.process.running() else None

    def stop(self, grace_s: float | None = None) -> None:
        """Stop supervising, SIGTERM every worker (each drains for up to its own
        --stop-grace-s, `worker.stop_grace_s`), SIGKILL those still running after `grace_s`
        (default: the drain timeout + 10 s)."""
        starting = self.supervisor.stop() if self.supervisor is not None else []
        wait = self.drain_timeout_s + 10.0 if grace_s is None else grace_s
        stop_processes([*starting, *(w.process for w in self.workers)], wait)


def _log_dir(log_dir: str | Path | None) -> Path:
    path = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="pdserve-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def launch_workers(
    config: ClusterConfig,
    log_dir: str | Path | None = None,
    timeout_s: float = 120.0,
    on_event: Callable[[SupervisionEvent], None] | None = None,
    cluster_secret: ClusterSecret | None = None,
) -> ProcessWorkers:
    """Start every worker of `config` at once (they load the model in parallel) and return
    when each one announced READY and answers SERVING; from then on a `ProcessSupervisor`
    (`config.supervision`) restarts workers that die, telling `on_event` what it sees.
    `cluster_secret` None: the one of `security.cluster_secret_file` /
    ``PDSERVE_CLUSTER_SECRET``, else a fresh one. On any
    failure every process started here is stopped and the error (RuntimeError / TimeoutError
    / ValueError) propagates."""
    check_model_dir(config)
    config.security.check_files()
    secret = cluster_secret or resolve_cluster_secret(
        config.security.cluster_secret_file, generate=True
    )
    assert secret is not None, "generate=True always gives a secret"
    internal = InternalAuth(secret, config.security.internal)
    logs = _log_dir(log_dir)
    # Workers stop when this process dies, even by SIGKILL (`worker.parent_watch`).
    env = {**child_env(1), **secret.env(), PARENT_PID_ENV: str(os.getpid())}
    started: list[tuple[str, Role, ManagedProcess]] = []
    try:
        for worker_id, role in config.worker_roles():
            proc = spawn_worker(config, worker_id, role, f"worker-{worker_id}", logs, env)
            started.append((worker_id, role, proc))
        matches = wait_for_lines([p for _, _, p in started], WORKER_READY, timeout_s)
        workers = [
            LaunchedWorker(wid, role, m.group(1), proc)
            for (wid, role, proc), m in zip(started, matches, strict=True)
        ]
        for w in workers:
            wait_serving(w.address, timeout_s=10.0, open_channel=internal.channel)
    except BaseException:
        stop_processes([p for _, _, p in started], grace_s=2.0)
        raise
    log.info(
        "workers ready: %s", {w.worker_id: f"{w.address} pid {w.process.pid}" for w in workers}
    )

    by_id = {w.worker_id: w for w in workers}

    def respawn(dead: Supervised, n: int) -> ManagedProcess:
        w = by_id[dead.worker_id]
        port = int(w.address.rpartition(":")[2])
        name = f"worker-{w.worker_id}-restart{n}"
        return spawn_worker(config, w.worker_id, w.role, name, logs, env, port)

    events = EventLog((w.role for w in workers), on_event)
    supervisor = ProcessSupervisor(workers, config.supervision, respawn, WORKER_READY, events)
    supervisor.start()
    return ProcessWorkers(workers, logs, config, supervisor, internal)


class ProcessLauncher:
    """`deploy.launchers.WorkerLauncher` with local subprocesses (`launch_workers`)."""

    def __init__(self, timeout_s: float = 120.0) -> None:
        self.timeout_s = timeout_s

    def launch(
        self,
        config: ClusterConfig,
        *,
        log_dir: Path | None = None,
        on_event: Callable[[SupervisionEvent], None] | None = None,
        cluster_secret: ClusterSecret | None = None,
    ) -> ProcessWorkers:
        """Start the workers of `config` as local processes; serving on return."""
        return launch_workers(config, log_dir, self.timeout_s, on_event, cluster_secret)


# ---------------------------------------------------------------------- router


def router_document(rc: RouterConfig) -> str:
    """`rc` as the JSON document a router child reads (`python -m router --config`): the
    Redis password left out (it goes by `router_env`), a relative ratio decisions_path and
    the model folder made absolute."""
    update: dict[str, Any] = {"model_dir": Path(rc.model_dir).resolve()}
    if isinstance(rc.prefix_index, RedisIndexConfig):
        update["prefix_index"] = rc.prefix_index.model_copy(
            update={"url": strip_password(rc.prefix_index.url), "password": None}
        )
    path = rc.ratio.decisions_path
    if path is not None:
        update["ratio"] = rc.ratio.model_copy(update={"decisions_path": path.resolve()})
    return rc.model_copy(update=update).model_dump_json()


def router_env(rc: RouterConfig, cluster_secret: ClusterSecret | None) -> dict[str, str]:
    """The secrets a router child gets through its environment: the cluster secret and the
    Redis password (URL, `password` or `password_file`)."""
    env = {} if cluster_secret is None else cluster_secret.env()
    if isinstance(rc.prefix_index, RedisIndexConfig):
        password = rc.prefix_index.resolved_password()
        if password:
            env[REDIS_PASSWORD_ENV] = password
    return env


@dataclass
class RouterProcess:
    """A `python -m router` child; `address` is what gRPC clients dial, `http_url` the base
    URL of its OpenAI API (None without an HTTP port)."""

    config: RouterConfig
    address: str
    process: ManagedProcess
    http_url: str | None = None

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM (running streams get the router's shutdown grace), SIGKILL after `grace_s`
        (default: that grace + 10 s)."""
        wait = self.config.shutdown_grace_s + 10.0 if grace_s is None else grace_s
        stop_processes([self.process], wait)


def launch_router_process(
    rc: RouterConfig,
    log_dir: str | Path | None = None,
    timeout_s: float = 30.0,
    name: str = "",
    cluster_secret: ClusterSecret | None = None,
    client: ClientSecurity | None = None,
) -> RouterProcess:
    """Start a router process for `rc`; return once it announced its port and its health
    service says SERVING (its workers are reachable). Stops it again on failure.

    `cluster_secret`: what its calls to workers carry. `client`: how to dial it for the
    health check, required when `rc` serves TLS (e.g. the CA and, for mutual TLS, a client
    certificate)."""
    if rc.security.tls and client is None:
        raise ValueError("a TLS router's readiness check needs client= (a ClientSecurity)")
    logs = _log_dir(log_dir)
    env = {**child_env(1), **router_env(rc, cluster_secret)}
    name = name or f"router-{len(list(logs.glob('router*.log')))}"
    doc = write_document(logs, name, router_document(rc))
    proc = spawn(name, [sys.executable, "-m", "router", "--config", str(doc)], logs, env)
    try:
        (m,) = wait_for_lines([proc], ROUTER_READY, timeout_s)
        address = f"{m.group(1)}:{m.group(2)}"
        scheme = "https" if rc.security.tls_cert is not None else "http"
        http_url = f"{scheme}://{m.group(1)}:{m.group(3)}/v1" if m.group(3) else None
        wait_serving(address, timeout_s, open_channel=None if client is None else client.channel)
    except BaseException:
        stop_processes([proc], grace_s=2.0)
        raise
    return RouterProcess(rc, address, proc, http_url)


# ---------------------------------------------------------------------- whole cluster


@dataclass
class LocalCluster:
    """Workers + one router, all local processes. `stop()`: router first, then workers."""

    config: ClusterConfig
    workers: ProcessWorkers
    router: RouterProcess
    extra_routers: list[RouterProcess] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.router.address

    @property
    def http_url(self) -> str | None:
        return self.router.http_url

    @property
    def secret(self) -> ClusterSecret | None:
        """The cluster secret its processes share."""
        return self.workers.internal.secret

    def pids(self) -> list[int]:
        routers = [self.router, *self.extra_routers]
        return [r.process.pid for r in routers] + self.workers.pids()

    def members(self) -> list[WorkerRef]:
        """The workers, in launch order (`tooling.launch.Cluster`)."""
        return [WorkerRef(w.worker_id, w.role, w.address) for w in self.workers.workers]

    def labelled_pids(self) -> dict[str, int]:
        """{"router": pid, <worker id>: pid, ...} now (`tooling.launch.Cluster`)."""
        out = {"router": self.router.process.pid}
        out.update({w.worker_id: w.process.pid for w in self.workers.workers})
        return out

    def effective_config(self) -> dict[str, Any]:
        """The cluster config as JSON-able data (`tooling.launch.Cluster`)."""
        return self.config.model_dump(mode="json")

    def add_router(self, **overrides: object) -> RouterProcess:
        """Another router over the same workers (e.g. a smaller queue), stopped with the
        cluster; no ratio controller unless `ratio=` is given (one controller per cluster)."""
        overrides.setdefault("ratio", RatioConfig())
        rc = self.config.router_config(self.workers.addresses(), port=0, **overrides)
        r = launch_router_process(rc, self.workers.log_dir, cluster_secret=self.secret)
        self.extra_routers.append(r)
        return r

    def stop(self, grace_s: float | None = None) -> None:
        """Routers first (their streams finish within their shutdown grace), then workers;
        `grace_s` overrides how long each group may take before SIGKILL."""
        routers = [r.process for r in (*self.extra_routers, self.router)]
        wait = self.router.config.shutdown_grace_s + 10.0 if grace_s is None else grace_s
        stop_processes(routers, wait)
        self.workers.stop(grace_s)


def launch_local_cluster(
    config: ClusterConfig,
    log_dir: str | Path | None = None,
    timeout_s: float = 120.0,
    client: ClientSecurity | None = None,
    **router_overrides: object,
) -> LocalCluster:
    """Workers (`launch_workers`) and a router process in front of them (port from
    `config.router.port` unless overridden, e.g. `port=0`). `client`: how to dial a TLS
    router (`launch_router_process`)."""
    workers = launch_workers(config, log_dir, timeout_s)
    try:
        rc = config.router_config(workers.addresses(), **router_overrides)
        router = launch_router_process(
            rc, workers.log_dir, name="router-0", cluster_secret=workers.internal.secret,
            client=client,
        )  # fmt: skip
    except BaseException:
        workers.stop(grace_s=2.0)
        raise
    return LocalCluster(config, workers, router)


@contextlib.contextmanager
def local_cluster(config: ClusterConfig, **kwargs: object) -> Iterator[LocalCluster]:
    """`launch_local_cluster` as a context manager that always stops the cluster."""
    cluster = launch_local_cluster(config, **kwargs)  # type: ignore[arg-type]
    try:
        yield cluster
    finally:
        cluster.stop()
