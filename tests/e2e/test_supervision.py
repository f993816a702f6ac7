"""The process launcher supervises its workers (issue 20, defect 6): a SIGKILLed worker is
reaped (no zombie), its death is logged with the signal, it is restarted on its old address
(new pid, new epoch) and the router serves through it again; once its restarts in a row are
spent it stays down, the role is reported down, and the router says NOT_SERVING and answers
UNAVAILABLE naming the missing role and why.

Runs in the pytest process; one 1P+1D cluster of real processes, stopped by PID at the end.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.client import CHANNEL_OPTIONS
from deploy.launcher import LocalCluster, launch_local_cluster
from deploy.processes import wait_serving
from tests.e2e.helpers import PROMPTS, E2ECluster, Reference, cluster_config, pid_alive, wait_until

pytestmark = pytest.mark.slow


def _kinds(local: LocalCluster, worker_id: str) -> list[str]:
    return [e.kind for e in local.workers.events if e.worker_id == worker_id]


def test_killed_worker_is_reaped_restarted_and_given_up_after_its_restarts(
    tiny_model_dir: Path, tmp_path: Path, reference: Reference
) -> None:
    restarts = {"max_restarts": 1, "backoff_s": 0.2, "stable_s": 600.0}
    overrides: dict[str, object] = {f"supervision.{k}": v for k, v in restarts.items()}
    config = cluster_config(tiny_model_dir, "disagg", overrides, prefill=1, decode=1)
    local = launch_local_cluster(config, tmp_path, port=0)
    channel = grpc.insecure_channel(local.address, CHANNEL_OPTIONS)
    pids = local.pids()
    try:
        cluster = E2ECluster("supervision", local, channel)
        cluster.baseline = cluster.free_blocks()
        d = next(w for w in local.workers.workers if w.role == "decode")
        old_pid, address, epoch = d.process.pid, d.address, cluster.status(d.address).epoch

        os.kill(old_pid, signal.SIGKILL)
        wait_until(lambda: "restarted" in _kinds(local, d.worker_id), 90.0, "a restart")
        assert not pid_alive(old_pid), "the dead worker was not reaped (zombie)"
        died = next(e for e in local.workers.events if e.kind == "died")
        assert died.worker_id == d.worker_id and "SIGKILL" in died.detail, died
        assert d.process.pid != old_pid and d.address == address
        assert cluster.status(address).epoch != epoch
        pids.append(d.process.pid)
        wait_serving(local.address, timeout_s=10.0)
        p = PROMPTS[5]
        reference.check({p.name: cluster.generate(p.request())[0]})
        cluster.wait_no_leaks()

        os.kill(d.process.pid, signal.SIGKILL)  # again, within stable_s: restarts spent
        wait_until(lambda: "gave_up" in _kinds(local, d.worker_id), 30.0, "given up")
        wait_until(lambda: "role_down" in _kinds(local, "decode"), 5.0, "decode role down")
        health = health_pb2_grpc.HealthStub(channel)
        wait_until(
            lambda: (
                health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                == health_pb2.HealthCheckResponse.NOT_SERVING
            ),
            10.0,
            "router NOT_SERVING",
        )
        with pytest.raises(grpc.RpcError) as err:
            cluster.generate(p.request())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        details = err.value.details()  # type: ignore[attr-defined]
        # the client reads what failed and its request id, never a worker address (issue 26)
        assert "no healthy decode worker" in details and "(request " in details, details
        assert address not in details, details
        assert not pid_alive(d.process.pid)
    finally:
        channel.close()
        local.stop()
    assert not [p for p in pids if pid_alive(p)]
