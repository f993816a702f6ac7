"""End-to-end fixtures: real router and worker processes on 127.0.0.1, the tiny model.

Runs in the pytest process. Clusters are started with `deploy.launcher` (one
`python -m worker_main` per worker, one `python -m router`), shared per test module through
`start_cluster`, and stopped by PID in teardown, which checks that no process is left.
Readiness is each process's READY line plus a grpc.health.v1 check, never a sleep. Helpers
(prompt set, reference tokens, `E2ECluster`) are in helpers.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from deploy.client import CHANNEL_OPTIONS
from deploy.launcher import launch_local_cluster
from tests.e2e.helpers import E2ECluster, Reference, cluster_config, pid_alive


@pytest.fixture(scope="session")
def reference(tiny_model_dir: Path) -> Reference:
    return Reference(tiny_model_dir)


@pytest.fixture(scope="session")
def start_cluster(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Iterator[E2ECluster]]:
    """`start_cluster(name, mode, prefill=.., decode=.., colocated=.., overrides={...})`: a
    generator that yields one running `E2ECluster` and stops every process it started when
    closed. Module fixtures `yield from` it."""

    def start(
        name: str, mode: str, overrides: dict[str, object] | None = None, **counts: int
    ) -> Iterator[E2ECluster]:
        config = cluster_config(tiny_model_dir, mode, overrides, **counts)
        local = launch_local_cluster(config, tmp_path_factory.mktemp(f"logs-{name}"), port=0)
        channel = grpc.insecure_channel(local.address, CHANNEL_OPTIONS)
        cluster = E2ECluster(name, local, channel)
        try:
            cluster.baseline = cluster.free_blocks()
            yield cluster
        finally:
            channel.close()
            pids = local.pids()
            local.stop()
            alive = [p for p in pids if pid_alive(p)]
            assert not alive, f"processes still running after stop(): {alive}"

    return start
