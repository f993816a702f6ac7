"""deploy's launchers in the shapes tooling takes as parameters (`tooling.launch`).

Runs in the process that drives a benchmark, calibration or soak (`pdserve bench / profile /
soak`, tests, `benchmarks/`). Each function validates dotted cluster-config overrides with
`load_cluster_config` and starts processes with `deploy.launcher` (or Ray actors with
`deploy.ray_launcher` when `launcher = "ray"`, through `deploy.launchers`); tooling calls them
without importing deploy.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deploy.config import load_cluster_config
from deploy.launcher import LocalCluster, launch_local_cluster
from deploy.launchers import launcher_for
from tooling.launch import Workers


def launch_cluster(overrides: Mapping[str, Any], log_dir: Path) -> LocalCluster:
    """`tooling.launch.LaunchCluster`: workers and a router as local processes (router port
    0 unless `router.port` is set), serving on return."""
    config = load_cluster_config(None, dict(overrides))
    log_dir.mkdir(parents=True, exist_ok=True)
    return launch_local_cluster(config, log_dir)


def launch_workers(overrides: Mapping[str, Any], log_dir: Path) -> Workers:
    """`tooling.launch.LaunchWorkers`: supervised workers (processes, or Ray actors when
    `launcher = "ray"`: `deploy.launchers.launcher_for`), serving on return; their
    `router_config` is that of a router over them."""
    config = load_cluster_config(None, dict(overrides))
    log_dir.mkdir(parents=True, exist_ok=True)
    return launcher_for(config).launch(config, log_dir=log_dir)
