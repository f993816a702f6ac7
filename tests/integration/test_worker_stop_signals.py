"""A worker's stop signals in real processes, each under a storm of the signal. A Python signal
handler runs on the main thread between any two bytecodes, nested when signals come fast; the
handlers once took a lock (``Event.set``) and could wait on themselves forever (CI, 2026-11-26:
a worker outlived its launcher). The storms are the regression tests:

- `worker.parent_watch`: a child watching its parent (through a middle process the test kills
  with SIGKILL) reports the parent gone after a storm of the wake signal its kernel
  parent-death request uses;
- `worker.cli`: a worker process hit by a storm of SIGTERM stops cleanly (exit 0).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.helpers import pid_alive, wait_until
from worker.parent_watch import SIGNAL
from worker.process import WorkerProcess

STORM = 3000  # signals sent back to back; enough to nest handlers on every run seen

CHILD = textwrap.dedent(
    """
    import os, sys, threading
    from worker.parent_watch import ParentWatch
    gone = threading.Event()
    watch = ParentWatch(os.getppid(), gone.set)
    print("watching", os.getpid(), watch.kernel_signal, flush=True)
    while not gone.wait(0.2):
        pass
    print("gone", flush=True)
    """
)
MIDDLE = textwrap.dedent(
    f"""
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", {CHILD!r}])
    time.sleep(3600)
    """
)


@contextlib.contextmanager
def _watching_child() -> Iterator[tuple[subprocess.Popen[str], int, bool]]:
    """A middle process whose child watches it (`CHILD`): (the middle, the child's pid,
    whether the kernel's parent-death signal is set). Both are SIGKILLed on the way out."""
    middle = subprocess.Popen(
        [sys.executable, "-c", MIDDLE], stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    assert middle.stdout is not None
    child = 0
    try:
        words = middle.stdout.readline().split()
        assert words[0] == "watching", words
        child = int(words[1])
        yield middle, child, words[2] == "True"
    finally:
        middle.kill()
        if child and pid_alive(child):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def _kill_and_see_it_noticed(middle: subprocess.Popen[str], child: int, what: str) -> None:
    """SIGKILL the middle process: the child's watch reports it gone, and the child ends."""
    assert middle.stdout is not None
    middle.kill()
    middle.wait(10)
    wait_until(lambda: not pid_alive(child), 30, what)
    assert middle.stdout.read().split() == ["gone"]  # the watch fired; no error either


def test_the_watch_survives_a_signal_storm_and_sees_its_parent_die() -> None:
    with _watching_child() as (middle, child, kernel_signal):
        if kernel_signal:  # each signal runs the handler; many land while one is running
            for _ in range(STORM):
                os.kill(child, SIGNAL)
        _kill_and_see_it_noticed(middle, child, "the child did not see its parent die")


def test_a_stopped_child_sees_its_parent_die() -> None:
    """The child is stopped (SIGSTOP: no handler, no thread runs) when its parent is SIGKILLed:
    the parent-death signal continues it (SIGCONT), its watch runs and reports the parent gone
    (issue 39: a stopped worker outlived its launcher's SIGKILL in state T indefinitely)."""
    with _watching_child() as (middle, child, kernel_signal):
        if not kernel_signal:
            pytest.skip("no kernel parent-death signal here (not Linux): the poll needs to run")
        os.kill(child, signal.SIGSTOP)
        wait_until(lambda: _state(child) == "T", 30, "the child to stop")
        _kill_and_see_it_noticed(middle, child, "the stopped child to see its parent die")


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_worker_stops_cleanly_under_a_storm_of_sigterm(tiny_model_dir: Path) -> None:
    worker = WorkerProcess.spawn(["--model", str(tiny_model_dir), "--role", "decode"])
    try:
        for _ in range(STORM):
            if worker.popen.poll() is not None:
                break
            os.kill(worker.pid, signal.SIGTERM)
        assert worker.popen.wait(60) == 0
    finally:
        worker.kill()
