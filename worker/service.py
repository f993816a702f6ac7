"""The `pdserve.v1.Worker` gRPC service and the grpc.health.v1 status of a worker process.

Runs on the asyncio loop of every worker process. Handlers never block: each hands its request
to the engine thread (`EngineThread.submit`) with a sink and awaits the sink. Timeouts: a
request's deadline is the smaller of its `timeout_s` and the RPC's own gRPC deadline (for
`Reserve`, `timeout_s` is the reservation's lifetime and the gRPC deadline only bounds the
call). A handler cancelled before its answer (client disconnect, gRPC deadline) tells the
engine thread to abort the request it started — only that one, matched by its sink.

Structured output: a request with a grammar (`sampling.structured_outputs`) has it compiled
before it reaches the engine thread, on this service's compile thread (`_compile_ahead`; never
on the loop, never in the engine's step), into the model's shared `Grammars` cache, where the
engine finds it. A grammar that does not compile answers INVALID_ARGUMENT.

KV events: `StreamKVEvents` / `GetKVSnapshot` serve the process's `KVEventPublisher` (the block
pool's prefix-cache changes, for the router's prefix index) without touching the engine thread.

Health: SERVING while accepting work; NOT_SERVING while a role switch drains and from the start
of `stop` on (for the overall service "" and for ``pdserve.v1.Worker``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from model_runtime.grammar import GrammarError
from model_runtime.hashing import hash_to_bytes
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from tracing.spans import NO_TRACER, Tracer
from worker.convert import structured_from_proto
from worker.engine_thread import EngineThread
from worker.kv_events import KVEventPublisher, PublisherHeartbeat
from worker.sinks import StreamSink, UnarySink, WorkerError
from worker.tracing import NO_RPC_TRACE, RpcSpans, RpcTrace

SERVICE_NAME = "pdserve.v1.Worker"


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """One worker's `Worker` service over its `EngineThread`. `close()` when its server has
    stopped: it ends the compile thread."""

    def __init__(
        self,
        engine: EngineThread,
        health_servicer: health.aio.HealthServicer,
        worker_id: str,
        kv_endpoint: str,
        epoch: int,
        kv_events: KVEventPublisher | None = None,
        node: str = "",
        metrics_port: int = 0,
        tracer: Tracer = NO_TRACER,
    ) -> None:
        """`tracer`: where the spans of Reserve, Prefill, Decode and Generate go
        (`worker.tracing`; default none)."""
        self._engine = engine
        self._tracer = tracer
        self._node = node
        self._kv_events = kv_events
        self._health = health_servicer
        self._worker_id = worker_id
        self._kv_endpoint = kv_endpoint
        self._epoch = epoch
        self._metrics_port = metrics_port
        self._compile = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    def close(self) -> None:
        """End the compile thread (a compile in progress finishes first; none starts after),
        instead of leaving it idle until the garbage collector frees this service (an
        in-process server, a Ray actor's or a test's, outlives its stop)."""
        self._compile.shutdown(wait=False, cancel_futures=True)

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

    def status(self) -> worker_pb2.WorkerStatus:
        s = self._engine.snapshot
        return worker_pb2.WorkerStatus(
            worker_id=self._worker_id,
            role=s.role,
            draining=s.draining,
            num_waiting=s.num_waiting,
            num_receiving=s.num_receiving,
            num_running=s.num_running,
            waiting_tokens=s.waiting_tokens,
            free_blocks=s.free_blocks,
            total_blocks=s.total_blocks,
            block_size=s.block_size,
            kv_endpoint=self._kv_endpoint,
            epoch=self._epoch,
            node=self._node,
            engine_steps=s.engine_steps,
            engine_step_wall_s=s.engine_step_wall_s,
            engine_step_cpu_s=s.engine_step_cpu_s,
            metrics_port=self._metrics_port,
        )

    # ---- RPCs ------------------------------------------------------------------------------

    async def GetStatus(
        self, request: worker_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStatus:
        return self.status()

    async def Reserve(
        self, request: worker_pb2.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReserveResponse:
        timeout = request.timeout_s if request.timeout_s > 0 else None
        response: worker_pb2.ReserveResponse = await self._unary(
            "Reserve", request, context, timeout
        )
        return response

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        timeout = _timeout(request, context)
        response: worker_pb2.PrefillResponse = await self._unary(
            "Prefill", request, context, timeout
        )
        return response

    # grpc.aio serves a streaming method only if it is itself an async generator function.
    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        async for chunk in self._stream("Decode", request, context):
            yield chunk

    async def Generate(
        self, request: worker_pb2.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        async for chunk in self._stream("Generate", request, context):
            yield chunk

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        sink = UnarySink(asyncio.get_running_loop())
        self._engine.abort(request.request_id, sink)
        found = await self._await(sink, context, None)
        return worker_pb2.AbortResponse(found=found)

    async def SetRole(
        self, request: worker_pb2.SetRoleRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStatus:
        sink = UnarySink(asyncio.get_running_loop())
        await self.set_serving(False)
        self._engine.set_role(request.role, request.drain_timeout_s, sink)
        try:
            await self._await(sink, context, None)
        finally:
            if not self._engine.snapshot.draining:
                await self.set_serving(True)
        return self.status()

    async def StreamKVEvents(
        self, request: worker_pb2.StreamKVEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.KVEvent]:
        pub = self._kv_events
        if pub is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker publishes no events")
            return
        heartbeat_s = request.heartbeat_s if request.heartbeat_s > 0 else 1.0
        async for item in pub.stream(int(request.from_seq), heartbeat_s):
            msg = worker_pb2.KVEvent(worker_id=self._worker_id, epoch=self._epoch)
            if isinstance(item, PublisherHeartbeat):
                msg.seq, msg.kind = item.seq, "heartbeat"
            else:
                seq, event = item
                msg.seq, msg.kind = seq, event.kind
                msg.block_hashes.extend(hash_to_bytes(h) for h in event.block_hashes)
            yield msg

    async def GetKVSnapshot(
        self, request: worker_pb2.GetKVSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.KVSnapshot:
        pub = self._kv_events
        if pub is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker publishes no events")
        assert pub is not None
        seq, hashes = pub.snapshot()
        return worker_pb2.KVSnapshot(
            worker_id=self._worker_id,
            epoch=self._epoch,
            seq=seq,
            block_hashes=[hash_to_bytes(h) for h in hashes],
        )

    # ---- plumbing --------------------------------------------------------------------------

    async def _compile_ahead(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        """Compile a constrained request's grammar into the shared cache on the compile thread
        (module docstring); INVALID_ARGUMENT when it does not compile."""
        grammars = self._engine.engine.grammars
        sampling = getattr(request, "sampling", None)
        if grammars is None or sampling is None:
            return
        so = structured_from_proto(sampling.structured_outputs)
        if so is None or grammars.cached(so):
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._compile, grammars.compile, so)
        except GrammarError as exc:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request {request.request_id!r}: sampling.structured_outputs: {exc}",
            )

    async def _unary(
        self, method: str, request: Any, context: grpc.aio.ServicerContext, timeout: float | None
    ) -> Any:
        await self._compile_ahead(request, context)
        sink = UnarySink(asyncio.get_running_loop())
        trace = self._trace(method, request, context, sink.created)
        self._engine.submit(method, request, sink, timeout)
        return await self._await(sink, context, request.request_id, trace)

    def _trace(
        self, method: str, request: Any, context: grpc.aio.ServicerContext, arrival: float
    ) -> RpcTrace:
        """The RPC's spans (`worker.tracing`); `NO_RPC_TRACE` with tracing off, where not even
        the call's metadata is read."""
        if not self._tracer.enabled:
            return NO_RPC_TRACE
        metadata = context.invocation_metadata()
        return RpcSpans(self._tracer, method, request, metadata, arrival, self._worker_id)

    async def _await(
        self,
        sink: UnarySink,
        context: grpc.aio.ServicerContext,
        request_id: str | None,
        trace: RpcTrace = NO_RPC_TRACE,
    ) -> Any:
        answered = False
        try:
            value = await sink.wait()
            answered = True
            trace.answered(value)
            return value
        except WorkerError as err:
            answered = True
            trace.failed(err.code.name, err.message)
            await context.abort(err.code, err.message, err.trailing_metadata())
        finally:
            if not answered and request_id is not None:
                trace.failed("CANCELLED", "the RPC was cancelled by the client")
                self._engine.cancel(request_id, sink)
            trace.end()

    async def _stream(
        self, method: str, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        await self._compile_ahead(request, context)
        sink = StreamSink(asyncio.get_running_loop())
        trace = self._trace(method, request, context, sink.created)
        self._engine.submit(method, request, sink, _timeout(request, context))
        ended = False
        try:
            async for chunk in sink:
                ended = chunk.finished
                trace.chunk(chunk)
                yield chunk
        except WorkerError as err:
            ended = True
            trace.failed(err.code.name, err.message)
            await context.abort(err.code, err.message, err.trailing_metadata())
        finally:
            if not ended:
                trace.failed("CANCELLED", "the RPC was cancelled by the client")
                self._engine.cancel(request.request_id, sink)
            trace.end()


def _timeout(request: Any, context: grpc.aio.ServicerContext) -> float | None:
    """Seconds the request may take: min of its timeout_s (if > 0) and the gRPC deadline."""
    candidates = [request.timeout_s] if request.timeout_s > 0 else []
    remaining = context.time_remaining()
    if remaining is not None:
        candidates.append(max(remaining, 0.001))
    return min(candidates) if candidates else None
