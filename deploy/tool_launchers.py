"""deploy's launchers in the shapes tooling takes as parameters (`tooling.launch`).

Runs in the process that drives a benchmark, calibration or soak (`pdserve bench / profile /
soak`, tests, `benchmarks/`). Each function validates dotted cluster-config overrides with
`load_cluster_config` and starts processes with `deploy.launcher` (or Ray actors with
`deploy.ray_launcher` when `launcher = "ray"`); tooling calls them without importing deploy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deploy.config import load_cluster_config
from deploy.launcher import LocalCluster, ProcessWorkers, launch_local_cluster
from deploy.launcher import launch_workers as launch_process_workers
from router.config import RouterConfig
from security.channels import InternalAuth
from tooling.launch import WorkerRef

if TYPE_CHECKING:  # imports Ray; loaded only when a Ray launch is asked for
    from deploy.ray_launcher import RayWorkers


def launch_cluster(overrides: Mapping[str, Any], log_dir: Path) -> LocalCluster:
    """`tooling.launch.LaunchCluster`: workers and a router as local processes (router port
    0 unless `router.port` is set), serving on return."""
    config = load_cluster_config(None, dict(overrides))
    log_dir.mkdir(parents=True, exist_ok=True)
    return launch_local_cluster(config, log_dir)


@dataclass
class LaunchedWorkers:
    """`tooling.launch.Workers` over a process or Ray launch, with its router's config."""

    workers: ProcessWorkers | RayWorkers
    router_config: RouterConfig

    @property
    def internal(self) -> InternalAuth:
        return self.workers.internal

    def members(self) -> list[WorkerRef]:
        return self.workers.members()

    def live_pid(self, worker_id: str) -> int | None:
        return self.workers.live_pid(worker_id)

    def stop(self) -> None:
        self.workers.stop()


def launch_workers(overrides: Mapping[str, Any], log_dir: Path) -> LaunchedWorkers:
    """`tooling.launch.LaunchWorkers`: supervised workers (processes, or Ray actors when
    `launcher = "ray"`), serving on return, and the config of a router over them."""
    config = load_cluster_config(None, dict(overrides))
    log_dir.mkdir(parents=True, exist_ok=True)
    workers: ProcessWorkers | RayWorkers
    if config.launcher == "process":
        workers = launch_process_workers(config, log_dir)
    else:
        from deploy.ray_launcher import launch_ray_workers

        workers = launch_ray_workers(config)
    return LaunchedWorkers(workers, config.router_config(workers.addresses()))
