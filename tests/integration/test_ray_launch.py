"""Ray launcher on a real local Ray cluster (`ray.init(num_cpus=2)`): 1 prefill + 1 decode
worker actor on the tiny model, a request through an in-process router gets the colocated
engine's tokens, a killed worker is reported and restarted on its old address, and `stop()`
leaves no actor, process or reserved CPU behind. Also `pdserve up` (Ray launcher, its own
local Ray cluster) as a subprocess: ready line, a request, and SIGTERM ends every process it
started (Ray's included).

Runs in the pytest process (the Ray driver); the workers run in Ray worker processes. The
`pdserve up` test runs first, before this module's own Ray cluster exists.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="ray not installed")

from deploy.client import build_request, stream_generate  # noqa: E402
from deploy.config import ClusterConfig, load_cluster_config  # noqa: E402
from deploy.processes import (  # noqa: E402
    child_env,
    spawn,
    stop_processes,
    wait_for_lines,
    wait_serving,
)
from deploy.ray_launcher import NAMESPACE, RayWorkers, launch_ray_workers  # noqa: E402
from router.app import start_router  # noqa: E402
from security.secret import ClusterSecret  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]


def _children() -> dict[int, list[int]]:
    """ppid -> pids of every process now running (from /proc)."""
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[-1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(entry.name))
    return out


def _descendants(pid: int) -> list[int]:
    children, out, todo = _children(), [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def test_pdserve_up_with_ray_serves_and_stops_everything(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    argv = [sys.executable, "-m", "deploy.cli", "up", "--model", str(tiny_model_dir)]
    argv += ["--mode", "colocated", "--port", "0"]
    secret = ClusterSecret.generate()  # given, so the logs can be searched for it
    t_start = time.time()
    up = spawn("pdserve-up-ray", argv, tmp_path, {**child_env(1), **secret.env()})
    try:
        (m,) = wait_for_lines([up], re.compile(r"^pdserve ready: (\S+:\d+) ", re.M), 120)
        started = _descendants(up.pid)  # Ray's gcs/raylet/workers, the worker actor among them
        assert started
        req = build_request(token_ids=PROMPT, max_tokens=4, temperature=0.0)
        assert len([t for r in stream_generate(m.group(1), req, 30) for t in r.token_ids]) == 4
        up.popen.send_signal(signal.SIGTERM)
        assert up.popen.wait(timeout=60) == 0, up.tail()
        deadline = time.monotonic() + 20
        while left := [p for p in started if not _gone(p)]:
            assert time.monotonic() < deadline, f"still running after pdserve up exited: {left}"
            time.sleep(0.1)
    finally:
        stop_processes([up])
    # The secret went to the actor as a constructor argument: no log of this run holds it (the
    # driver's, with the actors' output forwarded, and every Ray log written since the start).
    logs = [up.log_path, *Path(tempfile.gettempdir(), "ray").glob("session_*/logs/**/*")]
    for path in logs:
        if path.is_file() and path.stat().st_mtime >= t_start:
            with open(path, "rb") as f:
                assert secret.to_text().encode() not in f.read(16 << 20), path


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE)
    try:
        yield
    finally:
        ray.shutdown()


def _config(model_dir: Path, **overrides: object) -> ClusterConfig:
    return load_cluster_config(
        None,
        {
            "model": str(model_dir),
            "mode": "disagg",
            "engine": {"block_size": 16, "num_kv_blocks": 128, "max_num_seqs": 8},
            "ray.cpus_per_worker": 1,
            "ray.max_restarts": 1,
            "router.port": 0,
            "router.status_poll_interval_s": 0.2,
            **overrides,
        },
    )


def _expected(model_dir: Path) -> list[int]:
    from model_runtime.engine import EngineConfig, LLMEngine
    from model_runtime.sampling_params import SamplingParams

    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(num_kv_blocks=64, max_num_seqs=8))
    return list(engine.generate([PROMPT], SamplingParams(max_tokens=8))[0].output_token_ids)


async def _generate_via_router(config: ClusterConfig, workers: RayWorkers) -> list[int]:
    handle = await start_router(
        config.router_config(workers.addresses()), cluster_secret=workers.internal.secret
    )
    try:
        req = build_request(token_ids=PROMPT, max_tokens=8, temperature=0.0)
        # the sync client blocks: run it off the event loop that serves the router
        responses = await asyncio.to_thread(lambda: list(stream_generate(handle.address, req, 30)))
        return [t for r in responses for t in r.token_ids]
    finally:
        await handle.stop()


async def _health_reason(config: ClusterConfig, workers: RayWorkers) -> str:
    """Why a router over `workers` is NOT_SERVING ("" if it serves)."""
    handle = await start_router(
        config.router_config(workers.addresses()), cluster_secret=workers.internal.secret
    )
    try:
        return handle.health_reason
    finally:
        await handle.stop()


def _gone(pid: int) -> bool:
    """No such process, or only a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _named_actor_exists(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def test_ray_workers_serve_restart_and_stop(local_ray: None, tiny_model_dir: Path) -> None:
    config = _config(tiny_model_dir)
    want = _expected(tiny_model_dir)
    workers = launch_ray_workers(config, interval_s=0.3)
    names = [w.actor_name for w in workers.workers]
    try:
        addrs = workers.addresses()
        assert len(addrs["prefill"]) == 1 and len(addrs["decode"]) == 1
        assert asyncio.run(_generate_via_router(config, workers)) == want

        # Kill the decode worker's process: Ray restarts it (max_restarts=1) on the same port.
        decode = next(w for w in workers.workers if w.role == "decode")
        old_pid = decode.pid
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 180  # a deadline, not a duration: waits on the event
        while not any(e.kind == "restarted" for e in workers.events):
            assert time.monotonic() < deadline, f"no restart reported: {workers.events}"
            time.sleep(0.1)
        assert decode.pid != old_pid
        wait_serving(decode.address, timeout_s=120)
        assert asyncio.run(_generate_via_router(config, workers)) == want
        pids = workers.pids()

        # Again: max_restarts=1 is spent, so the worker stays down and the role is reported
        # down (`pdserve up` prints both; the router's health says NOT_SERVING, and why).
        os.kill(decode.pid, signal.SIGKILL)
        deadline = time.monotonic() + 180  # a deadline, not a duration: waits on the event
        while not any(e.kind == "gave_up" for e in workers.events):
            assert time.monotonic() < deadline, f"not given up: {workers.events}"
            time.sleep(0.1)
        gave_up = [e for e in workers.events if e.kind == "gave_up"]
        assert [e.worker_id for e in gave_up] == [decode.worker_id], workers.events
        assert "ray.max_restarts=1" in gave_up[0].detail
        assert [e.kind for e in workers.events if e.worker_id == "decode"][-1] == "role_down"
        assert asyncio.run(_health_reason(config, workers)).startswith("no usable decode worker")
    finally:
        workers.stop()
    deadline = time.monotonic() + 60
    while True:
        actors = [n for n in names if _named_actor_exists(n)]
        procs = [p for p in pids if not _gone(p)]
        cpus = ray.available_resources().get("CPU")
        if not actors and not procs and cpus == 2.0:
            break
        assert time.monotonic() < deadline, f"left behind: {actors}, pids {procs}, CPU {cpus}"
        time.sleep(0.1)


def test_workers_that_cannot_be_placed_fail_at_once(local_ray: None, tiny_model_dir: Path) -> None:
    """3 workers x 1 CPU on this module's 2-CPU cluster: an error naming the fix in well under
    a second, not a wait for `ray.start_timeout_s` (180 s by default)."""
    config = _config(tiny_model_dir, **{"workers.prefill": 2})
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"3 workers .* 2 CPU in all .*lower ray.cpus_per_worker"):
        launch_ray_workers(config)
    assert time.monotonic() - t0 < 10.0
    assert ray.available_resources().get("CPU") == 2.0  # nothing reserved


def test_redis_url_on_rays_gcs_port_fails_at_once(local_ray: None, tiny_model_dir: Path) -> None:
    gcs_port = ray.get_runtime_context().gcs_address.rpartition(":")[2]
    url = f"redis://127.0.0.1:{gcs_port}/0"
    config = _config(tiny_model_dir, **{"router.prefix_index": {"kind": "redis", "url": url}})
    with pytest.raises(ValueError, match=r"is Ray's GCS address .* another port"):
        launch_ray_workers(config)
    assert ray.available_resources().get("CPU") == 2.0
