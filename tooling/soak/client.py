"""The soak's client side: send one planned request over the public gRPC API and record how it
ended; `run_load` sends a whole plan open-loop. Runs in the soak process, on its event loop.

Every request is watched by its own clock: a request still open `hang_grace_s` after its
deadline (its client deadline, else the router's default) is cancelled and recorded as `hung`.
A client cancel (after k tokens, or after a delay) is the client's own doing: it is recorded as
`CANCELLED` with `client_cancelled` set. Nothing here judges the tokens (see `check`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from proto.pdserve.v1 import inference_pb2, inference_pb2_grpc
from tooling.soak.workload import PlannedRequest

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

    @property
    def latency_s(self) -> float:
        return self.ended_at - self.sent_at


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


async def send_one(
    stub: inference_pb2_grpc.InferenceStub,
    r: PlannedRequest,
    t0: float,
    default_timeout_s: float,
    hang_grace_s: float,
) -> Outcome:
    """Send `r` now and follow it to its end (never raises for the request's own failure)."""
    deadline = r.timeout_s if r.timeout_s is not None else default_timeout_s
    out = Outcome(r.index, time.monotonic() - t0, deadline)
    call = stub.Generate(build_request(r), timeout=r.timeout_s)

    def cancel() -> None:
        out.client_cancelled = True
        call.cancel()

    timer = (
        asyncio.get_running_loop().call_later(r.cancel_after_s, cancel)
        if (r.cancel_after_s is not None)
        else None
    )
    try:
        async with asyncio.timeout(deadline + hang_grace_s):
            async for resp in call:
                out.tokens += resp.token_ids
                out.text += resp.text
                if resp.HasField("final"):
                    f = resp.final
                    out.finish_reason = f.finish_reason
                    out.prefill_worker, out.decode_worker = f.prefill_worker, f.decode_worker
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
    return out


async def run_load(
    address: str,
    requests: Sequence[PlannedRequest],
    default_timeout_s: float,
    hang_grace_s: float,
    on_sent: Callable[[PlannedRequest], None] | None = None,
    t0: float | None = None,
    channels: int = 4,
) -> list[Outcome]:
    """Send every request at its `at_s` after `t0` (now when None), open-loop; return the
    outcomes in plan order once every request has ended. `on_sent(r)` runs right after each
    send starts (the fault injector uses it to follow probes)."""
    chans = [grpc.aio.insecure_channel(address, CHANNEL_OPTIONS) for _ in range(channels)]
    stubs = [inference_pb2_grpc.InferenceStub(c) for c in chans]  # type: ignore[no-untyped-call]
    start = time.monotonic() if t0 is None else t0
    tasks: list[asyncio.Task[Outcome]] = []
    try:
        for r in requests:
            delay = start + r.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            stub = stubs[r.index % len(stubs)]
            coro = send_one(stub, r, start, default_timeout_s, hang_grace_s)
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
