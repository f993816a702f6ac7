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
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
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


@dataclass(frozen=True)
class RedisTLS:
    """TLS files of a redis-server started with TLS only (its plain port off)."""

    cert: Path
    key: Path
    ca: Path


def _ping(port: int, tls: RedisTLS | None = None) -> bool:
    """True once the server answers (PONG, or NOAUTH when it wants a password)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as raw:
            s: socket.socket = raw
            if tls is not None:
                ctx = ssl.create_default_context(cafile=str(tls.ca))
                ctx.check_hostname = False
                s = ctx.wrap_socket(raw)
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


class RedisServer:
    """One redis-server process on 127.0.0.1:`port` (a free one when None). With `password`
    it requires AUTH (`requirepass`, set through a config file, not its command line); with
    `tls` it serves TLS only (clients need no certificate of their own)."""

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        password: str | None = None,
        tls: RedisTLS | None = None,
    ) -> None:
        binary = redis_server_path()
        if binary is None:
            raise RuntimeError(SKIP_REASON)
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.password = password
        self.tls = tls
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls is not None else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def _conf(self) -> list[str]:
        """The config file (0600) holding the password and TLS settings, as its argv."""
        lines = []
        if self.password is not None:
            if any(c in self.password for c in '"\\\n'):
                raise ValueError("the test password must not hold quotes, backslashes or newlines")
            lines.append(f'requirepass "{self.password}"')
        if self.tls is not None:
            t = self.tls
            lines += ["port 0", f"tls-port {self.port}", f"tls-cert-file {t.cert}"]
            lines += [f"tls-key-file {t.key}", f"tls-ca-cert-file {t.ca}", "tls-auth-clients no"]
        if not lines:
            return []
        path = self.workdir / f"redis-{self.port}.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return [str(path)]

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server and wait until it answers PING."""
        assert self.proc is None, "already running"
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / f"redis-{self.port}.log", "ab")  # noqa: SIM115 (kept open)
        conf = self._conf()
        self.proc = subprocess.Popen(
            [
                self.binary,
                *conf,
                *([] if self.tls else ["--port", str(self.port)]),
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
        while not _ping(self.port, self.tls):
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
