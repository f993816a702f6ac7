"""`WorkerProcess`: a ``python -m worker_main`` child seen from its parent (launcher, tests).

Runs in the parent process: `spawn` starts the worker and waits for its READY line; `stop`
sends SIGTERM (SIGKILL after a timeout); `kill` sends SIGKILL. Always by PID.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from worker.config import READY_PREFIX
from worker.parent_watch import PARENT_PID_ENV

log = logging.getLogger("pdserve.worker")


class WorkerProcess:
    """A ``python -m worker_main`` child: `spawn` waits for its READY line; `stop` sends
    SIGTERM (SIGKILL after `timeout_s`), `kill` SIGKILL — always by PID."""

    def __init__(self, popen: subprocess.Popen[str], address: str) -> None:
        self.popen = popen
        self.address = address
        self.pid = popen.pid

    @classmethod
    def spawn(cls, args: Sequence[str], ready_timeout_s: float = 120.0) -> WorkerProcess:
        """Start ``python -m worker_main *args`` (stderr inherited) and wait for READY."""
        popen = subprocess.Popen(
            [sys.executable, "-m", "worker_main", *args],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", PARENT_PID_ENV: str(os.getpid())},
        )
        lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()

        def pump() -> None:  # keeps reading, so the pipe never fills
            assert popen.stdout is not None
            for line in popen.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, name=f"worker-{popen.pid}-stdout", daemon=True).start()
        deadline = time.monotonic() + ready_timeout_s
        while True:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                popen.kill()
                popen.wait()
                raise TimeoutError(
                    f"worker pid {popen.pid} not ready in {ready_timeout_s} s"
                ) from None
            if line is None:
                raise RuntimeError(f"worker pid {popen.pid} exited ({popen.wait()}) before READY")
            if line.startswith(READY_PREFIX + " "):
                return cls(popen, line.split()[1])

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL; return the exit status."""
        if self.popen.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                return self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.error(
                    "worker pid %d ignored SIGTERM for %.0f s; killing it", self.pid, timeout_s
                )
        return self.kill()

    def kill(self) -> int:
        if self.popen.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        return self.popen.wait()
