"""Child processes of a launcher: spawn with a log file and its own session, wait for a
readiness line and a gRPC health check, stop by PID. Runs in the launching process.

Every child is started with its own session (so a terminal's Ctrl-C reaches only the launcher),
writes stdout+stderr to a log file, and is stopped by PID: SIGTERM, then SIGKILL after a grace
period. An `atexit` hook stops whatever is still running when the launching interpreter exits.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from worker.config import THREAD_ENV_VARS

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent

_live: set[ManagedProcess] = set()


@dataclass(eq=False)
class ManagedProcess:
    """One child process started by this module; `log_path` holds its stdout and stderr."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        """Everything the process wrote so far ('' if the log cannot be read)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


def child_env(threads: int) -> dict[str, str]:
    """The environment of a child: unbuffered output, the repo importable, its OpenMP and
    MKL pools capped at `threads` (a worker's own are its `torch_threads`: the launchers lay
    `worker.config.thread_env` over this)."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    for var in THREAD_ENV_VARS:
        env[var] = str(threads)
    return env


def spawn(name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str]) -> ManagedProcess:
    """Start `argv` in a new session with output to `log_dir/<name>.log`."""
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as out:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    proc = ManagedProcess(name, popen, log_path)
    _live.add(proc)
    log.info("started %s (pid %d), log %s", name, proc.pid, log_path)
    return proc


def stop_processes(procs: Sequence[ManagedProcess], grace_s: float = 5.0) -> None:
    """SIGTERM every running process in `procs`, wait up to `grace_s` for all of them, then
    SIGKILL the rest and reap them. Safe to call twice."""
    for p in procs:
        if p.running():
            with contextlib.suppress(ProcessLookupError):
                p.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) ignored SIGTERM for %.1f s; killing", p.name, p.pid, grace_s)
            with contextlib.suppress(ProcessLookupError):
                p.popen.kill()
            p.popen.wait()
        _live.discard(p)


@atexit.register
def _stop_leftovers() -> None:
    stop_processes(list(_live), grace_s=3.0)


def wait_for_lines(
    procs: Sequence[ManagedProcess], pattern: re.Pattern[str], timeout_s: float
) -> list[re.Match[str]]:
    """Wait until each process's log matches `pattern`; return the matches in order.

    Raises RuntimeError naming the process (with its last log lines) if one exits first, and
    TimeoutError naming those not ready after `timeout_s`."""
    found: dict[int, re.Match[str]] = {}
    deadline = time.monotonic() + timeout_s
    while len(found) < len(procs):
        for i, p in enumerate(procs):
            if i in found:
                continue
            m = pattern.search(p.log_text())
            if m:
                found[i] = m
            elif not p.running():
                raise RuntimeError(
                    f"{p.name} (pid {p.pid}) exited with status {p.popen.returncode} before it "
                    f"was ready; last log lines ({p.log_path}):\n{p.tail()}"
                )
        if len(found) == len(procs):
            break
        if time.monotonic() > deadline:
            late = [p for i, p in enumerate(procs) if i not in found]
            raise TimeoutError(
                f"not ready after {timeout_s:.0f} s: "
                + "; ".join(f"{p.name} (log {p.log_path}):\n{p.tail(10)}" for p in late)
            )
        time.sleep(0.05)  # polling the log files, not a readiness guess
    return [found[i] for i in range(len(procs))]


def wait_serving(
    address: str,
    timeout_s: float,
    service: str = "",
    open_channel: Callable[[str, list[tuple[str, int]]], grpc.Channel] | None = None,
) -> None:
    """Block until `address`'s grpc.health.v1 service `service` answers SERVING.

    `open_channel(address, options)` dials it (TLS servers; default: a plaintext channel).
    Raises TimeoutError with the last status or error seen."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    options = [("grpc.enable_http_proxy", 0)]
    dial = open_channel or (lambda a, o: grpc.insecure_channel(a, o))
    with dial(address, options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{address} not SERVING after {timeout_s:.0f} s ({last})")
            try:
                resp = stub.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=min(left, 2.0)
                )
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
            except grpc.RpcError as exc:
                last = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.Call) else ""
            time.sleep(0.05)


# ---------------------------------------------------------------------- workers
