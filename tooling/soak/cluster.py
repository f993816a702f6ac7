"""The soak's cluster: its own redis-server, the workers started by a product launcher, and the
router in this process. Runs in the soak process, on its event loop.

The cluster is put together the way `pdserve up` does it: cluster-config overrides (here built
from the `SoakConfig`), the launch function the soak is given (`tooling.launch.LaunchWorkers`:
deploy's process or Ray launcher, which supervise and restart the workers), and
`router.app.start_router` with the launch's `router_config` in this process, which lets the
soak read the router's own in-flight counts at the end and where it placed each request
(`placements`, by request id: a tee on the router's request recorder). The router serves its
HTTP front too (port 0). Worker processes are found through the launcher's handle
(`worker_pid`), never by name.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass
from typing import Any

import grpc

from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router.app import RouterHandle, start_router
from router.lifecycle import RequestRecord, RequestRecorder
from router.views import WorkerView
from tooling.launch import LaunchWorkers, WorkerRef, Workers
from tooling.redis_server import RedisServer
from tooling.soak.client import HttpFront
from tooling.soak.config import SoakConfig

log = logging.getLogger(__name__)
CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]


def cluster_settings(config: SoakConfig, redis_url: str) -> dict[str, Any]:
    """The cluster-config overrides a soak runs: tiny-model engine sizes, a Redis prefix index
    with a short TTL, the router's queue bound and default deadline from `config`."""
    n_prefill, n_decode = config.counts
    overrides: dict[str, Any] = {
        "model": str(config.model),
        "mode": "disagg",
        "launcher": "process" if config.launcher == "processes" else "ray",
        "workers.prefill": n_prefill,
        "workers.decode": n_decode,
        "torch_threads": config.torch_threads,
        "engine": {
            "block_size": 16,
            "num_kv_blocks": config.num_kv_blocks,
            "max_num_batched_tokens": 512,
            "max_num_seqs": 64,
        },
        "router.port": 0,
        "router.http_port": 0,  # the hostile HTTP requests (oversized bodies, disconnects)
        "router.max_inflight": config.max_inflight,
        "router.max_queued": config.max_queued,
        "router.default_timeout_s": config.default_timeout_s,
        "router.stall_timeout_s": config.stall_timeout_s,
        "router.status_poll_interval_s": 0.25,
        "router.prefix_index": {
            "kind": "redis",
            "url": redis_url,
            "ttl_s": config.index_ttl_s,
            "heartbeat_s": min(1.0, config.index_ttl_s / 3),
        },
    }
    if config.launcher == "ray":
        total = n_prefill + n_decode
        overrides["ray.cpus_per_worker"] = min(1.0, (os.cpu_count() or 2) / total)
        overrides["ray.max_restarts"] = 1000
    return overrides


def process_start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat field 22); None
    when there is no such process or it is a zombie. Tells a process from a later one that
    reuses its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


@dataclass
class _PlacementTee:
    """The router's request recorder, plus a note of where each request was placed."""

    inner: RequestRecorder | None
    placements: dict[str, tuple[str, ...]]

    def record(self, rec: RequestRecord) -> None:
        if rec.request_id:
            self.placements[rec.request_id] = rec.workers
        if self.inner is not None:
            self.inner.record(rec)


class SoakCluster:
    """Redis + workers (started by `launch`) + in-process router. `start()` then `stop()`
    (idempotent)."""

    def __init__(self, config: SoakConfig, launch: LaunchWorkers) -> None:
        self.config = config
        self.launch = launch
        self.log_dir = config.out / "logs"
        self.redis = RedisServer(config.out / "redis")
        self.workers: Workers | None = None
        self.router: RouterHandle | None = None
        # SIGSTOPped now -> the process's start time (a reused pid never gets our SIGCONT);
        # every one is resumed at stop() whatever happened
        self.stopped: dict[int, int] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}  # the soak's own, for GetStatus
        # request id -> worker addresses the router placed it on (the router's own record)
        self.placements: dict[str, tuple[str, ...]] = {}

    async def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self.redis.start)
        settings = cluster_settings(self.config, self.redis.url)
        self.workers = await asyncio.to_thread(self.launch, settings, self.log_dir)
        self.router = await start_router(
            self.workers.router_config, cluster_secret=self.workers.internal.secret
        )
        lifecycle = self.router.service.lifecycle
        lifecycle.recorder = _PlacementTee(lifecycle.recorder, self.placements)
        await self.wait_routable(60.0)

    @property
    def http_front(self) -> HttpFront:
        """The router's HTTP front and served model (where the hostile HTTP requests go)."""
        assert self.router is not None and self.router.http is not None
        http = self.router.http
        return HttpFront(http.host, http.port, self.router.config.served_model_name)

    @property
    def address(self) -> str:
        assert self.router is not None
        return self.router.address

    async def stop(self) -> None:
        for pid in list(self.stopped):
            self.resume(pid)
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        if self.router is not None:
            await self.router.stop(grace_s=1.0)
            self.router = None
        if self.workers is not None:
            await asyncio.to_thread(self.workers.stop)
            self.workers = None
        if self.redis.proc is not None:
            await asyncio.to_thread(self.redis.stop)

    # -- workers ---------------------------------------------------------------------------

    def refs(self, role: str | None = None) -> list[WorkerRef]:
        """Workers in launch order (prefill first), optionally of one role."""
        assert self.workers is not None
        return [w for w in self.workers.members() if role is None or w.role == role]

    async def worker_pid(self, worker_id: str) -> int | None:
        """The live process id of `worker_id` now (None: no process running)."""
        assert self.workers is not None
        return await asyncio.to_thread(self.workers.live_pid, worker_id)

    async def status(self, address: str, timeout_s: float = 1.0) -> worker_pb2.WorkerStatus | None:
        """`GetStatus` of the worker at `address`; None when it does not answer in time."""
        assert self.workers is not None
        auth = self.workers.internal  # the workers take the cluster secret
        if address not in self._channels:
            self._channels[address] = auth.aio_channel(address, CHANNEL_OPTIONS)
        stub = auth.stub(worker_pb2_grpc.WorkerStub(self._channels[address]))  # type: ignore[no-untyped-call]
        try:
            st: worker_pb2.WorkerStatus = await stub.GetStatus(
                worker_pb2.GetStatusRequest(), timeout=timeout_s
            )
            return st
        except grpc.aio.AioRpcError:
            return None

    def send_signal(self, pid: int, sig: signal.Signals) -> bool:
        """Send `sig` to `pid`; False when the process is gone. A SIGSTOPped process is
        remembered (with its start time) until `resume`."""
        started = process_start_time(pid)
        if started is None:
            return False
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        if sig == signal.SIGSTOP:
            self.stopped[pid] = started
        elif sig == signal.SIGKILL:
            self.stopped.pop(pid, None)
        return True

    def resume(self, pid: int) -> bool:
        """SIGCONT `pid` if this soak stopped it and it is still the same process (same start
        time: the pid was not reused); True when a SIGCONT was sent."""
        started = self.stopped.pop(pid, None)
        if started is None or process_start_time(pid) != started:
            return False
        os.kill(pid, signal.SIGCONT)
        return True

    # -- router ----------------------------------------------------------------------------

    def router_in_flight(self) -> dict[str, int]:
        """The router's own counts: admitted-and-running, queued, and per-worker in flight."""
        assert self.router is not None
        adm = self.router.service.admission
        views = self.router.pool.views()
        return {
            "running": adm.running,
            "queued": adm.queued,
            "worker_in_flight": sum(v.in_flight for v in views),
        }

    def router_views(self) -> dict[str, WorkerView]:
        """The router's view of each worker, by address."""
        assert self.router is not None
        return {v.address: v for v in self.router.pool.views()}

    async def wait_routable(self, timeout_s: float) -> None:
        """Until the router sees a healthy worker of every role (TimeoutError after)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while True:
            views = self.router_views().values()
            if {"prefill", "decode"} <= {v.role for v in views if v.healthy}:
                return
            if loop.time() > end:
                raise TimeoutError(f"router not routable after {timeout_s:.0f} s: {list(views)}")
            await asyncio.sleep(0.1)
