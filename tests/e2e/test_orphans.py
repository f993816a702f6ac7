"""A launcher's workers do not outlive it: SIGKILL of `pdserve up` (no chance to stop its
children) while a stream is open, and every worker process leaves on its own
(`worker.parent_watch` without Ray; with Ray, Ray's own fate-sharing of the local cluster it
started and its actors). By design that takes about 3 s (`worker.cli.ORPHAN_GRACE_S` plus its
`THREAD_EXIT_WAIT_S`); the bound is wider so that a loaded or slow machine does not fail it:
what the test catches is a worker that stays.

Runs in the pytest process; whatever survives is killed by PID in teardown.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
from pathlib import Path

import pytest

from deploy.client import build_request, stream_generate
from deploy.processes import child_env, spawn, stop_processes, wait_for_lines
from tests.e2e.helpers import pid_alive, wait_until

pytestmark = pytest.mark.slow
READY = re.compile(r"^pdserve ready: (\S+:\d+) \((\w+), (.*)\)(?: http (\S+))?$", re.M)
STARTED = re.compile(r"started (worker-\S+) \(pid (\d+)\)")
GONE_WITHIN_S = 30.0


def _kill_by_pid(pids: list[int]) -> None:
    for pid in pids:
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _still_alive(workers: list[int], log_dir: Path) -> str:
    """The failure message: which workers stayed, and the end of every worker's log (whether
    it saw its launcher go, and how far its stop got)."""
    tails = [f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(log_dir.glob("*.log"))]
    return f"workers still alive: {[p for p in workers if pid_alive(p)]}\n" + "\n".join(tails)


def _open_stream(address: str) -> threading.Thread:
    """A long stream, open while the launcher dies (its end does not matter here)."""
    req = build_request(token_ids=list(range(10, 26)), max_tokens=900, ignore_eos=True)

    def run() -> None:
        with contextlib.suppress(Exception):
            for _ in stream_generate(address, req, timeout=60):
                pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_workers_exit_when_pdserve_up_no_ray_is_killed(
    tiny_model_dir: Path, tmp_path: Path, stopped: bool
) -> None:
    """`stopped`: both workers are SIGSTOPped (state T: no handler, no thread runs) when the
    launcher is SIGKILLed; the parent-death signal continues them and they leave as well
    (issue 39: they stayed in state T, holding their ports and memory)."""
    argv = [sys.executable, "-m", "deploy.cli", "up", "--no-ray", "--model", str(tiny_model_dir)]
    argv += ["--mode", "disagg", "--prefill", "1", "--decode", "1", "--port", "0"]
    log_dir = tmp_path / "workers"
    argv += ["--log-dir", str(log_dir)]
    up = spawn("pdserve-up", argv, tmp_path, child_env(1))
    workers: list[int] = []
    try:
        (m,) = wait_for_lines([up], READY, timeout_s=120)
        workers = [int(pid) for _, pid in STARTED.findall(up.log_text())]
        assert len(workers) == 2 and all(pid_alive(p) for p in workers), up.tail()
        _open_stream(m.group(1))
        if stopped:
            for pid in workers:
                os.kill(pid, signal.SIGSTOP)
            wait_until(lambda: all(_state(p) == "T" for p in workers), 30.0, "the workers to stop")
        up.popen.send_signal(signal.SIGKILL)
        up.popen.wait(timeout=10)
        wait_until(
            lambda: not any(pid_alive(p) for p in workers),
            GONE_WITHIN_S,
            lambda: _still_alive(workers, log_dir),
        )
    finally:
        stop_processes([up])
        _kill_by_pid(workers)


def _descendants(root: int) -> list[int]:
    """Every live process below `root` (by parent pid, from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


RAY_READY = re.compile(r"ray workers ready: (\{.*\})")


def test_workers_exit_when_pdserve_up_with_ray_is_killed(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With Ray: `pdserve up` started a local Ray cluster; its SIGKILL takes the workers (Ray
    actors) with it, and every other process it started (Ray's own)."""
    pytest.importorskip("ray")
    argv = [sys.executable, "-m", "deploy.cli", "up", "--model", str(tiny_model_dir)]
    argv += ["--mode", "disagg", "--prefill", "1", "--decode", "1", "--port", "0"]
    up = spawn("pdserve-up-ray", argv, tmp_path, child_env(1))
    below: list[int] = []
    try:
        (m,) = wait_for_lines([up], READY, timeout_s=300)
        (ready,) = wait_for_lines([up], RAY_READY, timeout_s=10)
        workers = [int(pid) for pid in re.findall(r"pid (\d+)", ready.group(1))]
        below = _descendants(up.pid)
        assert len(workers) == 2 and set(workers) <= set(below), (workers, _cmdlines(below))
        _open_stream(m.group(1))
        up.popen.send_signal(signal.SIGKILL)
        up.popen.wait(timeout=10)
        wait_until(
            lambda: not any(pid_alive(p) for p in workers),
            GONE_WITHIN_S,
            lambda: f"workers still alive: {[p for p in workers if pid_alive(p)]}",
        )
        # Ray's own GCS and raylet go too (its dashboard and runtime-env agents linger on:
        # Ray's business, not ours; they hold no worker port or model).
        core = [p for p, cmd in _cmdlines(below).items() if "gcs_server" in cmd or "raylet" in cmd]
        wait_until(
            lambda: not any(pid_alive(p) for p in core),
            GONE_WITHIN_S,
            lambda: f"Ray processes still alive: {_cmdlines([p for p in core if pid_alive(p)])}",
        )
    finally:
        stop_processes([up])
        _kill_by_pid(below)


def _cmdlines(pids: list[int]) -> dict[int, str]:
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            out[pid] = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
    return out
