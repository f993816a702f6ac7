"""The soak's client side: send one planned request over the public gRPC API and record how it
ended; `run_load` sends a whole plan open-loop. Runs in the soak process, on its event loop.

Every request is watched by its own clock: a request still open `hang_grace_s` after its
deadline (its client deadline, else the router's default) is cancelled and recorded as `hung`.
Its longest wait is recorded too (`Outcome.waited_s`, `longest_wait`): the longest time the
client heard nothing, less the work the router's final timings account for, so a request that
sat on a frozen worker shows it even when it then completed.
A client cancel (after k tokens, or after a delay) is the client's own doing: it is recorded as
`CANCELLED` with `client_cancelled` set. Nothing here judges the tokens (see `check`).

The hostile HTTP kinds go to the router's HTTP front on plain sockets: `oversized` posts a chat
body of `oversized_mb` MiB and records the status as ``HTTP_<status>`` with the error's
``param`` as `details`; `disconnect` posts a streaming completion and resets the connection
(SO_LINGER 0) once the first event arrived — `CANCELLED` with `client_cancelled` — or records a
refusal before that under the gRPC name of its HTTP status.

A burst's requests are held by a `BurstGate`: they ask for many tokens, and the client cancels
them (`CANCELLED`, `client_cancelled`) once the router has decided the whole burst, so the
burst's admitted requests still hold their slots when its last request reaches the router,
however long that takes on this machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from proto.pdserve.v1 import inference_pb2, inference_pb2_grpc
from tooling.soak.workload import HTTP_KINDS, PlannedRequest

CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0), ("grpc.use_local_subchannel_pool", 1)]


@dataclass
class Outcome:
    """How one request ended. Times are seconds after the load started."""

    index: int
    sent_at: float
    deadline_s: float  # the request's deadline, counted from `sent_at`
    ended_at: float = 0.0
    code: str = ""  # "OK" or a grpc status name
    details: str = ""
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    prefill_worker: str = ""
    decode_worker: str = ""
    client_cancelled: bool = False
    hung: bool = False
    workers: list[str] = field(default_factory=list)  # worker ids it was placed on (router)
    waited_s: float = 0.0  # the longest silence beyond its own work (`longest_wait`)

    @property
    def latency_s(self) -> float:
        return self.ended_at - self.sent_at


def longest_wait(
    sent_at: float,
    arrivals: Sequence[float],
    ended_at: float,
    timings: inference_pb2.Timings | None = None,
) -> float:
    """The longest time a request's client heard nothing — between sending, each message with
    tokens and the end — less the request's own work where the router's `timings` measured it:
    before the first token, its queueing in the router and on the prefill worker, the prefill
    and the KV transfer; before the second message, the decode worker's admission and first
    step. What is left is time spent waiting on the cluster (a frozen worker, a retry)."""
    marks = [sent_at, *arrivals, ended_at]
    gaps = [b - a for a, b in itertools.pairwise(marks)]
    if timings is not None and arrivals:
        t = timings
        gaps[0] -= (
            t.router_queue_ms + t.prefill_queue_ms + t.prefill_compute_ms + t.kv_transfer_ms
        ) / 1e3
        if len(gaps) > 1:
            gaps[1] -= (t.decode_admission_ms + t.first_decode_step_ms) / 1e3
    return max(0.0, *gaps)


def build_request(r: PlannedRequest) -> inference_pb2.GenerateRequest:
    """The wire request of `r` (every sampling field set explicitly)."""
    sp = inference_pb2.SamplingParams(
        max_tokens=r.max_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        stop_token_ids=list(r.stop_token_ids),
        stop=list(r.stop),
        ignore_eos=r.ignore_eos,
    )
    if r.seed is not None:
        sp.seed = r.seed
    req = inference_pb2.GenerateRequest(request_id=r.request_id, sampling=sp)
    if r.token_ids is not None:
        req.token_ids.ids.extend(r.token_ids)
    else:
        req.text = r.text or ""
    return req


class BurstGate:
    """Holds one burst's requests until the router has decided all of them, then ends them.

    A burst proves admission control only while its admitted requests hold their slots: the
    router accepts calls one at a time on its event loop, so a burst "sent at one instant"
    reaches admission over a span that depends on the machine, and admitted requests that
    finished inside that span would let the rest in. So burst requests ask for many tokens,
    and none is let go before the gate opens.

    The router runs at most `max_inflight` and queues at most `max_queued`; the rest of the
    burst is refused. The gate opens once the client has seen that: `size - max_inflight -
    max_queued` refusals, or `size - max_queued` requests *seen* (first response arrived, or
    ended any way; only queued ones stay unseen). Either means every request of the burst has
    reached admission, give or take the slots that requests running before the burst freed
    to it. When it opens, every started request still open is cancelled; one whose first
    response comes later is cancelled then.

    Runs on the soak's event loop (no locks)."""

    def __init__(self, size: int, max_inflight: int, max_queued: int) -> None:
        if size <= max_inflight + max_queued:
            raise ValueError(
                f"a burst of {size} must exceed what the router admits "
                f"({max_inflight} running + {max_queued} queued)"
            )
        self._refusals_needed = size - max_inflight - max_queued
        self._seen_needed = size - max_queued
        self._seen: set[int] = set()
        self._refused = 0
        self._holding: dict[int, Callable[[], None]] = {}  # index -> cancel: started, open
        self.is_open = False

    def started(self, index: int, cancel: Callable[[], None]) -> None:
        """Request `index` got its first response; `cancel` ends it (now, if the gate is open)."""
        if self.is_open:
            cancel()
        else:
            self._holding[index] = cancel
        self._see(index)

    def ended(self, index: int, code: str) -> None:
        """Request `index` ended with `code` (a grpc status name, or "OK")."""
        self._holding.pop(index, None)
        if code == "RESOURCE_EXHAUSTED":
            self._refused += 1
        self._see(index)

    def _see(self, index: int) -> None:
        self._seen.add(index)
        decided = self._refused >= self._refusals_needed or len(self._seen) >= self._seen_needed
        if decided and not self.is_open:
            self.is_open = True
            holding, self._holding = self._holding, {}
            for cancel in holding.values():
                cancel()


async def send_one(
    stub: inference_pb2_grpc.InferenceStub,
    r: PlannedRequest,
    t0: float,
    default_timeout_s: float,
    hang_grace_s: float,
    gate: BurstGate | None = None,
) -> Outcome:
    """Send `r` now and follow it to its end (never raises for the request's own failure).
    A burst request is held by its `gate` (class docstring)."""
    deadline = r.timeout_s if r.timeout_s is not None else default_timeout_s
    out = Outcome(r.index, time.monotonic() - t0, deadline)
    call = stub.Generate(build_request(r), timeout=r.timeout_s)

    def cancel() -> None:
        if not call.done():
            out.client_cancelled = True
            call.cancel()

    timer = (
        asyncio.get_running_loop().call_later(r.cancel_after_s, cancel)
        if (r.cancel_after_s is not None)
        else None
    )
    started = False
    arrivals: list[float] = []
    timings: inference_pb2.Timings | None = None
    try:
        async with asyncio.timeout(deadline + hang_grace_s):
            async for resp in call:
                if gate is not None and not started:
                    started = True
                    gate.started(r.index, cancel)
                if resp.token_ids:
                    arrivals.append(time.monotonic() - t0)
                out.tokens += resp.token_ids
                out.text += resp.text
                if resp.HasField("final"):
                    f = resp.final
                    out.finish_reason = f.finish_reason
                    out.prefill_worker, out.decode_worker = f.prefill_worker, f.decode_worker
                    timings = f.timings
                n = r.cancel_after_tokens
                if n is not None and len(out.tokens) >= n and not out.finish_reason:
                    cancel()
                    break
        out.code = "CANCELLED" if out.client_cancelled and not out.finish_reason else "OK"
    except TimeoutError:
        out.hung = True
        out.code = "HUNG"
        call.cancel()
    except asyncio.CancelledError:
        if not out.client_cancelled:
            raise  # the soak itself is being torn down
        out.code = "CANCELLED"
    except grpc.aio.AioRpcError as exc:
        out.code = "CANCELLED" if out.client_cancelled else exc.code().name
        out.details = exc.details() or ""
    finally:
        if timer is not None:
            timer.cancel()
        out.ended_at = time.monotonic() - t0
        out.waited_s = longest_wait(out.sent_at, arrivals, out.ended_at, timings)
        if gate is not None:
            gate.ended(r.index, out.code)
    return out


@dataclass(frozen=True)
class HttpFront:
    """Where the hostile HTTP requests go: the router's HTTP front and its served model."""

    host: str
    port: int
    model: str


HTTP_TO_GRPC = {429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def oversized_chat_body(megabytes: int) -> bytes:
    """A chat body whose one message is `megabytes` MiB of text."""
    unit = "The river flows "
    content = unit * (megabytes * 2**20 // len(unit))
    body = {"model": "soak", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return json.dumps(body).encode()


def _head(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\nConnection: close\r\n\r\n"
    ).encode()


def _status_line(head: bytes) -> int:
    return int(head.split(b"\r\n", 1)[0].split()[1])


async def send_http(
    http: HttpFront, r: PlannedRequest, t0: float, oversized: bytes, timeout_s: float
) -> Outcome:
    """Send one hostile HTTP request (module docstring); never raises for its failure."""
    out = Outcome(r.index, time.monotonic() - t0, timeout_s)
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(http.host, http.port)
            if r.kind == "oversized":
                writer.write(_head("/v1/chat/completions", len(oversized)) + oversized)
                await writer.drain()
                head = await reader.readuntil(b"\r\n\r\n")
                body = await reader.read()
                out.code = f"HTTP_{_status_line(head)}"
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    out.details = str(json.loads(body)["error"]["param"])
            else:
                assert r.token_ids is not None
                req = {"model": http.model, "prompt": list(r.token_ids), "max_tokens": r.max_tokens,
                       "temperature": 0, "ignore_eos": r.ignore_eos, "stream": True}  # fmt: skip
                data = json.dumps(req).encode()
                writer.write(_head("/v1/completions", len(data)) + data)
                await writer.drain()
                head = await reader.readuntil(b"\r\n\r\n")
                status = _status_line(head)
                if status != 200:
                    out.code = HTTP_TO_GRPC.get(status, f"HTTP_{status}")
                    out.details = (await reader.read()).decode(errors="replace")[:200]
                else:
                    await reader.readuntil(b"data: ")  # the first event: now reset
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    writer = None
                    out.code, out.client_cancelled = "CANCELLED", True
    except TimeoutError:
        out.hung, out.code = True, "HUNG"
    except (OSError, asyncio.IncompleteReadError) as exc:
        out.code, out.details = "CONNECTION_ERROR", repr(exc)
    finally:
        if writer is not None:
            writer.close()
        out.ended_at = time.monotonic() - t0
    return out


async def run_load(
    address: str,
    requests: Sequence[PlannedRequest],
    default_timeout_s: float,
    hang_grace_s: float,
    on_sent: Callable[[PlannedRequest], None] | None = None,
    t0: float | None = None,
    channels: int = 4,
    http: HttpFront | None = None,
    oversized_mb: int = 10,
    router_admits: tuple[int, int] | None = None,
) -> list[Outcome]:
    """Send every request at its `at_s` after `t0` (now when None), open-loop; return the
    outcomes in plan order once every request has ended. `on_sent(r)` runs right after each
    send starts (the fault injector uses it to follow probes). The HTTP kinds go to `http`
    (host, port), which must be given when the plan has any; a plan with bursts needs
    `router_admits`, the router's (max_inflight, max_queued) (`BurstGate`; ValueError
    without it)."""
    sizes = Counter(r.burst for r in requests if r.burst is not None)
    gates: dict[int, BurstGate] = {}
    if sizes:
        if router_admits is None:
            raise ValueError("the plan has bursts: pass router_admits, what the router admits")
        gates = {b: BurstGate(n, *router_admits) for b, n in sizes.items()}
    oversized = b""
    if any(r.kind == "oversized" for r in requests):
        oversized = oversized_chat_body(oversized_mb)
    chans = [grpc.aio.insecure_channel(address, CHANNEL_OPTIONS) for _ in range(channels)]
    stubs = [inference_pb2_grpc.InferenceStub(c) for c in chans]  # type: ignore[no-untyped-call]
    start = time.monotonic() if t0 is None else t0
    tasks: list[asyncio.Task[Outcome]] = []
    try:
        for r in requests:
            delay = start + r.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if r.kind in HTTP_KINDS:
                assert http is not None, "the plan has HTTP requests: pass the HTTP front"
                coro = send_http(http, r, start, oversized, default_timeout_s + hang_grace_s)
            else:
                stub = stubs[r.index % len(stubs)]
                gate = gates.get(r.burst) if r.burst is not None else None
                coro = send_one(stub, r, start, default_timeout_s, hang_grace_s, gate)
            tasks.append(asyncio.create_task(coro, name=f"soak-{r.index}"))
            if on_sent is not None:
                on_sent(r)
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for c in chans:
            await c.close()
