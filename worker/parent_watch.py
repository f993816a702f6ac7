"""A worker process follows its launcher: when the process that started it dies (even by
SIGKILL, with no chance to stop its children), the worker stops instead of running on as an
orphan that holds its ports and memory. Runs in the worker process (`worker.cli`). Torch-free.

Launchers opt in by putting their pid in the child's environment (`PARENT_PID_ENV`,
`deploy.processes.spawn`, `worker.process.WorkerProcess.spawn`); a worker started by hand,
without it, is not watched. Two ways, either one enough:

- Linux: ``prctl(PR_SET_PDEATHSIG)`` (through ctypes) makes the kernel send `SIGNAL` the moment
  the parent goes. The kernel counts the parent *thread* that forked the worker (a launcher's
  supervisor thread restarts workers), so the signal only wakes the watch, which then checks
  that the parent *process* is really gone — which is also why the signal is not SIGKILL: a
  launcher thread that ends would kill a worker whose launcher lives on. `SIGNAL` is SIGCONT:
  a *stopped* worker (SIGSTOP: it runs no handler and no thread) is continued by it, whatever
  handler it has, so the watch runs and the worker stops as any orphan does — within
  seconds of its launcher's death instead of never. (The cost: a worker stopped on purpose is
  continued when the launcher thread that started it ends, and goes on running.) The handler
  only writes a byte to a pipe the watch
  thread waits on: a Python handler runs on the main thread between any two bytecodes, nested
  when a second signal comes, so one that took a lock (``Event.set``) could wait on itself
  forever, and the watch thread with it (the worker then outlived its launcher). Signals do
  come in bursts: when a launcher dies, the kernel re-parents the worker to each of its
  remaining threads in turn, and sends `SIGNAL` at each step;
- everywhere: the watch thread compares ``os.getppid()`` with the launcher's pid every
  `POLL_S` (an orphan is re-parented to init or a subreaper).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import select
import signal
import sys
import threading
from collections.abc import Callable

log = logging.getLogger("pdserve.worker")

PARENT_PID_ENV = "PDSERVE_PARENT_PID"
SIGNAL = signal.SIGCONT  # continues a stopped worker, so its watch can run (module docstring)
POLL_S = 0.5
_PR_SET_PDEATHSIG = 1


def parent_pid_from_env() -> int | None:
    """The launcher's pid from `PARENT_PID_ENV` (removed, so the worker's own children do not
    inherit it); None when unset. ValueError names the variable when it is not a pid."""
    raw = os.environ.pop(PARENT_PID_ENV, None)
    if raw is None or raw == "":
        return None
    try:
        pid = int(raw)
    except ValueError:
        raise ValueError(f"{PARENT_PID_ENV} must be a process id, got {raw!r}") from None
    if pid <= 1:
        raise ValueError(f"{PARENT_PID_ENV} must be a process id above 1, got {pid}")
    return pid


class ParentWatch:
    """Calls `on_gone` once (from its own daemon thread) when the process `parent_pid` is no
    longer this process's parent. Build it on the main thread (it installs a signal
    handler); `stop()` ends the watch without calling `on_gone`."""

    def __init__(self, parent_pid: int, on_gone: Callable[[], None]) -> None:
        self.parent_pid = parent_pid
        self._on_gone = on_gone
        # The wake: a byte on this pipe (lock-free, so safe from a signal handler). Never
        # closed: a signal after `stop()` must not write into a reused descriptor number.
        self._wake_r, self._wake_w = os.pipe()  # not inherited by children (PEP 446)
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stopped = False
        self.kernel_signal = _set_parent_death_signal()
        if self.kernel_signal:
            signal.signal(SIGNAL, lambda *_: self._wake())
        self._thread = threading.Thread(target=self._run, name="parent-watch", daemon=True)
        self._thread.start()  # checks at once: the parent may have died before the prctl

    def gone(self) -> bool:
        return os.getppid() != self.parent_pid

    def stop(self) -> None:
        self._stopped = True
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: the watch wakes anyway
            os.write(self._wake_w, b"\0")

    def _run(self) -> None:
        while not self._stopped:
            if self.gone():
                log.warning(
                    "launcher pid %d is gone (parent now pid %d); stopping",
                    self.parent_pid,
                    os.getppid(),
                )
                self._on_gone()
                return
            readable, _, _ = select.select([self._wake_r], [], [], POLL_S)
            if readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)


def _set_parent_death_signal() -> bool:
    """Ask the kernel for `SIGNAL` when the parent dies; False where that cannot be done."""
    if not sys.platform.startswith("linux"):
        return False
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(SIGNAL), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return False
    return True
