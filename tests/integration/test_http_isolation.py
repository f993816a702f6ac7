"""One HTTP client cannot hurt another through the router's HTTP front (issue 26): a huge chat
body is refused without stalling the event loop, parser garbage becomes an OpenAI error object
with no token in it and no ERROR traceback in the log, public errors carry no internal details,
and slow-header sockets are closed.

Everything runs on one event loop per test (router, HTTP front, fake workers); the hostile
clients run on plain blocking sockets in helper threads, so the only work on the loop is the
router's own. Loop stalls are measured by `tooling.loop_lag.LoopWatchdog` (a 5 ms ticker that
records its largest lateness, counting only what the process spent on the CPU, so a busy shared
machine does not pass for a stall).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
from pathlib import Path

import aiohttp
import pytest

from tests.fakes.cluster import FakeCluster, fake_cluster
from tooling.loop_lag import LoopWatchdog

MAX_STALL_S = 0.1  # the bound on the loop's longest stall


@pytest.fixture
def model_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, out)
    return out


def http_port(c: FakeCluster) -> int:
    assert c.router.http is not None
    return c.router.http.port


def request_head(port: int, path: str, length: int, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\nConnection: close\r\n{extra}\r\n"
    ).encode()


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """(status, lower-case headers, body) of the response on `sock`, read to EOF."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


class SplitPost:
    """A POST sent from a helper thread in two parts: all but the last byte, then (after
    `release()`) the last byte; `result` is the response. While the last byte is held the
    router cannot have finished the request, so whatever the test does meanwhile overlaps it."""

    def __init__(self, port: int, path: str, body: bytes) -> None:
        self.head_sent = threading.Event()
        self._go = threading.Event()
        self.result: tuple[int, dict[str, str], bytes] | None = None
        self.error: BaseException | None = None
        self._args = (port, path, body)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        port, path, body = self._args
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
                sock.sendall(request_head(port, path, len(body)) + body[:-1])
                self.head_sent.set()
                self._go.wait(60)
                sock.sendall(body[-1:])
                self.result = read_response(sock)
        except BaseException as exc:  # reported by `wait`
            self.error = exc
            self.head_sent.set()

    def release(self) -> None:
        self._go.set()

    async def wait(self) -> tuple[int, dict[str, str], bytes]:
        await asyncio.to_thread(self._thread.join, 120)
        if self.error is not None:
            raise self.error
        assert self.result is not None, "no response within 120 s"
        return self.result


def chat_body(content_bytes: int) -> bytes:
    unit = "The river flows "
    content = unit * (content_bytes // len(unit))
    return json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    ).encode()


@pytest.mark.parametrize("megabytes", [10, 30])
def test_huge_chat_body_is_refused_without_stalling_the_loop(
    model_dir: Path, megabytes: int
) -> None:
    body = chat_body(megabytes * 2**20)  # built before the watchdog starts

    async def scenario() -> None:
        async with fake_cluster(model_dir, http_port=0) as c, aiohttp.ClientSession() as s:
            port = http_port(c)
            health = f"http://127.0.0.1:{port}/health"
            async with s.get(health) as resp:  # warm up the front before measuring
                assert resp.status == 200
            dog = LoopWatchdog(tick_s=0.005)
            dog.start()
            try:
                post = SplitPost(port, "/v1/chat/completions", body)
                await asyncio.to_thread(post.head_sent.wait, 60)
                async with s.get(health) as resp:  # the big request is in flight: held
                    assert resp.status == 200, await resp.text()
                post.release()
                status, headers, raw = await post.wait()
                async with s.get(health) as resp:
                    assert resp.status == 200
            finally:
                await dog.stop()
            assert dog.ticks > 0
            assert dog.max_stall_s < MAX_STALL_S, (
                f"loop stalled {dog.max_stall_s * 1e3:.1f} ms (wall {dog.max_wall_s * 1e3:.1f} ms)"
            )
            assert status == 400, raw[:300]
            assert headers["content-type"].startswith("application/json")
            err = json.loads(raw)["error"]
            assert err["param"] == "messages[0].content", err
            assert err["message"].startswith("messages[0].content: "), err
            assert err["type"] == "invalid_request_error"
            await c.assert_no_leaks()

    asyncio.run(scenario())
