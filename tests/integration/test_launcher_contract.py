"""The launcher seam's contract (`deploy.launchers.WorkerLauncher` -> `tooling.launch.Workers`),
run against the process launcher and the Ray launcher alike: a real 1 prefill + 1 decode
cluster of the tiny model.

Each launcher starts exactly the workers the config names, each with its whole config document
(the engine sizing it reports is the config's), hands back how to call them and a router
config over their addresses that an in-process router routes with, and stops every process.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from pathlib import Path

import pytest

from deploy.config import ClusterConfig, load_cluster_config
from deploy.launcher import ProcessLauncher
from deploy.launchers import launcher_for
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router.app import has_usable_route, start_router
from tooling.launch import Workers

pytestmark = pytest.mark.slow

HAS_RAY = importlib.util.find_spec("ray") is not None
LAUNCHERS = [
    "process",
    pytest.param("ray", marks=pytest.mark.skipif(not HAS_RAY, reason="ray not installed")),
]


def _config(model_dir: Path, launcher: str) -> ClusterConfig:
    return load_cluster_config(
        None,
        {
            "model": str(model_dir),
            "launcher": launcher,
            "engine": {"block_size": 8, "num_kv_blocks": 96, "max_num_seqs": 4},
            "ray.cpus_per_worker": 1,
            "ray.num_cpus": 2,
            "router.port": 0,
            "router.status_poll_interval_s": 0.2,
            "worker.stop_grace_s": 2.0,
        },
    )


def _status(workers: Workers, address: str) -> worker_pb2.WorkerStatus:
    with workers.internal.channel(address, []) as channel:
        stub = workers.internal.stub(worker_pb2_grpc.WorkerStub(channel))  # type: ignore[no-untyped-call]
        status: worker_pb2.WorkerStatus = stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
        return status


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


async def _routable(workers: Workers) -> bool:
    handle = await start_router(workers.router_config, cluster_secret=workers.internal.secret)
    try:
        await handle.pool.poll_once()
        return has_usable_route(workers.router_config.mode, handle.pool.views())
    finally:
        await handle.stop()


@pytest.mark.parametrize("kind", LAUNCHERS)
def test_a_launcher_starts_serves_and_stops_the_configured_workers(
    kind: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = _config(tiny_model_dir, kind)
    launcher = launcher_for(config)
    assert isinstance(launcher, ProcessLauncher) == (kind == "process")
    workers = launcher.launch(config, log_dir=tmp_path)
    try:
        members = workers.members()
        assert sorted((m.worker_id, m.role) for m in members) == sorted(config.worker_roles())
        by_role = {role: sorted(a) for role, a in workers.addresses().items() if a}
        assert by_role == {
            role: sorted(m.address for m in members if m.role == role)
            for role in {m.role for m in members}
        }
        assert workers.router_config == config.router_config(workers.addresses())
        for m in members:  # each worker got its document: identity and engine sizing
            st = _status(workers, m.address)
            assert (st.worker_id, st.role) == (m.worker_id, m.role)
            assert (st.block_size, st.total_blocks) == (8, 96)
        pids = workers.pids()
        assert sorted(workers.live_pid(m.worker_id) or 0 for m in members) == sorted(pids)
        assert asyncio.run(_routable(workers))
    finally:
        workers.stop()
    workers.stop()  # idempotent
    deadline = time.monotonic() + 30
    while left := [p for p in pids if _running(p)]:
        assert time.monotonic() < deadline, f"still running after stop: {left}"
        time.sleep(0.1)
