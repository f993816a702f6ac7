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
import contextlib
import json
import logging
import shutil
import socket
import threading
import time
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


TOKEN = "tok-Zq81-secret-do-not-log"


def raw_exchange(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send `data` on a fresh connection and read the answer (the server closes after it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        return read_response(sock)


GARBAGE = {
    "token_then_9000_spaces": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + TOKEN.encode()
        + b" " * 9000
        + b"\r\nContent-Length: 2\r\n\r\n{}"
    ),
    "http2_preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "tls_hello_bytes": bytes.fromhex("160301020001000200030399") + TOKEN.encode() + b"\r\n\r\n",
    "control_byte_in_header": (
        b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + TOKEN.encode()
        + b"\x01\r\n\r\n"
    ),
}


@pytest.mark.parametrize("name", sorted(GARBAGE))
def test_parser_errors_are_openai_json_and_never_log_the_token(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    from security.config import SecurityConfig

    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    tokens.chmod(0o600)
    caplog.set_level(logging.DEBUG)

    async def scenario() -> tuple[int, dict[str, str], bytes]:
        security = SecurityConfig(auth_token_file=tokens)
        async with fake_cluster(model_dir, http_port=0, security=security) as c:
            return await asyncio.to_thread(raw_exchange, http_port(c), GARBAGE[name])

    status, headers, body = asyncio.run(scenario())
    assert headers["content-type"].startswith("application/json")
    assert status == 400, body
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "bad_request", err
    assert err["message"].startswith("bad request: ")
    assert TOKEN.encode() not in body
    formatter = logging.Formatter()
    for rec in caplog.records:
        text = formatter.format(rec)
        assert TOKEN not in text, text
        assert rec.levelno < logging.ERROR and rec.exc_info is None, text
    assert any("refused a malformed request" in r.getMessage() for r in caplog.records)


def wait_closed(sock: socket.socket, limit_s: float) -> float:
    """Seconds until the server closed `sock` (EOF or reset); `limit_s` when it did not."""
    start = time.monotonic()
    sock.settimeout(0.05)
    while time.monotonic() - start < limit_s:
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - start
    return limit_s


@pytest.mark.parametrize("trickle", [False, True], ids=["silent", "trickle"])
def test_slow_header_socket_is_closed_within_the_bound(model_dir: Path, trickle: bool) -> None:
    bound_s = 1.0

    def slow_client(port: int) -> float:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            start = time.monotonic()
            if trickle:  # a byte every 50 ms never completes the head
                while time.monotonic() - start < bound_s + 10:
                    try:
                        sock.sendall(b"X")
                    except OSError:
                        break
                    if wait_closed(sock, 0.05) < 0.05:
                        break
                return time.monotonic() - start
            return wait_closed(sock, bound_s + 10)

    async def scenario() -> float:
        async with fake_cluster(model_dir, http_port=0, http_header_timeout_s=bound_s) as c:
            return await asyncio.to_thread(slow_client, http_port(c))

    held = asyncio.run(scenario())
    assert bound_s * 0.9 <= held < bound_s + 10, held


def test_body_too_large_is_an_openai_invalid_request(model_dir: Path) -> None:
    async def scenario() -> tuple[int, dict[str, str], bytes]:
        async with fake_cluster(model_dir, http_port=0) as c:
            port = http_port(c)
            data = request_head(port, "/v1/completions", 33 * 2**20) + b" " * (33 * 2**20)

            def send() -> tuple[int, dict[str, str], bytes]:
                with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                    # the server may answer and close before it read everything
                    with contextlib.suppress(OSError):
                        sock.sendall(data)
                    return read_response(sock)

            return await asyncio.to_thread(send)

    status, headers, body = asyncio.run(scenario())
    assert status == 413 and headers["content-type"].startswith("application/json")
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error", err
    assert err["code"] == "request_entity_too_large", err


# -- issue 39: hostile headers and bodies never reach a 500 or an ERROR traceback --------------


def _tokens_file(tmp_path: Path) -> Path:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    tokens.chmod(0o600)
    return tokens


def _no_error_logged(caplog: pytest.LogCaptureFixture) -> None:
    formatter = logging.Formatter()
    for rec in caplog.records:
        text = formatter.format(rec)
        assert rec.levelno < logging.ERROR and rec.exc_info is None, text
        assert TOKEN not in text, text


def _completion_body(model: str = "tiny") -> bytes:
    return json.dumps({"model": model, "prompt": [5, 6, 7], "max_tokens": 2}).encode()


def _completion_head(body: bytes, extra: str = "", token: bool = True) -> bytes:
    """The head of a `/v1/completions` POST of `body` (with the token unless not `token`),
    `extra` header lines included, without the blank line that ends it."""
    auth = f"Authorization: Bearer {TOKEN}\r\n" if token else ""
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}{extra}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close"
        "\r\n"
    ).encode()


def _exchange_with_front(
    model_dir: Path, tmp_path: Path, data: bytes, **router_kw: object
) -> tuple[int, dict[str, str], bytes]:
    """`data` sent raw to a token-protected HTTP front over fake workers; the answer."""
    from security.config import SecurityConfig

    security = SecurityConfig(auth_token_file=_tokens_file(tmp_path))

    async def scenario() -> tuple[int, dict[str, str], bytes]:
        async with fake_cluster(model_dir, http_port=0, security=security, **router_kw) as c:
            return await asyncio.to_thread(raw_exchange, http_port(c), data)

    return asyncio.run(scenario())


@pytest.mark.parametrize(
    "head",
    [b"GET /metrics", b"GET /v1/models", b"POST /v1/completions"],
    ids=["metrics", "models", "completions"],
)
def test_a_non_utf8_authorization_header_is_a_clean_401(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, head: bytes
) -> None:
    caplog.set_level(logging.DEBUG)
    body = _completion_body()
    data = (
        head + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe" + TOKEN.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
        b"Connection: close\r\n\r\n" % len(body) + body
    )  # fmt: skip
    status, headers, raw = _exchange_with_front(model_dir, tmp_path, data)
    assert status == 401, raw
    assert headers["content-type"].startswith("application/json")
    err = json.loads(raw)["error"]
    assert err["code"] == "invalid_api_key", err
    assert b"\\udc" not in raw and TOKEN.encode() not in raw
    _no_error_logged(caplog)


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
@pytest.mark.parametrize("with_token", [False, True], ids=["no-token", "token"])
def test_a_content_encoding_is_refused_cleanly(
    model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    encoding: str,
    with_token: bool,
) -> None:
    """A body labelled compressed (here: plain JSON under the label, which would not
    decompress) is never decoded: 415 with a token, 401 without; no traceback either way."""
    caplog.set_level(logging.DEBUG)
    body = _completion_body()
    extra = f"Content-Encoding: {encoding}\r\n"
    data = _completion_head(body, extra, token=with_token) + b"\r\n" + body
    status, headers, raw = _exchange_with_front(model_dir, tmp_path, data)
    assert status == (415 if with_token else 401), raw
    assert headers["content-type"].startswith("application/json")
    err = json.loads(raw)["error"]
    if with_token:
        assert err["type"] == "invalid_request_error", err
        assert err["code"] == "unsupported_media_type", err
    _no_error_logged(caplog)


def test_an_expectation_other_than_100_continue_is_an_openai_error(
    model_dir: Path, tmp_path: Path
) -> None:
    body = _completion_body()
    head = _completion_head(body)
    status, headers, raw = _exchange_with_front(
        model_dir, tmp_path, head + b"Expect: 999-x\r\n\r\n" + body
    )
    assert status == 417, raw
    assert headers["content-type"].startswith("application/json")
    err = json.loads(raw)["error"]
    assert err["code"] == "expectation_failed" and err["type"] == "invalid_request_error", err

    def continued(port: int) -> tuple[bytes, tuple[int, dict[str, str], bytes]]:
        """100-continue still works: the interim answer, then the body, then the answer."""
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(head + b"Expect: 100-continue\r\n\r\n")
            interim = b""
            while not interim.endswith(b"\r\n\r\n"):
                interim += sock.recv(1)
            sock.sendall(body)
            return interim, read_response(sock)

    from security.config import SecurityConfig

    security = SecurityConfig(auth_token_file=_tokens_file(tmp_path))

    async def scenario() -> tuple[bytes, tuple[int, dict[str, str], bytes]]:
        async with fake_cluster(model_dir, http_port=0, security=security) as c:
            return await asyncio.to_thread(continued, http_port(c))

    interim, (status, _, raw) = asyncio.run(scenario())
    assert interim.startswith(b"HTTP/1.1 100 Continue"), interim
    assert status == 200, raw


def test_a_bug_is_a_500_that_says_nothing_but_the_request_id(
    model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No exception text ever reaches a client: the 500 names the request id, and the log
    line with the traceback carries the same id."""
    from router.http import handlers

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("secret-internal-detail")

    monkeypatch.setattr(handlers, "completion_request", broken)
    caplog.set_level(logging.DEBUG)
    body = _completion_body()
    data = _completion_head(body) + b"\r\n" + body
    status, _, raw = _exchange_with_front(model_dir, tmp_path, data)
    assert status == 500, raw
    err = json.loads(raw)["error"]
    assert b"secret-internal-detail" not in raw and b"RuntimeError" not in raw, raw
    message = err["message"]
    assert message.startswith("internal router error (request ") and message.endswith(")"), err
    rid = message.removeprefix("internal router error (request ").removesuffix(")")
    logged = [r for r in caplog.records if rid in r.getMessage()]
    assert logged and logged[0].levelno == logging.ERROR and logged[0].exc_info is not None
    assert "secret-internal-detail" in logging.Formatter().format(logged[0])


def test_a_full_queue_refusal_over_http_names_the_request(model_dir: Path) -> None:
    async def scenario() -> None:
        async with (
            fake_cluster(model_dir, http_port=0, max_inflight=1, max_queued=0) as c,
            aiohttp.ClientSession() as s,
        ):
            c.prefill[0].hold_prefills()  # the one running request holds its slot
            url = f"http://127.0.0.1:{http_port(c)}/v1/completions"
            model = c.router.config.served_model_name
            held = asyncio.create_task(s.post(url, data=_completion_body(model)))
            while c.router.service.admission.running < 1:
                await asyncio.sleep(0.01)
            async with s.post(url, data=_completion_body(model)) as resp:
                assert resp.status == 429
                err = (await resp.json())["error"]
            assert "queue full" in err["message"] and "(request " in err["message"], err
            c.prefill[0].release_prefills()
            (await held).close()
            await c.assert_no_leaks()

    asyncio.run(scenario())


# -- issue 39: a body up to the cap holds the loop < 100 ms, whatever its shape and context ----

LONG_CONTEXT = 32768


@pytest.fixture
def long_context_model(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model folder with a 32K context: the body cap grows with the context (about
    13 MB here), and so would a parse on the loop."""
    out = tmp_path / "tiny-32k"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = LONG_CONTEXT
    (out / "config.json").write_text(json.dumps(config))
    return out


def _bodies(cap: int, model: str) -> dict[str, tuple[str, bytes]]:
    """Bodies just under `cap` bytes, each the most costly of its shape to parse: tiny chat
    messages (one object each), prompt token ids (one value each), one long string."""
    msg = {"role": "user", "content": "x"}
    n_msgs = (cap - 200) // (len(json.dumps(msg)) + 2) - 1
    n_ids = (cap - 200) // len("100, ") - 1
    return {
        "tiny-messages": (
            "/v1/chat/completions",
            json.dumps({"model": model, "messages": [msg] * n_msgs, "max_tokens": 4}).encode(),
        ),
        "token-ids": (
            "/v1/completions",
            json.dumps({"model": model, "prompt": [100] * n_ids, "max_tokens": 4}).encode(),
        ),
        "one-string": (
            "/v1/completions",
            json.dumps({"model": model, "prompt": "y" * (cap - 200), "max_tokens": 4}).encode(),
        ),
    }


@pytest.mark.parametrize("shape", ["tiny-messages", "token-ids", "one-string"])
def test_a_body_up_to_the_cap_does_not_stall_the_loop(long_context_model: Path, shape: str) -> None:
    """The issue's bodies (10 MB of 1-character chat messages stalled /health 3.3 s, a 12 MB
    token-id list 1.1 s): parsed, validated and translated off the loop, they are refused or
    served while the loop's longest stall (the router process's own CPU time, `LoopWatchdog`)
    stays under 100 ms; /health answers meanwhile."""

    async def scenario() -> None:
        async with (
            fake_cluster(long_context_model, http_port=0) as c,
            aiohttp.ClientSession() as s,
        ):
            cap = c.router.service.lifecycle.limits.max_json_body_bytes
            assert cap > 10 * 2**20, cap
            path, body = _bodies(cap, c.router.config.served_model_name)[shape]
            assert len(body) <= cap
            port = http_port(c)
            health = f"http://127.0.0.1:{port}/health"
            async with s.get(health) as resp:
                assert resp.status == 200
            dog = LoopWatchdog(tick_s=0.005)
            dog.start()
            try:
                post = SplitPost(port, path, body)
                await asyncio.to_thread(post.head_sent.wait, 60)
                post.release()
                done = asyncio.ensure_future(post.wait())
                while not done.done():  # the front answers others while it works on the body
                    async with s.get(health) as resp:
                        assert resp.status == 200
                    await asyncio.sleep(0.05)
                status, _, raw = await done
            finally:
                await dog.stop()
            assert dog.ticks > 0
            assert dog.max_stall_s < MAX_STALL_S, (
                f"loop stalled {dog.max_stall_s * 1e3:.1f} ms (wall {dog.max_wall_s * 1e3:.1f} ms)"
            )
            assert status in (200, 400), raw[:300]  # served, or refused naming the field
            if status == 400:
                assert json.loads(raw)["error"]["param"], raw[:300]
            await c.assert_no_leaks()

    asyncio.run(scenario())
