"""One leg of a request (see `router.flow`): one attempt to place it on workers — Reserve +
Prefill + Decode on a (P, D) pair, or Generate on a colocated worker — and how the calls'
failures are classified.

Runs in the router process, inside the `Generate` handler's task. A `Leg` owns everything of
its attempt: the workers that may hold the request (`holders`), the in-flight counts it adds
to the pool (dropped by `close`), the worker ids and the timings it measured (`LegReport`) and
the worker its stream comes from. The request (`flow.RequestRun`) owns its legs and reads them;
a leg never calls back into the request. Failure classes:

- before the leg's first token: `errors.Retryable` (UNAVAILABLE / no KV room) names the worker
  at fault — the one called, or the KV peer its answer blames (`trailers.FAILED_PEER`) — and the
  flow retries on other workers; anything else ends the request with its status;
- after it: `WorkerLost` (the stream failed with a code in `LOST`: the worker died, stopped or
  broke; or it froze: `freeze_watch.WorkerFrozen`) lets the flow move the request to another
  worker; anything else ends the request.

Every worker call, at every phase, runs under a `freeze_watch.FreezeWatch` on the workers it
waits on: `Reserve` (D), `Prefill` (P, and D, which its KV push goes into), `Decode` (D) and
`Generate` (the worker called; before its first chunk that is a hybrid decode worker's local
prefill). A watched worker silent for the leg's `stall_timeout_s` that does not answer a status
call is frozen (SIGSTOPped, hung): the call is cancelled and fails as a dead worker's would —
`Retryable` naming the frozen worker before the leg's first token, `WorkerLost` after — so the
request moves within the stall timeout, not at its deadline. A worker that answers (a long
step, a queue, a KV transfer still landing) keeps the call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TypeVar

import grpc

from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from proto.pdserve.v1.trailers import failed_peer
from router.errors import Retryable, RouterError, worker_error
from router.freeze_watch import FreezeWatch, UnaryCall, WorkerFrozen, watched_call
from router.hybrid import PathChoice
from router.policy import WorkerView
from router.pool import WorkerPool
from router.request_trace import worker_call
from router.validation import ValidatedRequest
from router.wire import worker_sampling
from tracing.spans import NO_SPAN, Span

Chunks = AsyncGenerator[worker_pb2.TokenChunk]
T = TypeVar("T")

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
class LegSpec:
    """What one placement of the request asks of its workers: `prompt` (the client's prompt,
    plus the tokens already sent after a migration), the tokens still to generate and how many
    were sampled before (`WorkerSampling.num_sampled`)."""

    prompt: tuple[int, ...]
    max_tokens: int
    num_sampled: int = 0

    def sampling(self, req: ValidatedRequest) -> worker_pb2.WorkerSampling:
        s = worker_sampling(req.sampling)
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


@dataclass
class LegReport:
    """What one leg measured (milliseconds) and where it ran; the request reports its first
    leg's timings and its latest leg's workers in the final message."""

    prefill_worker: str = ""
    decode_worker: str = ""
    cached_tokens: int = 0
    prefill_queue_ms: float = 0.0
    prefill_compute_ms: float = 0.0
    kv_transfer_ms: float = 0.0
    decode_admission_ms: float = 0.0
    first_decode_step_ms: float = 0.0
    prefill_path: str = ""  # disagg: "remote" (prefill worker) or "local" (on D); "" colocated
    path_reason: str = ""  # why (`router.hybrid.PathReason`)


class Leg:
    """One attempt to place a request on workers (module docstring). Create one per attempt;
    `close()` it when it ends, whatever happened (idempotent).

    `holders`: the workers that may hold blocks or state of this request for this leg (each
    must get an Abort if the request ends early); a worker leaves it when it released the
    request itself (a finished stream, a Reserve that reserved nothing, a Prefill answered).
    `placed`: every worker this leg sent the request to, in order (the soak's blast radius reads
    it through `RequestRun.placed_on`)."""

    def __init__(
        self,
        request_id: str,
        spec: LegSpec,
        req: ValidatedRequest,
        pool: WorkerPool,
        deadline: float,
        stall_timeout_s: float = 3.0,
        span: Span = NO_SPAN,
    ) -> None:
        """`span`: where this leg's worker calls put their client spans (the request's root,
        or a migration's span); each call carries its span's W3C context to the worker."""
        self.request_id = request_id
        self.span = span
        self.spec = spec
        self.req = req
        self.pool = pool
        self.deadline = deadline  # loop.time() by which everything must be over
        self.stall_timeout_s = stall_timeout_s  # a silent worker: is it frozen?
        self.holders: set[str] = set()
        self.placed: list[str] = []
        self.report = LegReport()
        self.streaming_from = ""  # the worker whose stream feeds the client ("" before)
        self._tracking = contextlib.ExitStack()

    def remaining(self) -> float:
        """Seconds left before the deadline; raises DEADLINE_EXCEEDED when none are."""
        left = self.deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline passed")
        return left

    def close(self) -> None:
        """Drop this leg's in-flight counts on its workers."""
        self._tracking.close()

    def _place_on(self, address: str) -> None:
        if address not in self.placed:
            self.placed.append(address)

    def take_path(self, choice: PathChoice) -> None:
        """The prefill path the router chose for this leg (`router.hybrid`), for its report."""
        self.report.prefill_path, self.report.path_reason = choice.path, choice.reason

    def give_up(self) -> list[str]:
        """The leg failed before anything reached the client: every worker that may still
        hold it (sorted; the caller aborts them), and from now on none."""
        holders = sorted(self.holders)
        self.holders.clear()
        return holders

    def release(self, address: str) -> bool:
        """`address` no longer holds this leg (it failed, or was aborted by the caller);
        whether it did."""
        held = address in self.holders
        self.holders.discard(address)
        return held

    async def blame(
        self, exc: grpc.aio.AioRpcError, what: str, address: str, peer_address: str = ""
    ) -> str:
        """Mark the worker at fault for an UNAVAILABLE call unhealthy (until its next good
        poll) and return its address: the worker called, or, when its answer names its KV
        peer as the one that failed (`trailers.FAILED_PEER`), that peer at `peer_address`."""
        culprit = address
        if peer_address and failed_peer(exc.trailing_metadata()) is not None:
            culprit = peer_address
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            await self.pool.report_failure(culprit, f"{what} on {address}: {exc.details()}")
        return culprit

    async def reserve_and_prefill(self, p: WorkerView, d: WorkerView, cached: int) -> Chunks:
        """Reserve on D, Prefill on P; the leg's chunk stream (first token, then Decode on D)."""
        spec, report = self.spec, self.report
        report.prefill_worker, report.decode_worker = p.worker_id, d.worker_id
        sampling = spec.sampling(self.req)
        d_stub, p_stub = self.pool.stub(d.address), self.pool.stub(p.address)
        self._place_on(p.address)
        self._place_on(d.address)
        self._tracking.enter_context(self.pool.track(d.address))  # D is busy until the end
        # P's prompt counts on P from the choice, not from its Prefill call: requests routed
        # while this Reserve is out must see it (else a clump of them can all pick one P).
        with (
            self.pool.track(p.address),
            self.pool.track_prefill(p.address, len(spec.prompt), cached),
        ):
            return await self._reserve_then_prefill(p, d, d_stub, p_stub, sampling)

    async def _reserve_then_prefill(
        self,
        p: WorkerView,
        d: WorkerView,
        d_stub: worker_pb2_grpc.WorkerStub,
        p_stub: worker_pb2_grpc.WorkerStub,
        sampling: worker_pb2.WorkerSampling,
    ) -> Chunks:
        """`reserve_and_prefill`'s calls, with P already counting the prompt."""
        spec, report = self.spec, self.report
        # D may hold blocks as soon as Reserve reaches it, before its answer reaches us: a
        # cancel from here on must still send D an Abort.
        self.holders.add(d.address)
        span = worker_call(self.span, "Reserve", d.address, d.worker_id)
        try:
            left = self.remaining()
            reserve = d_stub.Reserve(
                worker_pb2.ReserveRequest(
                    request_id=self.request_id,
                    num_prompt_tokens=len(spec.prompt),
                    max_tokens=spec.max_tokens,
                    timeout_s=left,
                ),
                timeout=left,
                metadata=span.headers() or None,
            )
            reserved = await self._watched(reserve, [d.address])
        except WorkerFrozen as frozen:  # D may hold blocks: it stays in `holders`
            span.fail("WorkerFrozen", frozen.why)
            raise _retry_without(
                frozen,
                f"Reserve on decode worker {d.address}",
                "Reserve on a decode worker failed (UNAVAILABLE)",
            ) from frozen
        except grpc.aio.AioRpcError as exc:
            _failed(span, exc)
            if exc.code() in NOTHING_RESERVED:
                self.holders.discard(d.address)
            await self.blame(exc, "Reserve", d.address)
            err = worker_error(
                exc, f"Reserve on decode worker {d.address}", "Reserve on a decode worker"
            )
            if err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise Retryable(err.code, err.message, d.address, err.public) from exc
            raise err from exc
        finally:
            span.end()
        self.holders.add(p.address)
        span = worker_call(self.span, "Prefill", p.address, p.worker_id)
        what = f"Prefill on prefill worker {p.address}"
        try:
            left = self.remaining()
            prefill = p_stub.Prefill(
                worker_pb2.PrefillRequest(
                    request_id=self.request_id,
                    prompt_token_ids=spec.prompt,
                    sampling=sampling,
                    ticket=reserved.ticket,
                    timeout_s=left,
                ),
                timeout=left,
                metadata=span.headers() or None,
            )
            # D too: a frozen D stalls P's KV push, and P's answer with it
            resp = await self._watched(prefill, [p.address, d.address])
        except WorkerFrozen as frozen:
            span.fail("WorkerFrozen", frozen.why)
            public = _prefill_public(frozen.address == d.address, "UNAVAILABLE")
            raise _retry_without(frozen, what, public) from frozen
        except grpc.aio.AioRpcError as exc:
            _failed(span, exc)
            culprit = await self.blame(exc, "Prefill", p.address, d.address)
            err = worker_error(exc, what, "Prefill on a prefill worker")
            if culprit == d.address and err.code == grpc.StatusCode.UNAVAILABLE:
                # P's KV push failed because D did: the decode worker's failure, not P's
                err = RouterError(err.code, err.message, _prefill_public(True, err.code.name))
            if err.code == grpc.StatusCode.UNAVAILABLE:
                raise Retryable(err.code, err.message, culprit, err.public) from exc
            raise err from exc
        finally:
            span.end()
        self.holders.discard(p.address)  # P frees its blocks once the transfer result is known
        report.prefill_queue_ms, report.prefill_compute_ms = resp.queue_ms, resp.compute_ms
        report.kv_transfer_ms = resp.transfer_ms
        report.cached_tokens = resp.cached_tokens
        first = worker_pb2.TokenChunk(
            token_ids=[resp.first_token],
            finished=resp.finished,
            finish_reason=(resp.finish_reason or "length") if resp.finished else "",
            logprobs=[resp.first_logprob] if resp.HasField("first_logprob") else [],
        )
        decode = worker_pb2.DecodeRequest(
            request_id=self.request_id,
            transfer_id=reserved.ticket.transfer_id,
            first_token=resp.first_token,
            prompt_token_ids=spec.prompt,
            sampling=sampling,
        )
        return self._decode_stream(first, d.address, decode)

    async def start_colocated(self, w: WorkerView, cached: int = 0) -> Chunks:
        """Start `Generate` on `w` — a colocated worker, or a hybrid cluster's decode worker
        prefilling locally, expected to hold `cached` prompt tokens — and wait for its first
        chunk (retryable until then); the leg's chunk stream."""
        report = self.report
        report.prefill_worker = report.decode_worker = w.worker_id
        self.holders.add(w.address)
        self._place_on(w.address)
        self._tracking.enter_context(self.pool.track(w.address))
        left = self.remaining()
        span = worker_call(self.span, "Generate", w.address, w.worker_id)
        call = self.pool.stub(w.address).Generate(
            worker_pb2.WorkerGenerateRequest(
                request_id=self.request_id,
                prompt_token_ids=self.spec.prompt,
                sampling=self.spec.sampling(self.req),
                timeout_s=left,
            ),
            timeout=left,
            metadata=span.headers() or None,
        )
        stream = _spanned(self._chunks_of(call, w.address), span)
        try:
            with self.pool.track_prefill(w.address, len(self.spec.prompt), cached):
                first = await anext(stream)
        except WorkerFrozen as frozen:
            what = f"Generate on {w.role} worker {w.address}"
            raise _retry_without(
                frozen, what, "Generate on a worker failed (UNAVAILABLE)"
            ) from frozen
        except StreamFailed as failed:
            await self.blame(failed.exc, "Generate", w.address)
            err = worker_error(
                failed.exc, f"Generate on {w.role} worker {w.address}", "Generate on a worker"
            )
            if err.code == grpc.StatusCode.UNAVAILABLE:
                raise Retryable(err.code, err.message, w.address, err.public) from failed.exc
            raise err from failed.exc
        except StopAsyncIteration:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "colocated stream was empty") from None
        except asyncio.CancelledError:
            await stream.aclose()  # cancels the worker call now, not at garbage collection
            raise
        report.prefill_queue_ms, report.prefill_compute_ms = first.admission_ms, first.first_step_ms
        report.cached_tokens = first.cached_tokens
        self.streaming_from = w.address

        async def rest() -> Chunks:
            async with contextlib.aclosing(stream):
                yield first
                async for chunk in self._lost_on_failure(stream, "Generate", w.address):
                    yield chunk

        return rest()

    async def _decode_stream(
        self, first: worker_pb2.TokenChunk, addr: str, request: worker_pb2.DecodeRequest
    ) -> Chunks:
        """The leg's first token, then (unless it ended the request: D then gets an Abort from
        `holders`) the Decode stream on the reserved decode worker."""
        yield first
        if first.finished:
            return
        self.streaming_from = addr
        left = self.remaining()
        request.timeout_s = left
        span = worker_call(self.span, "Decode", addr, self.report.decode_worker)
        call = self.pool.stub(addr).Decode(request, timeout=left, metadata=span.headers() or None)
        head = True
        chunks = self._lost_on_failure(_spanned(self._chunks_of(call, addr), span), "Decode", addr)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if head:
                    self.report.decode_admission_ms = chunk.admission_ms
                    self.report.first_decode_step_ms = chunk.first_step_ms
                head = False
                yield chunk

    async def _lost_on_failure(self, chunks: Chunks, what: str, addr: str) -> Chunks:
        """`chunks`, turning a failure the request can survive on another worker (`LOST`) into
        `WorkerLost` and any other into the client's status."""
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield chunk
        except WorkerFrozen as frozen:  # already marked unhealthy by the status call
            raise WorkerLost(addr, f"{what} on worker {addr}: {frozen.why}") from frozen
        except StreamFailed as failed:
            await self.blame(failed.exc, what, addr)
            err = worker_error(failed.exc, f"{what} on worker {addr}", f"{what} on a worker")
            if failed.exc.code() in LOST:
                raise WorkerLost(addr, err.message, err.public) from failed.exc
            raise err from failed.exc

    async def _chunks_of(
        self, call: grpc.aio.UnaryStreamCall[object, worker_pb2.TokenChunk], addr: str
    ) -> Chunks:
        """Iterate a worker stream; cancel the call if the consumer stops early. Raises
        `StreamFailed` when the call fails, `WorkerFrozen` when its worker froze (see the
        module docstring: a `FreezeWatch` beside the stream)."""
        watch = FreezeWatch(
            self.pool, call, [addr], self.stall_timeout_s, f"{self.request_id}@{addr}"
        )
        try:
            async for chunk in call:
                watch.progress()
                if chunk.finished:
                    self.holders.discard(addr)  # the worker released the request itself
                yield chunk
                if chunk.finished:
                    return
        except asyncio.CancelledError:
            frozen = watch.cancelled_by_me()
            if frozen is None:
                raise  # this task was cancelled (deadline, client), not the call by the watch
            raise frozen from None
        except grpc.aio.AioRpcError as exc:
            if watch.frozen is not None:
                raise watch.frozen from exc
            raise StreamFailed(exc) from exc
        finally:
            watch.stop()
            call.cancel()

    async def _watched(self, call: UnaryCall[T], watched: list[str]) -> T:
        """A unary worker call's answer, under a `FreezeWatch` on `watched`."""
        name = f"{self.request_id}@{'+'.join(watched)}"
        return await watched_call(self.pool, call, watched, self.stall_timeout_s, name)


def _retry_without(frozen: WorkerFrozen, what: str, public: str) -> Retryable:
    """A call (`what`) that a frozen worker ended before the leg's first token: UNAVAILABLE,
    retried on workers without it (`public`: what the client reads, no address)."""
    return Retryable(grpc.StatusCode.UNAVAILABLE, f"{what}: {frozen.why}", frozen.address, public)


def _failed(span: Span, exc: grpc.aio.AioRpcError) -> None:
    """Mark a worker call's span failed with the call's status."""
    if span.recording:
        span.fail(exc.code().name, exc.details() or "")


def _spanned(chunks: Chunks, span: Span) -> Chunks:
    """`chunks`, with `span` ended when the stream ends (its tokens counted; failed with the
    worker's status, `WorkerFrozen` or a cancel); `chunks` itself when `span` records nothing
    (tracing off, or the request not sampled: no extra layer per chunk)."""
    return _recorded(chunks, span) if span.recording else chunks


async def _recorded(chunks: Chunks, span: Span) -> Chunks:
    tokens = 0
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                tokens += len(chunk.token_ids)
                yield chunk
    except StreamFailed as failed:
        _failed(span, failed.exc)
        raise
    except (WorkerFrozen, asyncio.CancelledError) as exc:
        span.fail(type(exc).__name__, str(exc))
        raise
    finally:
        span.set({"pdserve.tokens": tokens})
        span.end()


class StreamFailed(Exception):
    """A worker stream failed; carries the grpc error out of the chunk iterator."""

    def __init__(self, exc: grpc.aio.AioRpcError) -> None:
        super().__init__(str(exc))
        self.exc = exc


def _prefill_public(decode_failed: bool, code: str) -> str:
    """What the client reads of a failed Prefill: the decode worker's failure when P's KV push
    failed because D died or froze (it is D the request moves away from), else P's."""
    if decode_failed:
        return f"a decode worker failed while receiving the prompt's KV ({code})"
    return f"Prefill on a prefill worker failed ({code})"
