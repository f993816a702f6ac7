"""Ray launcher: a cluster's workers as Ray actors in one placement group.

Runs in the launching process (`pdserve up`, the Ray integration test); each worker actor runs
in its own Ray worker process. Ray only places, starts and supervises the workers: requests
and tokens flow router -> worker over gRPC and KV flows worker -> worker over
torch.distributed, never through Ray.

    workers = launch_ray_workers(config)   # blocks until every worker answers SERVING
    workers.addresses()                    # {"prefill": [...], "decode": [...], ...}
    workers.events                         # supervision log: died / restarted / restarting
    workers.stop()                         # kill the actors, remove the placement group and
                                           # shut Ray down if this call started it

Steps of `launch_ray_workers`:

1. join Ray: keep an already initialised Ray (the caller owns it), else `ray.init` — a new
   local cluster when `ray.address` is empty, sized for every worker's bundle (we shut it down
   in `stop()`), else the external one (`stop()` only disconnects);
   then fail at once, naming the fix, if the bundles can never be placed on it or the Redis URL
   is its GCS port (`deploy.preflight`);
2. reserve one bundle per worker ({"CPU": cpus_per_worker, "GPU": gpus_per_worker}) in a
   placement group: PACK on a one-node cluster, SPREAD on several (or `ray.placement_strategy`);
3. start one `WorkerActor` per bundle; its constructor starts a `WorkerServer` (model load,
   gRPC server) and returns once it serves;
4. check each address with grpc.health.v1 from this process;
5. start the supervisor thread, which pings every actor each `interval_s` and records deaths
   and restarts. A restarted actor (Ray's `max_restarts`) rebinds the same port on the same
   node (the port is kept in a file on that node), so the router's address list stays valid.

The cluster secret reaches each actor as a constructor argument (kept by Ray for restarts,
never printed, not in the runtime env, which Ray shows in its state API and dashboard).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deploy.config import ClusterConfig, check_model_dir
from deploy.preflight import local_cluster_cpus, placement_problem, redis_ray_collision
from deploy.processes import wait_serving
from deploy.supervision import EventLog, SupervisionEvent
from proto.pdserve.v1.roles import Role
from router.config import RouterConfig
from security.channels import InternalAuth
from security.secret import ClusterSecret, resolve_cluster_secret
from tooling.launch import WorkerRef
from worker.config import thread_env

log = logging.getLogger(__name__)

NAMESPACE = "pdserve"


@ray.remote
class WorkerActor:
    """Thin Ray wrapper over `worker.server.WorkerServer` (the plain class, tested without
    Ray). The constructor starts the server, so a Ray restart restarts the worker.

    `worker_config_json` is the worker's whole `WorkerConfig` as JSON (the document
    `ClusterConfig.worker_config` gives, as the process launcher's ``--config`` file holds);
    its host "auto" becomes this node's IP.
    `port_file` (on this node) remembers the bound port across restarts of this actor.
    `cluster_secret` is the cluster secret's hex form (None: an unauthenticated worker)."""

    def __init__(
        self, worker_config_json: str, port_file: str, cluster_secret: str | None = None
    ) -> None:
        from worker.config import WorkerConfig
        from worker_main import server as worker_server

        secret = (
            None if cluster_secret is None else ClusterSecret.from_text(cluster_secret, "actor")
        )
        config = WorkerConfig.model_validate_json(worker_config_json)
        update: dict[str, Any] = {}
        if config.host == "auto":
            update["host"] = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        if getattr(config, "kv_host", None) == "auto":
            update["kv_host"] = update.get("host", config.host)
        if config.node == "auto":  # the node label the router pairs by: Ray's node id
            update["node"] = ray.get_runtime_context().get_node_id()
        path = Path(port_file)
        if path.is_file():  # a restart: take the port the router already knows
            update["port"] = int(path.read_text())
        self._server = worker_server(config.model_copy(update=update), secret)
        self._address = self._server.start()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self._address.rpartition(":")[2])

    def address(self) -> str:
        """host:port of the worker's gRPC server."""
        return self._address

    def pid(self) -> int:
        """The actor's process id (changes when Ray restarts it)."""
        return os.getpid()

    def node(self) -> str:
        """The node label this worker reports (Ray's node id)."""
        return self._server.config.node

    def kv_shared_memory_peers(self) -> list[str]:
        """Receivers this worker now sends KV to through shared memory (the rest: gloo bytes)."""
        return self._server.kv_shared_memory_peers()

    def stop(self, grace_s: float) -> None:
        """Stop the gRPC server, giving in-flight calls `grace_s`."""
        self._server.stop(grace_s)


@dataclass
class RayWorker:
    """One worker actor: id, role at launch, address, the actor (named `actor_name` in the
    "pdserve" namespace) and its last pid."""

    worker_id: str
    role: Role
    address: str
    actor: Any
    actor_name: str
    pid: int
    alive: bool = True
    restarting: bool = False


class RayWorkers:
    """`tooling.launch.Workers` as Ray actors: handle to launched worker actors; `stop()` is
    idempotent. `events` (the shared
    `deploy.supervision` vocabulary) says which workers died, restarted or were given up once
    Ray's `max_restarts` were spent, and which roles have no live worker left."""

    def __init__(
        self,
        workers: list[RayWorker],
        pg: PlacementGroup,
        owns_ray: bool,
        interval_s: float,
        config: ClusterConfig,
        on_event: Callable[[SupervisionEvent], None] | None = None,
        internal: InternalAuth | None = None,
    ) -> None:
        self.workers = workers
        self.config = config
        self.internal = internal or InternalAuth()
        self.placement_group = pg
        self.owns_ray = owns_ray
        self.max_restarts = config.ray.max_restarts
        self.drain_timeout_s = config.worker.stop_grace_s
        self._log = EventLog((w.role for w in workers), on_event)
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._supervise, args=(interval_s,), name="pdserve-supervisor", daemon=True
        )
        self._thread.start()

    def addresses(self) -> dict[str, list[str]]:
        """role -> worker addresses, as launched."""
        out: dict[str, list[str]] = {"prefill": [], "decode": [], "colocated": []}
        for w in self.workers:
            out[w.role].append(w.address)
        return out

    def pids(self) -> list[int]:
        """The actors' last known pids."""
        return [w.pid for w in self.workers]

    @property
    def router_config(self) -> RouterConfig:
        """The config of a router in front of these workers (`tooling.launch.Workers`)."""
        return self.config.router_config(self.addresses())

    def members(self) -> list[WorkerRef]:
        """The workers, in launch order (`tooling.launch.Workers`)."""
        return [WorkerRef(w.worker_id, w.role, w.address) for w in self.workers]

    def live_pid(self, worker_id: str) -> int | None:
        """The pid running `worker_id` now, asked of its actor (2 s); when it cannot answer
        (restarting, or SIGSTOPped), the supervisor's last pid if that process still runs."""
        w = next(w for w in self.workers if w.worker_id == worker_id)
        try:
            return int(ray.get(w.actor.pid.remote(), timeout=2.0))
        except (GetTimeoutError, ActorUnavailableError, RayActorError) as exc:
            log.info("pid of %s: no answer (%s); the supervisor's last pid", worker_id, exc)
        return w.pid if _running(w.pid) else None

    @property
    def events(self) -> list[SupervisionEvent]:
        """Deaths, restarts, given-up workers and role changes seen so far."""
        return self._log.events

    def _event(self, w: RayWorker, kind: str, detail: str) -> None:
        self._log.record(w.worker_id, kind, f"{detail} ({w.address})")

    def _supervise(self, interval_s: float) -> None:
        """Ping each actor every `interval_s`; record deaths, restarts (pid changes), actors
        out of restarts, and roles left without a live worker."""
        while not self._stopped.wait(interval_s):
            for w in self.workers:
                if not w.alive or self._stopped.is_set():
                    continue
                self._ping(w, interval_s)
            live: dict[str, int] = {}
            for w in self.workers:
                live[w.role] = live.get(w.role, 0) + int(w.alive and not w.restarting)
            if not self._stopped.is_set():
                self._log.roles_now(live)

    def _ping(self, w: RayWorker, interval_s: float) -> None:
        ref = w.actor.pid.remote()
        try:
            pid = ray.get(ref, timeout=max(5.0, interval_s))
        except GetTimeoutError:
            if not w.restarting:
                self._event(w, "restarting", "no answer to a ping (restarting or stuck)")
            w.restarting = True
            return
        except ActorUnavailableError as exc:  # Ray is restarting it
            if not w.restarting:
                self._event(w, "died", f"pid {w.pid}: {str(exc).splitlines()[0]}")
                self._event(w, "restarting", "Ray restarts the actor")
            w.restarting = True
            return
        except RayActorError as exc:
            if self._stopped.is_set():
                return
            w.alive = False
            if not w.restarting:  # else its death was recorded when Ray began restarting it
                self._event(w, "died", f"pid {w.pid}: {str(exc).splitlines()[0]}")
            self._event(
                w,
                "gave_up",
                f"ray.max_restarts={self.max_restarts} spent; Ray will not restart it and it "
                "stays down",
            )
            return
        w.restarting = False
        if pid != w.pid:
            self._event(w, "restarted", f"pid {w.pid} -> {pid}")
            w.pid = pid

    def stop(self, grace_s: float | None = None) -> None:
        """Stop every worker (graceful: each drains for `grace_s`, default `worker.stop_grace_s`;
        then `ray.kill`), remove the placement group, and shut Ray down if
        `launch_ray_workers` started or joined it (an external cluster lives on)."""
        if grace_s is None:
            grace_s = self.drain_timeout_s
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._thread.join(timeout=grace_s + 10.0)
        if not ray.is_initialized():
            return
        refs = [w.actor.stop.remote(grace_s) for w in self.workers if w.alive]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=grace_s + 5.0)
        for ref in done:
            try:
                ray.get(ref)
            except RayActorError as exc:
                log.info("actor already gone at stop: %s", str(exc).splitlines()[0])
        for w in self.workers:
            ray.kill(w.actor, no_restart=True)
        remove_placement_group(self.placement_group)
        if self.owns_ray:
            ray.shutdown()


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (/proc/<pid>/stat's state field)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def interleave_roles(roles: list[tuple[str, Role]]) -> list[tuple[str, Role]]:
    """Workers one of each role in turn (prefill, decode, prefill, ...): any contiguous run of
    them holds both roles once it is long enough (see `bundles_by_node`)."""
    by_role: dict[str, list[tuple[str, Role]]] = {}
    for wid, role in roles:
        by_role.setdefault(role, []).append((wid, role))
    out: list[tuple[str, Role]] = []
    while any(by_role.values()):
        for queue in by_role.values():
            if queue:
                out.append(queue.pop(0))
    return out


def bundles_by_node(bundle_nodes: list[str]) -> list[int]:
    """Bundle indices grouped by the node each was placed on (nodes in order of their first
    bundle, bundles in index order). Worker k of `interleave_roles` goes to bundle
    `bundles_by_node(...)[k]`, so each node gets a contiguous run of the interleaved roles —
    a prefill and a decode worker on every node with two or more bundles, whichever way Ray
    dealt the bundles — and prefill/decode pairs can stay on one node."""
    rank: dict[str, int] = {}
    for node in bundle_nodes:
        rank.setdefault(node, len(rank))
    return sorted(range(len(bundle_nodes)), key=lambda i: (rank[bundle_nodes[i]], i))


def _bundle_nodes(pg: PlacementGroup, n: int) -> list[str]:
    """The node id of each of `pg`'s `n` bundles ("" where Ray does not say)."""
    table = placement_group_table(pg).get("bundles_to_node_id", {})
    return [str(table.get(i, "")) for i in range(n)]


def _join_ray(config: ClusterConfig) -> bool:
    """Initialise Ray unless it already is; True when this call did it. A local cluster gets
    enough CPUs for every worker's bundle (`preflight.local_cluster_cpus`), said in one line."""
    if ray.is_initialized():
        return False
    r = config.ray
    if r.address:
        ray.init(address=r.address, namespace=NAMESPACE, log_to_driver=True)
        return True
    cpus, note = local_cluster_cpus(
        config.num_workers, r.cpus_per_worker, r.num_cpus, os.cpu_count() or 1
    )
    if note:
        log.info("%s", note)
    ray.init(num_cpus=cpus, namespace=NAMESPACE, include_dashboard=False, log_to_driver=True)
    return True


def _ray_client_mode() -> bool:
    """True when this process talks to Ray through Ray Client (`ray.address` 'ray://...')."""
    return bool(ray.util.client.ray.is_connected())  # type: ignore[no-untyped-call]


def _preflight(config: ClusterConfig, bundle: dict[str, float]) -> None:
    """Fail at once, naming the fix, when the workers can never be placed on this cluster or
    the Redis URL is Ray's own GCS port (ValueError)."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
    problem = placement_problem(bundle, config.num_workers, nodes)
    index = config.router.prefix_index
    url = getattr(index, "url", None)
    # A Ray Client connection (ray://) has no GCS address here, and no local Redis to confuse.
    if problem is None and isinstance(url, str) and not _ray_client_mode():
        gcs = ray.get_runtime_context().gcs_address
        here = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        problem = redis_ray_collision(url, gcs, here)
    if problem:
        raise ValueError(problem)


def _available() -> dict[str, float]:
    return dict(ray.available_resources())  # type: ignore[no-untyped-call]


def _strategy(config: ClusterConfig) -> str:
    if config.ray.placement_strategy != "auto":
        return config.ray.placement_strategy
    nodes = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
    return "PACK" if len(nodes) <= 1 else "SPREAD"


def launch_ray_workers(
    config: ClusterConfig,
    interval_s: float = 1.0,
    on_event: Callable[[SupervisionEvent], None] | None = None,
    cluster_secret: ClusterSecret | None = None,
) -> RayWorkers:
    """Start the workers of `config` as Ray actors (see the module docstring for the steps)
    and return once each one serves. `cluster_secret` None: `security.cluster_secret_file`,
    else ``PDSERVE_CLUSTER_SECRET``, else a fresh one. On failure everything started here is
    torn down and the error propagates: TimeoutError (no placement / not serving in
    `ray.start_timeout_s`), RuntimeError (an actor died while starting), ValueError (bad model
    folder or security file, workers that can never be placed, a Redis URL on Ray's GCS
    port)."""
    check_model_dir(config)
    config.security.check_files()
    secret = cluster_secret or resolve_cluster_secret(
        config.security.cluster_secret_file, generate=True
    )
    assert secret is not None, "generate=True always gives a secret"
    internal = InternalAuth(secret, config.security.internal)
    owns_ray = _join_ray(config)
    host = config.worker_host
    if host == "auto" and not config.ray.address:  # a local cluster: one node
        host = "127.0.0.1"
    r = config.ray
    bundle: dict[str, float] = {"CPU": r.cpus_per_worker}
    if r.gpus_per_worker:
        bundle["GPU"] = r.gpus_per_worker
    roles = interleave_roles(config.worker_roles())
    try:
        _preflight(config, bundle)
    except ValueError:
        if owns_ray:
            ray.shutdown()
        raise
    pg = placement_group([dict(bundle) for _ in roles], strategy=_strategy(config))
    actors: list[Any] = []
    try:
        try:
            ray.get(pg.ready(), timeout=r.start_timeout_s)
        except GetTimeoutError:
            raise TimeoutError(
                f"Ray could not place {len(roles)} workers x {bundle} in "
                f"{r.start_timeout_s:.0f} s; available: {_available()} (lower "
                f"ray.cpus_per_worker / ray.gpus_per_worker or the worker counts)"
            ) from None
        bundle_of = bundles_by_node(_bundle_nodes(pg, len(roles)))
        cluster_id = uuid.uuid4().hex[:8]
        port_dir = Path(tempfile.gettempdir()) / "pdserve-ports" / cluster_id
        for i, (worker_id, role) in enumerate(roles):
            wc = config.worker_config(worker_id, role, host, node="auto")
            env = thread_env(wc)  # OpenMP and MKL pools, as the process launcher sizes them
            actor = WorkerActor.options(  # type: ignore[attr-defined]
                name=f"{cluster_id}-{worker_id}",
                namespace=NAMESPACE,
                num_cpus=r.cpus_per_worker,
                num_gpus=r.gpus_per_worker,
                max_restarts=r.max_restarts,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=bundle_of[i]
                ),
                runtime_env={"env_vars": env},
            ).remote(
                wc.model_dump_json(),
                str(port_dir / worker_id),
                secret.to_text(),
            )
            actors.append(actor)
        try:
            addrs = ray.get([a.address.remote() for a in actors], timeout=r.start_timeout_s)
            pids = ray.get([a.pid.remote() for a in actors], timeout=30.0)
        except GetTimeoutError:
            raise TimeoutError(f"workers not started after {r.start_timeout_s:.0f} s") from None
        except RayActorError as exc:
            raise RuntimeError(f"a worker actor died while starting: {exc}") from exc
        for a in addrs:
            wait_serving(a, timeout_s=30.0, open_channel=internal.channel)
    except BaseException:
        for a in actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(pg)
        if owns_ray:
            ray.shutdown()
        raise
    workers = [
        RayWorker(wid, role, addr, actor, f"{cluster_id}-{wid}", pid)
        for (wid, role), addr, actor, pid in zip(roles, addrs, actors, pids, strict=True)
    ]
    log.info("ray workers ready: %s", {w.worker_id: f"{w.address} pid {w.pid}" for w in workers})
    return RayWorkers(workers, pg, owns_ray, interval_s, config, on_event, internal)


class RayLauncher:
    """`deploy.launchers.WorkerLauncher` with Ray actors (`launch_ray_workers`); `log_dir` is
    unused (Ray keeps the actors' logs)."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s

    def launch(
        self,
        config: ClusterConfig,
        *,
        log_dir: Path | None = None,
        on_event: Callable[[SupervisionEvent], None] | None = None,
        cluster_secret: ClusterSecret | None = None,
    ) -> RayWorkers:
        """Start the workers of `config` as Ray actors; serving on return."""
        return launch_ray_workers(config, self.interval_s, on_event, cluster_secret)
