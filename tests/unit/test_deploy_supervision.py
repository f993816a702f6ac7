"""Unit tests of `deploy.supervision`: backoff, exit texts, role coverage events, and the process
supervisor's restart / give-up decisions driven with real (tiny, short-lived) child processes."""

from __future__ import annotations

import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from deploy.processes import ManagedProcess, child_env, spawn, stop_processes
from deploy.supervision import (
    EventLog,
    ProcessSupervisor,
    Supervised,
    SupervisionConfig,
    SupervisionEvent,
    exit_text,
)

READY = re.compile(r"^READY (\S+)$", re.M)


def test_backoff_doubles_up_to_its_cap() -> None:
    cfg = SupervisionConfig(backoff_s=0.5, max_backoff_s=3.0)
    assert [cfg.backoff(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_exit_text_names_the_signal_or_status() -> None:
    assert exit_text(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_text(3) == "exited with status 3"
    assert exit_text(-200) == "killed by signal 200"


def test_role_down_and_up_are_reported_once_per_change() -> None:
    seen: list[SupervisionEvent] = []
    log = EventLog(["prefill", "decode"], seen.append)
    log.roles_now({"prefill": 1, "decode": 1})
    log.roles_now({"prefill": 1, "decode": 0})
    log.roles_now({"prefill": 1, "decode": 0})
    assert log.roles_down == ["decode"]
    log.roles_now({"prefill": 1, "decode": 2})
    assert [(e.worker_id, e.kind) for e in seen] == [("decode", "role_down"), ("decode", "role_up")]
    assert "no live decode worker left" in seen[0].detail and log.roles_down == []


@dataclass
class _Child:
    worker_id: str
    role: str
    address: str
    process: ManagedProcess


def _child(tmp: Path, name: str, code: str) -> ManagedProcess:
    return spawn(name, [sys.executable, "-c", code], tmp, child_env(1))


def test_a_dead_child_is_reaped_restarted_then_given_up(tmp_path: Path) -> None:
    """A child that dies at once is restarted (it announces its old address) until
    `max_restarts` restarts in a row are used, then given up; every death is reaped."""
    announce = "import time; print('READY w:1', flush=True); time.sleep(0.3); raise SystemExit(7)"
    first = _child(tmp_path, "w0", "raise SystemExit(3)")
    child = _Child("w0", "decode", "w:1", first)
    events: list[SupervisionEvent] = []
    spawned: list[ManagedProcess] = []

    def respawn(dead: Supervised, n: int) -> ManagedProcess:
        spawned.append(_child(tmp_path, f"w0-restart{n}", announce))
        return spawned[-1]

    cfg = SupervisionConfig(max_restarts=2, backoff_s=0.05, check_interval_s=0.02)
    sup = ProcessSupervisor([child], cfg, respawn, READY, EventLog(["decode"], events.append))
    sup.start()
    try:
        deadline = time.monotonic() + 30
        while not any(e.kind == "gave_up" for e in events):
            assert time.monotonic() < deadline, events
            time.sleep(0.02)
    finally:
        stop_processes(sup.stop() + spawned)
    kinds = [e.kind for e in events if e.worker_id == "w0"]
    assert kinds == [
        "died", "restarting", "restarted", "died", "restarting", "restarted", "died", "gave_up"
    ], kinds  # fmt: skip
    assert "exited with status 3" in events[0].detail
    assert [e.detail for e in events if e.kind == "died"][1].count("exited with status 7") == 1
    assert ("decode", "role_down") in [(e.worker_id, e.kind) for e in events]
    assert all(p.popen.returncode is not None for p in [first, *spawned])  # reaped


def test_a_child_that_exits_0_was_stopped_on_request_and_stays_down(tmp_path: Path) -> None:
    """Exit status 0 is a drain the operator asked for (SIGTERM): no restart, the role is
    reported down; `resume` starts it again."""
    announce = "import time; print('READY w:1', flush=True); time.sleep(60)"
    first = _child(tmp_path, "w0", "raise SystemExit(0)")
    child = _Child("w0", "decode", "w:1", first)
    events: list[SupervisionEvent] = []
    spawned: list[ManagedProcess] = []

    def respawn(dead: Supervised, n: int) -> ManagedProcess:
        spawned.append(_child(tmp_path, f"w0-restart{n}", announce))
        return spawned[-1]

    cfg = SupervisionConfig(backoff_s=0.05, check_interval_s=0.02)
    sup = ProcessSupervisor([child], cfg, respawn, READY, EventLog(["decode"], events.append))
    sup.start()
    try:
        _wait_for(events, "role_down")
        with sup._lock:  # "stopped" has no way out but `resume`: no restart can come
            assert sup._watches[0].state == "stopped"
        assert not spawned
        sup.resume("w0")
        _wait_for(events, "restarted")
    finally:
        stop_processes(sup.stop() + spawned)
    kinds = [e.kind for e in events]
    assert kinds == ["stopped", "role_down", "restarting", "restarted", "role_up"], kinds
    assert "stopped on request (exited with status 0)" in events[0].detail
    assert len(spawned) == 1


def _wait_for(events: list[SupervisionEvent], kind: str) -> None:
    deadline = time.monotonic() + 30
    while not any(e.kind == kind for e in events):
        assert time.monotonic() < deadline, events
        time.sleep(0.02)
