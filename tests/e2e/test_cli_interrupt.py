"""A `pdserve` command that starts clusters stops them when it is told to stop: SIGTERM (what a
job runner or `timeout` sends) unwinds `pdserve bench` like Ctrl-C, and every process it
started (routers, workers, the load generator) exits with it.

Runs in the pytest process; `pdserve bench` is a real subprocess on the tiny model.
"""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import pytest

from deploy.processes import child_env, spawn, stop_processes, wait_for_lines
from tests.e2e.helpers import pid_alive, wait_until

pytestmark = pytest.mark.slow
CLUSTERS_UP = re.compile(r"warming up and calibrating disagg")


def _descendants(root: int) -> set[int]:
    """PIDs of every live process below `root` (from /proc's parent links)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # gone while we looked
                continue
            parent[int(entry.name)] = int(fields[1])
    out: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - out
        out |= frontier
    return out


def test_bench_stops_its_clusters_on_sigterm(tiny_model_dir: Path, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "deploy.cli", "bench", "--model", str(tiny_model_dir)]
    argv += ["--configs", "colocated,disagg", "--rates", "1", "--duration", "60"]
    argv += ["--out", str(tmp_path / "bench")]
    bench = spawn("pdserve-bench", argv, tmp_path, child_env(1))
    try:
        wait_for_lines([bench], CLUSTERS_UP, timeout_s=180)
        started = _descendants(bench.pid)
        # two routers, one colocated, one prefill and one decode worker at least
        assert len(started) >= 5, started
        bench.popen.send_signal(signal.SIGTERM)
        assert bench.popen.wait(timeout=60) == 130, bench.log_text()[-2000:]
        assert "interrupted" in bench.log_text()
        wait_until(
            lambda: not any(pid_alive(p) for p in started),
            15.0,
            lambda: f"left running: {sorted(p for p in started if pid_alive(p))}",
        )
    finally:
        stop_processes([bench])
