"""A real `redis-server` process for tests and benchmarks (not a fake: the real server).

Runs in the test process, which starts the server on a free 127.0.0.1 port with persistence
off, waits for PING, and stops it by PID (SIGTERM, or SIGKILL to simulate a crash). `restart()`
brings a new, empty server up on the same port, as a crashed Redis coming back.

`redis_server_path()` is None when `redis-server` is not installed; `make setup` installs it
(apt-get install -y redis-server), and tests skip with that reason otherwise.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

SKIP_REASON = "redis-server not installed (`make setup` installs it: apt-get install redis-server)"


def redis_server_path() -> str | None:
    """Path of the `redis-server` binary, or None."""
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None
    )


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process on 127.0.0.1:`port` (a free one when None)."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        binary = redis_server_path()
        if binary is None:
            raise RuntimeError(SKIP_REASON)
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server and wait until it answers PING."""
        assert self.proc is None, "already running"
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / f"redis-{self.port}.log", "ab")  # noqa: SIM115 (kept open)
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.workdir),
                "--protected-mode", "no",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        end = time.monotonic() + timeout_s
        while not _ping(self.port):
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError(f"redis-server exited at start; see {self.workdir}")
            if time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the server (a crash: nothing is saved) and reap it."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
            self.proc = None

    def stop(self) -> None:
        """SIGTERM the server and reap it (SIGKILL after 5 s)."""
        if self.proc is None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the server holds connections but answers nothing (a slow/frozen Redis)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        """Kill (if running) and start a new, empty server on the same port."""
        self.kill()
        self.start()


@contextlib.contextmanager
def running_redis(workdir: Path) -> Iterator[RedisServer]:
    """A started `RedisServer`, stopped (by PID) on exit whatever happened."""
    server = RedisServer(workdir)
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.proc.pid, signal.SIGCONT)  # a paused server cannot stop
        server.stop()
