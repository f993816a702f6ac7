"""One admitted request's worker calls: disagg (Reserve -> Prefill -> Decode) or colocated.

Runs in the router process, inside the `Generate` handler's task. Steps (disagg):

0. the prompt's block-hash chain is looked up in the prefix index (one round trip, bounded by
   the index's lookup timeout; no answer means "route by load only"), unless the policy
   ignores prefixes (`RoutingPolicy.uses_prefix_matches`);
1. the policy picks (P, D) from the pool's views, minus workers that already failed this request;
2. `Reserve` on D -> ticket (D joins `holders` before the call: it may hold blocks before its
   answer arrives);
3. `Prefill` on P with the ticket (P joins `holders` while it runs) -> first token, sent to the
   client at once; a failure here, before anything was sent, aborts the holders and retries on
   other workers (up to `max_route_attempts`), avoiding the worker at fault: the one called,
   or the KV peer its answer names (a Prefill whose push to a dead D failed blames D);
4. `Decode` stream on D -> token chunks -> text deltas (stop strings end the request early);
5. the final message carries finish reason, usage and timings.

Every worker call has a timeout equal to the time left before the request's deadline. Whatever
ends the request early (stop string, error, deadline, client cancel), the caller aborts every
address left in `holders` (`RequestRun.holders`), from a task that outlives the handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from model_runtime.tokenizer import Tokenizer
from proto.pdserve.v1 import inference_pb2, worker_pb2
from proto.pdserve.v1.trailers import failed_peer
from router.errors import Retryable, RouterError, worker_error
from router.policy import Role, RouteRequest, RoutingDecision, RoutingPolicy, WorkerView
from router.pool import WorkerPool
from router.prefix_index.guard import GuardedPrefixIndex, PromptPrefix
from router.textstream import TextStream
from router.validation import ValidatedRequest

Send = Callable[[inference_pb2.GenerateResponse], Awaitable[None]]

# Reserve answers after which the decode worker holds nothing for the request
_NOTHING_RESERVED = frozenset(
    {
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


@dataclass
class RunTimings:
    """Milliseconds, filled in as the request goes; becomes `inference_pb2.Timings`."""

    router_queue_ms: float = 0.0
    prefill_queue_ms: float = 0.0
    prefill_compute_ms: float = 0.0
    kv_transfer_ms: float = 0.0
    decode_admission_ms: float = 0.0
    first_decode_step_ms: float = 0.0
    ttft_ms: float = 0.0


@dataclass
class RequestRun:
    """State of one request while its worker calls run. Create one per admitted request."""

    request_id: str
    req: ValidatedRequest
    deadline: float  # loop.time() by which everything must be over
    t_arrival: float  # time.perf_counter() when the handler started
    pool: WorkerPool
    policy: RoutingPolicy
    tokenizer: Tokenizer
    colocated: bool
    max_attempts: int
    abort_now: Callable[[str, Sequence[str]], Awaitable[None]]
    abort_later: Callable[[str, Sequence[str]], None]
    send: Send
    prefix_index: GuardedPrefixIndex | None = None
    holders: set[str] = field(default_factory=set)
    timings: RunTimings = field(default_factory=RunTimings)
    completion_tokens: int = 0
    cached_tokens: int = 0
    workers: tuple[str, str] = ("", "")  # worker ids for FinalInfo: (prefill, decode)
    decode_addr: str = ""
    transfer_id: str = ""
    prefill_finish: str = ""  # set when the first token already ended the request
    first_token: int = -1
    _tracking: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def remaining(self) -> float:
        """Seconds left before the deadline; raises DEADLINE_EXCEEDED when none are."""
        left = self.deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline passed")
        return left

    def close(self) -> None:
        """Drop this request's in-flight counts on its decode/colocated worker (call once, at
        the end, whatever happened)."""
        self._tracking.close()

    async def execute(self) -> None:
        """Run the request to its final message; raise `RouterError` on failure."""
        text = TextStream(self.tokenizer, self.req.stop)
        first = await self._first_token_with_retries()
        if isinstance(first, int):
            if await self._send_tokens([first], text, None):
                return
            chunks = self._decode_stream()
        else:
            chunks = first
        async with contextlib.aclosing(chunks):  # closing cancels the worker call at once
            async for chunk in chunks:
                if await self._send_tokens(list(chunk.token_ids), text, chunk):
                    return
        raise RouterError(grpc.StatusCode.UNAVAILABLE, "worker stream ended without finishing")

    # -- routing and the first token -------------------------------------------------------

    async def _first_token_with_retries(self) -> int | AsyncGenerator[worker_pb2.TokenChunk]:
        """Disagg: the first token. Colocated: the worker's chunk stream, first chunk peeked."""
        excluded: set[str] = set()
        last: Retryable | None = None
        prefix = await self._prefix_lookup()
        for _ in range(self.max_attempts):
            decision = self._choose(excluded, last, prefix)
            try:
                if decision.colocated is not None:
                    return await self._start_colocated(decision.colocated, decision.cached_tokens)
                assert decision.prefill is not None and decision.decode is not None
                return await self._reserve_and_prefill(
                    decision.prefill, decision.decode, decision.cached_tokens
                )
            except Retryable as exc:
                last = exc
                excluded.add(exc.address)
                if self.holders:  # nothing reached the client: undo, then try elsewhere
                    holders, self.holders = sorted(self.holders), set()
                    # the failed worker is not tried again here: no need to wait for it
                    self.abort_later(self.request_id, [a for a in holders if a in excluded])
                    await self.abort_now(self.request_id, [a for a in holders if a not in excluded])
        assert last is not None
        raise RouterError(last.code, last.message)

    async def _prefix_lookup(self) -> PromptPrefix:
        """The prompt's chain and the index's matches (block size: the workers', if they agree;
        else, without an index, or for a policy that ignores prefixes: none, by load only)."""
        if self.prefix_index is None or not self.policy.uses_prefix_matches:
            return PromptPrefix()
        role: Role = "colocated" if self.colocated else "prefill"
        sizes = {v.block_size for v in self.pool.views(role) if v.healthy}
        if len(sizes) != 1:
            return PromptPrefix()
        return await self.prefix_index.lookup_prompt(self.req.prompt_token_ids, sizes.pop())

    def _choose(
        self,
        excluded: set[str],
        last: Retryable | None,
        prefix: PromptPrefix | None = None,
    ) -> RoutingDecision:
        def views(role: str) -> list[WorkerView]:
            return [v for v in self.pool.views() if v.role == role and v.address not in excluded]

        route = RouteRequest(
            self.request_id,
            len(self.req.prompt_token_ids),
            self.req.sampling.max_tokens,
            self.colocated,
            block_hashes=prefix.block_hashes if prefix else (),
            prefix_matches=prefix.matches if prefix else None,
        )
        if self.colocated:
            roles: tuple[str, ...] = ("colocated",)
            decision = self.policy.choose(route, views("colocated"), [])
        else:
            roles = ("prefill", "decode")
            decision = self.policy.choose(route, views("prefill"), views("decode"))
        if decision is not None:
            return decision
        if last is not None:
            raise RouterError(last.code, last.message)
        for role in roles:
            if not any(v.usable for v in views(role)):
                why = "; ".join(v.why_unusable() for v in views(role)) or "none left to try"
                raise RouterError(grpc.StatusCode.UNAVAILABLE, f"no healthy {role} worker ({why})")
        raise RouterError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"no worker has KV room for {route.total_tokens} tokens now",
        )

    async def _call_failed(
        self, exc: grpc.aio.AioRpcError, what: str, address: str, peer_address: str = ""
    ) -> str:
        """Blame the worker at fault for an UNAVAILABLE call (marked unhealthy until its next
        good poll) and return its address: the worker called, or, when its answer names its KV
        peer as the one that failed (`trailers.FAILED_PEER`), that peer at `peer_address`."""
        culprit = address
        if peer_address and failed_peer(exc.trailing_metadata()) is not None:
            culprit = peer_address
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            await self.pool.report_failure(culprit, f"{what} on {address}: {exc.details()}")
        return culprit

    async def _reserve_and_prefill(self, p: WorkerView, d: WorkerView, cached: int) -> int:
        self.workers = (p.worker_id, d.worker_id)
        sampling = self.req.worker_sampling()
        d_stub, p_stub = self.pool.stub(d.address), self.pool.stub(p.address)
        self._tracking.enter_context(self.pool.track(d.address))  # D is busy until the end
        # D may hold blocks as soon as Reserve reaches it, before its answer reaches us: a
        # cancel from here on must still send D an Abort.
        self.holders.add(d.address)
        try:
            left = self.remaining()
            reserved = await d_stub.Reserve(
                worker_pb2.ReserveRequest(
                    request_id=self.request_id,
                    num_prompt_tokens=len(self.req.prompt_token_ids),
                    max_tokens=self.req.sampling.max_tokens,
                    timeout_s=left,
                ),
                timeout=left,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _NOTHING_RESERVED:
                self.holders.discard(d.address)
            await self._call_failed(exc, "Reserve", d.address)
            err = worker_error(exc, f"Reserve on decode worker {d.address}")
            if err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise Retryable(err.code, err.message, d.address) from exc
            raise err from exc
        self.holders.add(p.address)
        try:
            n_prompt = len(self.req.prompt_token_ids)
            with self.pool.track(p.address), self.pool.track_prefill(p.address, n_prompt, cached):
                left = self.remaining()
                resp = await p_stub.Prefill(
                    worker_pb2.PrefillRequest(
                        request_id=self.request_id,
                        prompt_token_ids=self.req.prompt_token_ids,
                        sampling=sampling,
                        ticket=reserved.ticket,
                        timeout_s=left,
                    ),
                    timeout=left,
                )
        except grpc.aio.AioRpcError as exc:
            culprit = await self._call_failed(exc, "Prefill", p.address, d.address)
            err = worker_error(exc, f"Prefill on prefill worker {p.address}")
            if err.code == grpc.StatusCode.UNAVAILABLE:
                raise Retryable(err.code, err.message, culprit) from exc
            raise err from exc
        self.holders.discard(p.address)  # P frees its blocks once the transfer result is known
        t = self.timings
        t.prefill_queue_ms, t.prefill_compute_ms = resp.queue_ms, resp.compute_ms
        t.kv_transfer_ms = resp.transfer_ms
        self.cached_tokens = resp.cached_tokens
        self.decode_addr = d.address
        self.transfer_id = reserved.ticket.transfer_id
        self.prefill_finish = (resp.finish_reason or "length") if resp.finished else ""
        self.first_token = int(resp.first_token)
        return self.first_token

    async def _start_colocated(
        self, w: WorkerView, cached: int
    ) -> AsyncGenerator[worker_pb2.TokenChunk]:
        """Start `Generate` on `w` and wait for its first chunk (retryable until then)."""
        self.workers = (w.worker_id, w.worker_id)
        self.holders.add(w.address)
        self._tracking.enter_context(self.pool.track(w.address))
        left = self.remaining()
        call = self.pool.stub(w.address).Generate(
            worker_pb2.WorkerGenerateRequest(
                request_id=self.request_id,
                prompt_token_ids=self.req.prompt_token_ids,
                sampling=self.req.worker_sampling(),
                timeout_s=left,
            ),
            timeout=left,
        )
        stream = self._chunks(call, w.address)
        try:
            with self.pool.track_prefill(w.address, len(self.req.prompt_token_ids), cached):
                first = await anext(stream)
        except _StreamFailed as failed:
            await self._call_failed(failed.exc, "Generate", w.address)
            err = worker_error(failed.exc, f"Generate on colocated worker {w.address}")
            if err.code == grpc.StatusCode.UNAVAILABLE:
                raise Retryable(err.code, err.message, w.address) from failed.exc
            raise err from failed.exc
        except StopAsyncIteration:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "colocated stream was empty") from None
        except asyncio.CancelledError:
            await stream.aclose()  # cancels the worker call now, not at garbage collection
            raise
        t = self.timings
        t.prefill_queue_ms, t.prefill_compute_ms = first.admission_ms, first.first_step_ms
        self.cached_tokens = first.cached_tokens

        async def rest() -> AsyncGenerator[worker_pb2.TokenChunk]:
            try:
                async with contextlib.aclosing(stream):
                    yield first
                    async for chunk in stream:
                        yield chunk
            except _StreamFailed as failed:
                await self._call_failed(failed.exc, "Generate", w.address)
                raise worker_error(failed.exc, "Generate on colocated worker") from failed.exc

        return rest()

    # -- the token stream --------------------------------------------------------------------

    async def _decode_stream(self) -> AsyncGenerator[worker_pb2.TokenChunk]:
        """The Decode stream on the reserved decode worker (after the first token)."""
        if self.prefill_finish:  # the first token already ended the request; D gets an Abort
            yield worker_pb2.TokenChunk(finished=True, finish_reason=self.prefill_finish)
            return
        addr = self.decode_addr
        left = self.remaining()
        call = self.pool.stub(addr).Decode(
            worker_pb2.DecodeRequest(
                request_id=self.request_id,
                transfer_id=self.transfer_id,
                first_token=self.first_token,
                prompt_token_ids=self.req.prompt_token_ids,
                sampling=self.req.worker_sampling(),
                timeout_s=left,
            ),
            timeout=left,
        )
        first = True
        try:
            async with contextlib.aclosing(self._chunks(call, addr)) as chunks:
                async for chunk in chunks:
                    if first:
                        t = self.timings
                        t.decode_admission_ms = chunk.admission_ms
                        t.first_decode_step_ms = chunk.first_step_ms
                        first = False
                    yield chunk
        except _StreamFailed as failed:
            await self._call_failed(failed.exc, "Decode", addr)
            raise worker_error(failed.exc, f"Decode on decode worker {addr}") from failed.exc

    async def _chunks(
        self, call: grpc.aio.UnaryStreamCall[object, worker_pb2.TokenChunk], addr: str
    ) -> AsyncGenerator[worker_pb2.TokenChunk]:
        """Iterate a worker stream; cancel the call if the consumer stops early."""
        try:
            async for chunk in call:
                if chunk.finished:
                    self.holders.discard(addr)  # the worker released the request itself
                yield chunk
                if chunk.finished:
                    return
        except grpc.aio.AioRpcError as exc:
            raise _StreamFailed(exc) from exc
        finally:
            call.cancel()

    async def _send_tokens(
        self,
        tokens: list[int],
        text: TextStream,
        chunk: worker_pb2.TokenChunk | None,
    ) -> bool:
        """Send `tokens` (and the final info when the request ends); True when it ended."""
        sent: list[int] = []
        pieces: list[str] = []
        for tok in tokens:
            sent.append(tok)
            delta = text.push([tok])
            pieces.append(delta.text)
            if delta.stopped:
                break
        self.completion_tokens += len(sent)
        finish = ""
        if text.stopped:
            finish = "stop"  # holders (D) are aborted by the caller: the worker still runs
        elif chunk is not None and chunk.finished:
            pieces.append(text.finish())
            finish = "stop" if text.stopped else (chunk.finish_reason or "length")
        resp = inference_pb2.GenerateResponse(
            request_id=self.request_id, token_ids=sent, text="".join(pieces)
        )
        if sent and not self.timings.ttft_ms:
            self.timings.ttft_ms = (time.perf_counter() - self.t_arrival) * 1e3
        if finish:
            resp.final.CopyFrom(self._final(finish))
        await self.send(resp)
        return bool(finish)

    def _final(self, finish_reason: str) -> inference_pb2.FinalInfo:
        t = self.timings
        return inference_pb2.FinalInfo(
            finish_reason=finish_reason,
            usage=inference_pb2.Usage(
                prompt_tokens=len(self.req.prompt_token_ids),
                completion_tokens=self.completion_tokens,
                cached_tokens=self.cached_tokens,
            ),
            timings=inference_pb2.Timings(
                ttft_ms=t.ttft_ms,
                router_queue_ms=t.router_queue_ms,
                prefill_queue_ms=t.prefill_queue_ms,
                prefill_compute_ms=t.prefill_compute_ms,
                kv_transfer_ms=t.kv_transfer_ms,
                decode_admission_ms=t.decode_admission_ms,
                first_decode_step_ms=t.first_decode_step_ms,
                e2e_ms=(time.perf_counter() - self.t_arrival) * 1e3,
            ),
            prefill_worker=self.workers[0],
            decode_worker=self.workers[1],
        )


class _StreamFailed(Exception):
    """A worker stream failed; carries the grpc error out of the chunk iterator."""

    def __init__(self, exc: grpc.aio.AioRpcError) -> None:
        super().__init__(str(exc))
        self.exc = exc
