"""One request's life in the router, whatever the transport. Runs in the router process.

`RequestLifecycle.run(request, send, timeout_s)` is the one path every public request takes —
the gRPC `Generate` handler (`router.server`) and the OpenAI HTTP front (`router.http`) both
call it, so validation, admission, routing, abort and timing are the same for both:

1. admit into the bounded FIFO (`admission`): a running slot, a place in the queue, or
   RESOURCE_EXHAUSTED at once — decided first, before anything else is looked at, so a burst
   beyond the queue is shed for almost nothing;
2. validate and tokenize (`validation.validate_request`; text prompts on helper threads, never
   on the event loop): bad input raises `InvalidRequest` naming the field, before any worker is
   touched;
3. wait for the running slot, then run the worker calls (`flow.RequestRun`: route, Reserve ->
   Prefill -> Decode, or colocated, and migration off a decode worker that fails mid-stream);
   `client_stream.ClientStream` turns tokens into `GenerateResponse`s handed to the caller's
   `send` in order; the last carries `final` (finish reason, usage, timings);
4. end: return normally once the final message was sent, or raise `RouterError` with the
   request's status. A client that goes away cancels the caller's task: `asyncio.CancelledError`
   propagates after the same cleanup.

Deadline: `timeout_s` (the client's, e.g. a gRPC deadline) or else `config.default_timeout_s`;
passing it ends the request with DEADLINE_EXCEEDED.

Cleanup rule: whenever a request ends with workers still holding it (`RequestRun.holders`), an
`Abort(request_id)` goes to each of them from a task owned by this object, not by the caller's
task, so it still runs when the caller itself was cancelled.

Outcome hooks: every request that passed validation and ended with a status — OK or an error,
a full queue and a passed deadline included; not a client cancel — is reported once to the
optional `OutcomeObserver` (the ratio controller) with its TTFT, TPOT and end-to-end time as the
router saw them (`request_outcome`) and its prefill path (hybrid). Every request that reached
`run`, whatever its end, is reported once to the optional `RequestRecorder` (the router's
Prometheus metrics) as a `RequestRecord`. Both hooks run before the status goes out; they are
synchronous, and an exception one raises is logged, never sent to the client.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import grpc

from model_runtime.tokenizer import Tokenizer
from proto.pdserve.v1 import inference_pb2, worker_pb2
from router.admission import Admission, AdmissionPlace, Overloaded
from router.client_stream import ClientStream, FinalFacts, Send
from router.config import RouterConfig
from router.errors import InvalidRequest, RouterError
from router.flow import RequestRun
from router.hybrid import LiveThreshold
from router.policy import RoutingPolicy
from router.pool import WorkerPool
from router.prefix_index.guard import GuardedPrefixIndex
from router.request_trace import NEW_TRACE, RequestTrace, TraceStart
from router.validation import (
    MAX_REQUEST_ID_CHARS,
    DecodedRequest,
    ModelLimits,
    RequestValidationError,
    ValidatedRequest,
    check_not_in_flight,
    has_structured_output,
    validate_request,
)
from tracing.spans import NO_SPAN, NO_TRACER, Span, Tracer

log = logging.getLogger(__name__)

INLINE_PROMPT_IDS = 4096
"""A token-id prompt longer than this is checked on the tokenizer threads, not on the event
loop (one Python step per id: milliseconds per ten thousand)."""

T = TypeVar("T")


class OutcomeObserver(Protocol):
    """Told how each request ended (`router.ratio.RatioController` satisfies it). `observe`
    must be cheap and non-blocking: it runs on the request's task."""

    def observe(
        self,
        ttft_s: float | None,
        tpot_s: float | None,
        ok: bool,
        e2e_s: float | None = None,
        path: str = "",
    ) -> None: ...


@dataclass
class RequestRecord:
    """What the metrics learn about one request, filled in as it goes (seconds)."""

    request_id: str = ""  # "" until validated (the router's id when the client sent none)
    workers: tuple[str, ...] = ()  # addresses it was placed on, in order (migrations too)
    status: str = "OK"  # a grpc.StatusCode name; "CANCELLED" when the client went away
    finish_reason: str = ""  # "stop" | "length" when status is OK
    queue_s: float | None = None  # None: never admitted
    ttft_s: float | None = None  # None: no token was sent
    tpot_s: float | None = None  # None: fewer than two tokens
    e2e_s: float = 0.0
    inter_token_s: list[float] = field(default_factory=list)  # between messages with tokens
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_path: str = ""  # disagg: "remote" | "local" (`router.hybrid`); "" before placing
    prefill_path_reason: str = ""
    trace_id: str = ""  # the request's trace (32 hex digits) when it is traced and sampled


class RequestRecorder(Protocol):
    """Receives one `RequestRecord` per request (`router.metrics.RouterMetrics`)."""

    def record(self, rec: RequestRecord) -> None: ...


def request_outcome(run: RequestRun, e2e_s: float) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) in seconds of a request that ended `e2e_s` after it arrived. TTFT: arrival
    to the first token sent (None: no token was sent); TPOT: the time after the first token
    divided by the tokens after it (None: fewer than two tokens)."""
    if not run.timings.ttft_ms:
        return None, None
    ttft = run.timings.ttft_ms / 1e3
    if run.completion_tokens < 2:
        return ttft, None
    return ttft, max(0.0, e2e_s - ttft) / (run.completion_tokens - 1)


def _claimed_id(request: DecodedRequest | inference_pb2.GenerateRequest) -> str:
    """The id a request refused before validation is known by: its own when it carries a
    plausible one (printable, not too long: it is echoed), else a fresh one."""
    msg = request.message if isinstance(request, DecodedRequest) else request
    rid = msg.request_id if msg is not None else ""
    if rid and len(rid) <= MAX_REQUEST_ID_CHARS and rid.isprintable():
        return rid
    return uuid.uuid4().hex


class RequestLifecycle:
    """The transport-agnostic request path (module docstring). One per router."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: Tokenizer,
        limits: ModelLimits,
        pool: WorkerPool,
        policy: RoutingPolicy,
        prefix_index: GuardedPrefixIndex | None = None,
        observer: OutcomeObserver | None = None,
        recorder: RequestRecorder | None = None,
        threshold: LiveThreshold | None = None,
        tracer: Tracer = NO_TRACER,
    ) -> None:
        """`threshold`: the live hybrid threshold, read once per request (None: one of its own
        at `config.hybrid`'s value when hybrid is on; the ratio controller passes the one it
        moves). `tracer`: where each request's spans go (`router.request_trace`; default:
        none)."""
        self.config = config
        self.tracer = tracer
        if threshold is None and config.hybrid.enabled:
            threshold = LiveThreshold(config.hybrid)
        self.threshold = threshold
        self.tokenizer = tokenizer
        self.limits = limits
        self._pool = pool
        self._policy = policy
        self._prefix_index = prefix_index
        self._observer = observer
        self.recorder = recorder
        self.admission = Admission(config.max_inflight, config.max_queued)
        self._in_flight_ids: set[str] = set()
        self._cleanup_tasks: set[asyncio.Task[None]] = set()
        # Text prompts are tokenized here, never on the event loop (a long one takes seconds).
        self._tokenize = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")

    async def run_blocking(self, fn: Callable[[], T]) -> T:
        """`fn()` on the tokenizer threads (rendering and tokenizing a chat request: CPU work
        that must not hold the event loop); its exception propagates."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize, fn)

    @property
    def policy(self) -> RoutingPolicy:
        """The routing policy every request's placement asks (read-only)."""
        return self._policy

    def close(self) -> None:
        """Stop the tokenizer threads (after the edges stopped taking requests)."""
        self._tokenize.shutdown(wait=False, cancel_futures=True)

    async def run(
        self,
        request: DecodedRequest | inference_pb2.GenerateRequest,
        send: Send,
        timeout_s: float | None = None,
        trace: TraceStart = NEW_TRACE,
    ) -> None:
        """Run one request to its final message (steps in the module docstring). `trace`: the
        caller's W3C trace context and operation (`router.request_trace`).

        Raises `InvalidRequest` for bad input, `RouterError` for any other failure;
        `asyncio.CancelledError` (the caller's cancellation) propagates after cleanup.
        """
        t_arrival = time.perf_counter()
        rec = RequestRecord()
        tr = RequestTrace(self.tracer, self.config.served_model_name, trace)
        rec.trace_id = tr.trace_id
        message = ""
        try:
            try:
                place = self.admission.enter()  # first, and O(1): a burst is shed at once
            except Overloaded as exc:
                self._observe(None, None, False, time.perf_counter() - t_arrival)
                rid = rec.request_id = _claimed_id(request)
                log.debug("request %s refused: %s", rid, exc)
                raise RouterError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), f"{exc} (request {rid})"
                ) from None
            try:
                try:
                    with tr.phase("pdserve.tokenize"):
                        req = await self._validate(request)
                except RequestValidationError as exc:
                    raise InvalidRequest(exc.field, exc.problem) from None
                rec.prompt_tokens = len(req.prompt_token_ids)
                await self._run_validated(req, place, t_arrival, send, timeout_s, rec, tr)
            finally:
                place.leave()
        except RouterError as exc:
            rec.status, message = exc.code.name, exc.message
            raise
        except asyncio.CancelledError:
            rec.status = grpc.StatusCode.CANCELLED.name
            raise
        finally:
            rec.e2e_s = time.perf_counter() - t_arrival
            self._record(rec)
            tr.finish(
                rec.status,
                message,
                rec.tpot_s,
                rec.finish_reason,
                self.config.mode == "colocated",
                self.tokenizer,
            )

    async def _validate(
        self, request: DecodedRequest | inference_pb2.GenerateRequest
    ) -> ValidatedRequest:
        """`validate_request`; a text prompt (tokenized), a structured-output constraint (its
        grammar checked) or a long token-id prompt (`INLINE_PROMPT_IDS`) is validated on the
        tokenizer threads."""
        msg = request.message if isinstance(request, DecodedRequest) else request
        off_loop = msg is not None and (
            msg.WhichOneof("prompt") == "text"
            or has_structured_output(msg)
            or len(msg.token_ids.ids) > INLINE_PROMPT_IDS
        )
        if not off_loop:
            return validate_request(
                request, self.limits, self.tokenizer.encode, self._in_flight_ids
            )
        loop = asyncio.get_running_loop()
        encode = self.tokenizer.encode
        req = await loop.run_in_executor(
            self._tokenize, validate_request, request, self.limits, encode
        )
        check_not_in_flight(req.request_id, self._in_flight_ids)  # now, on the loop
        return req

    async def _run_validated(
        self,
        req: ValidatedRequest,
        place: AdmissionPlace,
        t_arrival: float,
        send: Send,
        timeout_s: float | None,
        rec: RequestRecord,
        tr: RequestTrace,
    ) -> None:
        request_id = req.request_id or uuid.uuid4().hex
        rec.request_id = request_id
        tr.validated(req, request_id, self.tokenizer)
        timeout = self.config.default_timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last_token_at: float | None = None

        async def tracked_send(resp: inference_pb2.GenerateResponse) -> None:
            nonlocal last_token_at
            if resp.token_ids:
                now = time.perf_counter()
                if last_token_at is not None:
                    rec.inter_token_s.append(now - last_token_at)
                last_token_at = now
            if resp.HasField("final"):
                rec.finish_reason = resp.final.finish_reason
            await send(resp)

        client = ClientStream(
            request_id,
            tracked_send,
            self.tokenizer,
            req.stop,
            t_arrival,
            FinalFacts(prompt_tokens=len(req.prompt_token_ids)),
            min_tokens=req.sampling.min_tokens,
        )
        run = RequestRun(
            request_id=request_id,
            req=req,
            deadline=deadline,
            pool=self._pool,
            policy=self._policy,
            colocated=self.config.mode == "colocated",
            max_attempts=self.config.max_route_attempts,
            abort_now=functools.partial(self.abort_now, span=tr.root),
            abort_later=functools.partial(self.abort_later, span=tr.root),
            client=client,
            max_migrations=self.config.max_migrations,
            stall_timeout_s=self.config.stall_timeout_s,
            prefix_index=self._prefix_index,
            hybrid=None if self.threshold is None else self.threshold.config(),
            span=tr.root,
        )
        tr.client = client
        self._in_flight_ids.add(request_id)
        error: RouterError | None = None
        try:
            async with asyncio.timeout_at(deadline):
                t0 = time.perf_counter()
                with tr.phase("pdserve.admission_queue"):
                    await place.wait()
                rec.queue_s = time.perf_counter() - t0
                run.timings.router_queue_ms = rec.queue_s * 1e3
                await run.execute()
        except TimeoutError:
            error = RouterError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"request deadline ({timeout:.3f} s) passed"
            )
        except RouterError as exc:
            error = exc
        except Exception as exc:  # a bug: answer INTERNAL, keep the traceback in the log
            log.exception("request %s failed with an unexpected error", request_id)
            error = RouterError(
                grpc.StatusCode.INTERNAL, f"router error: {exc!r}", "internal router error"
            )
        finally:
            self._in_flight_ids.discard(request_id)
            run.close()
            client.close()
            if run.holders:
                self.abort_later(request_id, sorted(run.holders), span=tr.root)
            rec.completion_tokens = run.completion_tokens
            rec.workers = tuple(run.placed_on)
            rec.prefill_path = client.facts.prefill_path
            rec.prefill_path_reason = client.facts.prefill_path_reason
            rec.ttft_s, rec.tpot_s = request_outcome(run, time.perf_counter() - t_arrival)
        # Reached only when the caller was not cancelled (the client did not go away).
        self._report(run, error is None, time.perf_counter() - t_arrival)
        if error is not None:
            # the whole story stays here; the client gets `public` and the request id
            log.info("request %s ended %s: %s", request_id, error.code.name, error.message)
            public = f"{error.public} (request {request_id})"
            raise RouterError(error.code, error.message, public) from error

    def _report(self, run: RequestRun, ok: bool, e2e_s: float) -> None:
        """Tell the observer how `run` ended; never raises (a failing hook is logged)."""
        if self._observer is not None:
            path = run.client.facts.prefill_path
            self._observe(*request_outcome(run, e2e_s), ok, e2e_s, path)

    def _observe(
        self, ttft_s: float | None, tpot_s: float | None, ok: bool, e2e_s: float, path: str = ""
    ) -> None:
        if self._observer is None:
            return
        try:
            self._observer.observe(ttft_s, tpot_s, ok, e2e_s, path=path)
        except Exception:
            log.exception("outcome observer failed")

    def _record(self, rec: RequestRecord) -> None:
        """Hand `rec` to the recorder; never raises (a failing hook is logged)."""
        if self.recorder is None:
            return
        try:
            self.recorder.record(rec)
        except Exception:
            log.exception("request recorder failed")

    # -- cleanup aborts ----------------------------------------------------------------------

    async def abort_now(
        self, request_id: str, addresses: Sequence[str], span: Span = NO_SPAN
    ) -> None:
        """`Abort(request_id)` on each address concurrently, each bounded by abort_timeout_s
        (a ``pdserve.abort`` span under `span`, the request's).

        Failures are logged, not raised: the worker may be the one that died, and a worker's
        own reservation timeout is the backstop for a lost Abort.
        """
        attrs = {"pdserve.workers": list(addresses)} if span.recording else None
        with span.child("pdserve.abort", attributes=attrs):
            await asyncio.gather(*(self._abort_one(request_id, a) for a in addresses))

    def abort_later(self, request_id: str, addresses: Sequence[str], span: Span = NO_SPAN) -> None:
        """`abort_now` in a task owned by this object (survives the caller's cancellation)."""
        task = asyncio.get_running_loop().create_task(
            self.abort_now(request_id, addresses, span), name=f"abort-{request_id}"
        )
        self._cleanup_tasks.add(task)
        task.add_done_callback(self._cleanup_tasks.discard)

    async def _abort_one(self, request_id: str, address: str) -> None:
        try:
            stub = self._pool.stub(address)
        except KeyError:
            log.warning("abort %s: worker %s is no longer registered", request_id, address)
            return
        try:
            await stub.Abort(
                worker_pb2.AbortRequest(request_id=request_id),
                timeout=self.config.abort_timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "abort %s on %s failed: %s %s", request_id, address, exc.code(), exc.details()
            )

    async def wait_cleanup(self, timeout_s: float) -> None:
        """Wait (bounded) for pending cleanup aborts; used at shutdown and in tests."""
        pending = list(self._cleanup_tasks)
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
