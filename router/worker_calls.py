"""The worker calls of one leg of a request (see `router.flow`): Reserve + Prefill + Decode on a
(P, D) pair, or Generate on a colocated worker, and how their failures are classified.

Runs in the router process, inside the `Generate` handler's task, on behalf of a
`flow.RequestRun` (its holders, in-flight tracking, facts and deadline). Failure classes:

- before the leg's first token: `errors.Retryable` (UNAVAILABLE / no KV room) names the worker
  at fault — the one called, or the KV peer its answer blames (`trailers.FAILED_PEER`) — and the
  flow retries on other workers; anything else ends the request with its status;
- after it: `WorkerLost` (the stream failed with a code in `LOST`: the worker died, stopped or
  broke; or it froze: `StreamStalled`) lets the flow move the request to another worker;
  anything else ends the request.

A worker stream that brings nothing for `RequestRun.stall_timeout_s` has its worker asked for
its status (`WorkerPool.answers`); a worker that does not answer is frozen (SIGSTOPped, hung)
and its stream ends `StreamStalled`, as a dead worker's would fail; one that answers (a long
step, a queue, a KV transfer still landing) keeps the stream, and the watch starts over.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from proto.pdserve.v1 import worker_pb2
from proto.pdserve.v1.trailers import failed_peer
from router.errors import Retryable, RouterError, worker_error
from router.policy import WorkerView
from router.validation import ValidatedRequest

if TYPE_CHECKING:
    from router.flow import RequestRun

Chunks = AsyncGenerator[worker_pb2.TokenChunk]

# Reserve answers after which the decode worker holds nothing for the request
NOTHING_RESERVED = frozenset(
    {
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
# A worker stream that fails with one of these after tokens were sent moves the request: the
# worker died, stopped (drain timeout) or broke. Not a deadline, a capacity refusal, an explicit
# Abort (ABORTED) or a request the worker refused as invalid.
LOST = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
    }
)


@dataclass(frozen=True)
class Leg:
    """What one placement of the request asks of its workers: `prompt` (the client's prompt,
    plus the tokens already sent after a migration), the tokens still to generate and how many
    were sampled before (`WorkerSampling.num_sampled`)."""

    prompt: tuple[int, ...]
    max_tokens: int
    num_sampled: int = 0

    def sampling(self, req: ValidatedRequest) -> worker_pb2.WorkerSampling:
        s = req.worker_sampling()
        s.max_tokens, s.num_sampled = self.max_tokens, self.num_sampled
        s.min_tokens = max(0, s.min_tokens - self.num_sampled)  # counted from the leg's start
        return s


class WorkerLost(Exception):
    """The worker streaming a request's tokens failed after some reached the client."""

    def __init__(
        self, address: str, message: str, public: str = "a worker failed mid-stream"
    ) -> None:
        super().__init__(message)
        self.address = address
        self.message = message
        self.public = public  # for the client: no address (`errors.RouterError.public`)


async def blame(
    run: RequestRun,
    exc: grpc.aio.AioRpcError,
    what: str,
    address: str,
    peer_address: str = "",
) -> str:
    """Mark the worker at fault for an UNAVAILABLE call unhealthy (until its next good poll)
    and return its address: the worker called, or, when its answer names its KV peer as the one
    that failed (`trailers.FAILED_PEER`), that peer at `peer_address`."""
    culprit = address
    if peer_address and failed_peer(exc.trailing_metadata()) is not None:
        culprit = peer_address
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        await run.pool.report_failure(culprit, f"{what} on {address}: {exc.details()}")
    return culprit


async def reserve_and_prefill(
    run: RequestRun, leg: Leg, p: WorkerView, d: WorkerView, cached: int
) -> Chunks:
    """Reserve on D, Prefill on P; the leg's chunk stream (first token, then Decode on D)."""
    facts = run.client.facts
    facts.prefill_worker, facts.decode_worker = p.worker_id, d.worker_id
    sampling = leg.sampling(run.req)
    d_stub, p_stub = run.pool.stub(d.address), run.pool.stub(p.address)
    run.note_placed(p.address)
    run.track(d.address)  # D is busy until the end of the leg
    # D may hold blocks as soon as Reserve reaches it, before its answer reaches us: a cancel
    # from here on must still send D an Abort.
    run.holders.add(d.address)
    try:
        left = run.remaining()
        reserved = await d_stub.Reserve(
            worker_pb2.ReserveRequest(
                request_id=run.request_id,
                num_prompt_tokens=len(leg.prompt),
                max_tokens=leg.max_tokens,
                timeout_s=left,
            ),
            timeout=left,
        )
    except grpc.aio.AioRpcError as exc:
        if exc.code() in NOTHING_RESERVED:
            run.holders.discard(d.address)
        await blame(run, exc, "Reserve", d.address)
        err = worker_error(
            exc, f"Reserve on decode worker {d.address}", "Reserve on a decode worker"
        )
        if err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
            raise Retryable(err.code, err.message, d.address, err.public) from exc
        raise err from exc
    run.holders.add(p.address)
    try:
        with run.pool.track(p.address), run.pool.track_prefill(p.address, len(leg.prompt), cached):
            left = run.remaining()
            resp = await p_stub.Prefill(
                worker_pb2.PrefillRequest(
                    request_id=run.request_id,
                    prompt_token_ids=leg.prompt,
                    sampling=sampling,
                    ticket=reserved.ticket,
                    timeout_s=left,
                ),
                timeout=left,
            )
    except grpc.aio.AioRpcError as exc:
        culprit = await blame(run, exc, "Prefill", p.address, d.address)
        err = worker_error(
            exc, f"Prefill on prefill worker {p.address}", "Prefill on a prefill worker"
        )
        if err.code == grpc.StatusCode.UNAVAILABLE:
            raise Retryable(err.code, err.message, culprit, err.public) from exc
        raise err from exc
    run.holders.discard(p.address)  # P frees its blocks once the transfer result is known
    if not run.migrations:
        t = run.timings
        t.prefill_queue_ms, t.prefill_compute_ms = resp.queue_ms, resp.compute_ms
        t.kv_transfer_ms = resp.transfer_ms
        facts.cached_tokens = resp.cached_tokens
    first = worker_pb2.TokenChunk(
        token_ids=[resp.first_token],
        finished=resp.finished,
        finish_reason=(resp.finish_reason or "length") if resp.finished else "",
        logprobs=[resp.first_logprob] if resp.HasField("first_logprob") else [],
    )
    decode = worker_pb2.DecodeRequest(
        request_id=run.request_id,
        transfer_id=reserved.ticket.transfer_id,
        first_token=resp.first_token,
        prompt_token_ids=leg.prompt,
        sampling=sampling,
    )
    return decode_stream(run, first, d.address, decode)


async def start_colocated(run: RequestRun, leg: Leg, w: WorkerView) -> Chunks:
    """Start `Generate` on `w` and wait for its first chunk (retryable until then); the leg's
    chunk stream."""
    facts = run.client.facts
    facts.prefill_worker = facts.decode_worker = w.worker_id
    run.holders.add(w.address)
    run.track(w.address)
    left = run.remaining()
    call = run.pool.stub(w.address).Generate(
        worker_pb2.WorkerGenerateRequest(
            request_id=run.request_id,
            prompt_token_ids=leg.prompt,
            sampling=leg.sampling(run.req),
            timeout_s=left,
        ),
        timeout=left,
    )
    stream = chunks_of(run, call, w.address)
    try:
        with run.pool.track_prefill(w.address, len(leg.prompt), 0):
            first = await anext(stream)
    except StreamStalled as stalled:
        raise Retryable(grpc.StatusCode.UNAVAILABLE, str(stalled), w.address) from stalled
    except StreamFailed as failed:
        await blame(run, failed.exc, "Generate", w.address)
        err = worker_error(
            failed.exc, f"Generate on colocated worker {w.address}", "Generate on a worker"
        )
        if err.code == grpc.StatusCode.UNAVAILABLE:
            raise Retryable(err.code, err.message, w.address, err.public) from failed.exc
        raise err from failed.exc
    except StopAsyncIteration:
        raise RouterError(grpc.StatusCode.UNAVAILABLE, "colocated stream was empty") from None
    except asyncio.CancelledError:
        await stream.aclose()  # cancels the worker call now, not at garbage collection
        raise
    if not run.migrations:
        t = run.timings
        t.prefill_queue_ms, t.prefill_compute_ms = first.admission_ms, first.first_step_ms
        facts.cached_tokens = first.cached_tokens

    run.streaming_from = w.address

    async def rest() -> Chunks:
        async with contextlib.aclosing(stream):
            yield first
            async for chunk in lost_on_failure(run, stream, "Generate", w.address):
                yield chunk

    return rest()


async def decode_stream(
    run: RequestRun, first: worker_pb2.TokenChunk, addr: str, request: worker_pb2.DecodeRequest
) -> Chunks:
    """The leg's first token, then (unless it ended the request: D then gets an Abort from
    `holders`) the Decode stream on the reserved decode worker."""
    yield first
    if first.finished:
        return
    run.streaming_from = addr
    left = run.remaining()
    request.timeout_s = left
    call = run.pool.stub(addr).Decode(request, timeout=left)
    head = True
    chunks = lost_on_failure(run, chunks_of(run, call, addr), "Decode", addr)
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            if head and not run.migrations:
                t = run.timings
                t.decode_admission_ms = chunk.admission_ms
                t.first_decode_step_ms = chunk.first_step_ms
            head = False
            yield chunk


async def lost_on_failure(run: RequestRun, chunks: Chunks, what: str, addr: str) -> Chunks:
    """`chunks`, turning a failure the request can survive on another worker (`LOST`) into
    `WorkerLost` and any other into the client's status."""
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk
    except StreamStalled as stalled:  # already marked unhealthy by the status call
        raise WorkerLost(addr, f"{what} on worker {addr}: {stalled}") from stalled
    except StreamFailed as failed:
        await blame(run, failed.exc, what, addr)
        err = worker_error(failed.exc, f"{what} on worker {addr}", f"{what} on a worker")
        if failed.exc.code() in LOST:
            raise WorkerLost(addr, err.message, err.public) from failed.exc
        raise err from failed.exc


async def chunks_of(
    run: RequestRun, call: grpc.aio.UnaryStreamCall[object, worker_pb2.TokenChunk], addr: str
) -> Chunks:
    """Iterate a worker stream; cancel the call if the consumer stops early. Raises
    `StreamFailed` when the call fails, `StreamStalled` when its worker froze (see the module
    docstring: a `_StallWatch` beside the stream)."""
    watch = _StallWatch(run, call, addr)
    try:
        async for chunk in call:
            watch.progress()
            if chunk.finished:
                run.holders.discard(addr)  # the worker released the request itself
            yield chunk
            if chunk.finished:
                return
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if watch.frozen is None or (task is not None and task.cancelling()):
            raise  # this task was cancelled (deadline, client), not the call by the watch
        raise StreamStalled(watch.frozen) from None
    except grpc.aio.AioRpcError as exc:
        if watch.frozen is not None:
            raise StreamStalled(watch.frozen) from exc
        raise StreamFailed(exc) from exc
    finally:
        watch.stop()
        call.cancel()


class _StallWatch:
    """One task beside a worker stream: when nothing came for `run.stall_timeout_s`, it asks
    the worker for its status; no answer: `frozen` says why and the call is cancelled (the
    stream's reader turns that into `StreamStalled`); an answer: the wait starts over. Costs
    the stream one clock read per message."""

    def __init__(
        self,
        run: RequestRun,
        call: grpc.aio.UnaryStreamCall[object, worker_pb2.TokenChunk],
        addr: str,
    ) -> None:
        self._run, self._call, self._addr = run, call, addr
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self.frozen: str | None = None
        self._task = asyncio.create_task(self._watch(), name=f"stall-watch-{run.request_id}")

    def progress(self) -> None:
        self._last = self._loop.time()

    def stop(self) -> None:
        self._task.cancel()

    async def _watch(self) -> None:
        stall = self._run.stall_timeout_s
        answered = self._last  # when the worker last answered a status call
        while True:
            left = max(self._last, answered) + stall - self._loop.time()
            if left > 0:
                await asyncio.sleep(left)
                continue
            if await self._run.pool.answers(self._addr):
                answered = self._loop.time()  # alive (busy, queueing): start over
                continue
            silent = self._loop.time() - self._last
            self.frozen = f"nothing for {silent:.1f} s and no answer to a status call: frozen"
            self._call.cancel()
            return


class StreamStalled(Exception):
    """A worker stream brought nothing for a while and its worker did not answer: frozen."""


class StreamFailed(Exception):
    """A worker stream failed; carries the grpc error out of the chunk iterator."""

    def __init__(self, exc: grpc.aio.AioRpcError) -> None:
        super().__init__(str(exc))
        self.exc = exc
