"""The launcher seam: one protocol for starting a cluster's workers, two implementations.

Runs in the launching process (`pdserve up`, `deploy.tool_launchers`, tests).

    launcher = launcher_for(config)          # by `config.launcher`: "process" or "ray"
    workers = launcher.launch(config, log_dir=..., on_event=..., cluster_secret=...)
    workers.router_config                    # a router in front of them (tooling.launch.Workers)
    workers.stop()

`WorkerLauncher.launch` takes a validated `ClusterConfig`, starts every worker with its whole
`WorkerConfig` as one JSON document (`ClusterConfig.worker_config`), and returns once each one
serves; the handle it returns is a `tooling.launch.Workers` (the protocol tooling types
against, since tooling never imports deploy). Implementations: `deploy.launcher.ProcessLauncher`
(local subprocesses, restarted by `ProcessSupervisor`) and `deploy.ray_launcher.RayLauncher`
(Ray actors in a placement group; its module imports Ray, loaded only when asked for).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from deploy.config import ClusterConfig
from deploy.launcher import ProcessLauncher
from deploy.supervision import SupervisionEvent
from security.secret import ClusterSecret
from tooling.launch import Workers


class WorkerLauncher(Protocol):
    """Starts the workers of one cluster and hands back a `tooling.launch.Workers`."""

    def launch(
        self,
        config: ClusterConfig,
        *,
        log_dir: Path | None = None,
        on_event: Callable[[SupervisionEvent], None] | None = None,
        cluster_secret: ClusterSecret | None = None,
    ) -> Workers:
        """Start every worker of `config` and return once each one serves. `log_dir`: where
        the process launcher keeps logs and config documents (None: a fresh temporary
        folder; Ray keeps its own). `on_event`: told of each supervision event (deaths,
        restarts, roles down/up). `cluster_secret` None: `security.cluster_secret_file`, else
        ``PDSERVE_CLUSTER_SECRET``, else a fresh one. On failure everything started is
        stopped and the error propagates: RuntimeError / TimeoutError (did not start) or
        ValueError (bad model folder, security file or placement)."""
        ...


def launcher_for(config: ClusterConfig) -> WorkerLauncher:
    """The launcher `config.launcher` names ("process" or "ray")."""
    if config.launcher == "process":
        return ProcessLauncher()
    from deploy.ray_launcher import RayLauncher

    return RayLauncher()
