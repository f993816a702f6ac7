"""CPU time of processes and of the whole machine over a span, from /proc (Linux).

Runs in the benchmark / CLI process. This machine is shared: a run's latencies depend on the
cores other processes left it, so the goodput bench and the planner's calibration record, per
run, the CPU seconds of their own processes and what everything else took
(`CpuMeter.stop()["external_cores"]`); the simulator replays a run on the cores that were free.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Mapping
from typing import Any


def pid_cpu_s(pid: int) -> float:
    """utime + stime of `pid` in seconds (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    """CPU seconds this process has used (user + system, all its threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy since boot (all cores)."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """`start({label: pid})` ... `stop(extra)` -> CPU seconds per label, the cores they used in
    all, the cores everything else used (`external_cores`), and the wall time. `extra`:
    CPU seconds of processes not in the map that count as ours (e.g. a load generator that
    measured itself)."""

    def __init__(self) -> None:
        self._pids: dict[str, int] = {}
        self._t0 = self._all0 = 0.0
        self._cpu0: dict[str, float] = {}

    def start(self, pids: Mapping[str, int]) -> None:
        self._pids = dict(pids)
        self._t0 = time.monotonic()
        self._cpu0 = {k: pid_cpu_s(p) for k, p in self._pids.items()}
        self._all0 = machine_busy_s()

    def stop(self, extra: Mapping[str, float] | None = None) -> dict[str, Any]:
        wall = max(1e-9, time.monotonic() - self._t0)
        per = {k: pid_cpu_s(p) - self._cpu0[k] for k, p in self._pids.items()}
        per.update(extra or {})
        ours = sum(per.values())
        busy = machine_busy_s() - self._all0
        return {
            "wall_s": wall,
            "cpu_s": per,
            "our_cores": ours / wall,
            "external_cores": max(0.0, busy - ours) / wall,
            "cpus": float(os.cpu_count() or 1),
        }
