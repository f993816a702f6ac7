"""The public `pdserve.v1.Inference` gRPC service. Runs in the router process (grpc.aio).

`Generate` = admit (bounded queue: a slot, a place in the queue, or refused at once) ->
validate -> tokenize (helper threads) -> wait for the slot -> route -> worker calls
(`flow.RequestRun`) -> stream (`client_stream.ClientStream`). Status codes at this edge
(DESIGN.md's error table):

- RESOURCE_EXHAUSTED: admission queue full — decided first, before anything else is looked at
  (a burst beyond the queue is shed at once) — or no worker with KV room;
- INVALID_ARGUMENT: bad input, message names the field; never reaches a worker;
- UNAVAILABLE: no healthy worker, or a worker failed (retried elsewhere while nothing was sent);
- DEADLINE_EXCEEDED: the client's deadline (or `default_timeout_s`) passed;
- CANCELLED: the client went away (grpc reports it; the handler only cleans up);
- INTERNAL: a broken invariant, logged with its traceback.

Cleanup rule: whenever a request ends with workers still holding it (`RequestRun.holders`), an
`Abort(request_id)` goes to each of them from a task owned by the service, not by the handler,
so it still runs when the handler itself was cancelled.

Outcome hook: every request that passed validation and ended with a status — OK or an error,
a full queue and a passed deadline included; not a client cancel — is reported once to the
optional `OutcomeObserver` (the ratio controller) with its TTFT, TPOT and end-to-end time as the
router saw them (`request_outcome`). The hook runs after the worker cleanup is scheduled and
before the status goes out; it is synchronous, and an exception it raises is logged, never sent
to the client.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import grpc

from model_runtime.tokenizer import Tokenizer
from proto.pdserve.v1 import inference_pb2, worker_pb2
from router.admission import Admission, Overloaded, Ticket
from router.client_stream import ClientStream, FinalFacts
from router.config import RouterConfig
from router.errors import RouterError
from router.flow import RequestRun
from router.policy import RoutingPolicy
from router.pool import WorkerPool
from router.prefix_index.guard import GuardedPrefixIndex
from router.validation import (
    DEFAULT_MAX_TOKENS,
    DecodedRequest,
    ModelLimits,
    RequestValidationError,
    ValidatedRequest,
    check_not_in_flight,
    decode_generate_request,
    decode_model_info_request,
    validate_request,
)

log = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Inference"


class OutcomeObserver(Protocol):
    """Told how each request ended (`router.ratio.RatioController` satisfies it). `observe`
    must be cheap and non-blocking: it runs on the request's task."""

    def observe(
        self, ttft_s: float | None, tpot_s: float | None, ok: bool, e2e_s: float | None = None
    ) -> None: ...


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


class InferenceService:
    """Handlers of the `Inference` service; register with `server.add_generic_rpc_handlers`."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: Tokenizer,
        limits: ModelLimits,
        pool: WorkerPool,
        policy: RoutingPolicy,
        prefix_index: GuardedPrefixIndex | None = None,
        observer: OutcomeObserver | None = None,
    ) -> None:
        self._config = config
        self._observer = observer
        self._tokenizer = tokenizer
        self._limits = limits
        self._pool = pool
        self._policy = policy
        self._prefix_index = prefix_index
        self._admission = Admission(config.max_inflight, config.max_queued)
        self._in_flight_ids: set[str] = set()
        self._cleanup_tasks: set[asyncio.Task[None]] = set()
        # Text prompts are tokenized here, never on the event loop (a long one takes seconds).
        self._tokenize = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")

    def rpc_handlers(self) -> grpc.GenericRpcHandler:
        """Method handlers with never-failing deserializers (see `validation`): a request that
        does not parse, or is over the model's size limit, gets INVALID_ARGUMENT naming why."""
        max_bytes = self._limits.max_request_bytes
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Generate": grpc.unary_stream_rpc_method_handler(
                    self.Generate,
                    request_deserializer=lambda data: decode_generate_request(data, max_bytes),
                    response_serializer=inference_pb2.GenerateResponse.SerializeToString,
                ),
                "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                    self.GetModelInfo,
                    request_deserializer=decode_model_info_request,
                    response_serializer=inference_pb2.ModelInfo.SerializeToString,
                ),
            },
        )

    @property
    def admission(self) -> Admission:
        """The admission queue (read its counters in tests and metrics)."""
        return self._admission

    @property
    def limits(self) -> ModelLimits:
        return self._limits

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def close(self) -> None:
        """Stop the tokenizer threads (after the server stopped taking calls)."""
        self._tokenize.shutdown(wait=False, cancel_futures=True)

    async def GetModelInfo(
        self,
        request: inference_pb2.GetModelInfoRequest | None,
        context: grpc.aio.ServicerContext,
    ) -> inference_pb2.ModelInfo:
        """The served model's name and limits and the router's mode."""
        if request is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "request: malformed GetModelInfoRequest"
            )
        return inference_pb2.ModelInfo(
            model=self._config.served_model_name,
            context_length=self._limits.context_length,
            vocab_size=self._limits.vocab_size,
            mode=self._config.mode,
            max_tokens_default=DEFAULT_MAX_TOKENS,
        )

    async def Generate(self, decoded: DecodedRequest, context: grpc.aio.ServicerContext) -> None:
        """Stream one completion; see the module docstring for the statuses."""
        t_arrival = time.perf_counter()
        try:
            ticket = self._admission.enter()  # first, and O(1): a burst is shed at once
        except Overloaded as exc:
            self._observe(None, None, False, time.perf_counter() - t_arrival)
            context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)  # no exception: cheaper
            context.set_details(str(exc))
            return
        try:
            await self._admitted(decoded, context, ticket, t_arrival)
        finally:
            ticket.leave()

    async def _admitted(
        self,
        decoded: DecodedRequest,
        context: grpc.aio.ServicerContext,
        ticket: Ticket,
        t_arrival: float,
    ) -> None:
        """The rest of `Generate` for a request that holds a slot or a place in the queue."""
        try:
            req = await self._validate(decoded)
        except RequestValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        request_id = req.request_id or uuid.uuid4().hex
        client_left = context.time_remaining()
        timeout = self._config.default_timeout_s if client_left is None else client_left
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout

        async def send(resp: inference_pb2.GenerateResponse) -> None:
            await context.write(resp)

        client = ClientStream(
            request_id,
            send,
            self._tokenizer,
            req.stop,
            t_arrival,
            FinalFacts(prompt_tokens=len(req.prompt_token_ids)),
        )
        run = RequestRun(
            request_id=request_id,
            req=req,
            deadline=deadline,
            pool=self._pool,
            policy=self._policy,
            colocated=self._config.mode == "colocated",
            max_attempts=self._config.max_route_attempts,
            abort_now=self.abort_now,
            abort_later=self.abort_later,
            client=client,
            max_migrations=self._config.max_migrations,
            prefix_index=self._prefix_index,
        )
        self._in_flight_ids.add(request_id)
        error: RouterError | None = None
        try:
            async with asyncio.timeout_at(deadline):
                t0 = time.perf_counter()
                await ticket.wait()
                run.timings.router_queue_ms = (time.perf_counter() - t0) * 1e3
                await run.execute()
        except TimeoutError:
            error = RouterError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"request deadline ({timeout:.3f} s) passed"
            )
        except RouterError as exc:
            error = exc
        except Exception as exc:  # a bug: answer INTERNAL, keep the traceback in the log
            log.exception("request %s failed with an unexpected error", request_id)
            error = RouterError(grpc.StatusCode.INTERNAL, f"router error: {exc!r}")
        finally:
            self._in_flight_ids.discard(request_id)
            run.close()
            client.close()
            if run.holders:
                self.abort_later(request_id, sorted(run.holders))
        # Reached only when the handler was not cancelled (the client did not go away).
        self._report(run, error is None, time.perf_counter() - t_arrival)
        if error is not None:
            await context.abort(error.code, error.message)

    async def _validate(self, decoded: DecodedRequest) -> ValidatedRequest:
        """`validate_request`; a text prompt is tokenized on the tokenizer threads."""
        msg = decoded.message
        if msg is None or msg.WhichOneof("prompt") != "text":
            return validate_request(
                decoded, self._limits, self._tokenizer.encode, self._in_flight_ids
            )
        loop = asyncio.get_running_loop()
        encode = self._tokenizer.encode
        req = await loop.run_in_executor(
            self._tokenize, validate_request, decoded, self._limits, encode
        )
        check_not_in_flight(req.request_id, self._in_flight_ids)  # now, on the loop
        return req

    def _report(self, run: RequestRun, ok: bool, e2e_s: float) -> None:
        """Tell the observer how `run` ended; never raises (a failing hook is logged)."""
        if self._observer is not None:
            self._observe(*request_outcome(run, e2e_s), ok, e2e_s)

    def _observe(self, ttft_s: float | None, tpot_s: float | None, ok: bool, e2e_s: float) -> None:
        if self._observer is None:
            return
        try:
            self._observer.observe(ttft_s, tpot_s, ok, e2e_s)
        except Exception:
            log.exception("outcome observer failed")

    async def abort_now(self, request_id: str, addresses: Sequence[str]) -> None:
        """`Abort(request_id)` on each address concurrently, each bounded by abort_timeout_s.

        Failures are logged, not raised: the worker may be the one that died, and a worker's
        own reservation timeout is the backstop for a lost Abort.
        """
        await asyncio.gather(*(self._abort_one(request_id, a) for a in addresses))

    def abort_later(self, request_id: str, addresses: Sequence[str]) -> None:
        """`abort_now` in a task owned by the service (survives the caller's cancellation)."""
        task = asyncio.get_running_loop().create_task(
            self.abort_now(request_id, addresses), name=f"abort-{request_id}"
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
                timeout=self._config.abort_timeout_s,
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
