"""A model-free `pdserve.v1.Worker` gRPC server for router tests and benchmarks.

Runs in the test process (`FakeWorker`, on the test's event loop) or as its own process
(`python -m tests.fakes.fake_worker --role decode --port 0` prints ``fake-worker port=<port>``).

Behaviour (deterministic, no torch):

- tokens: the token after `t` is `(t + 1) % vocab_size`; the first token follows the last
  prompt token;
- KV blocks: `Reserve` / colocated `Generate` take `ceil((prompt + max_tokens) / block_size)`
  blocks, `Prefill` takes `ceil(prompt / block_size)` while it runs; a request's blocks are
  returned when it finishes or on `Abort` — and, unless `release_on_cancel`, *not* when the
  router merely cancels the call, so tests can tell that the router's Abort freed them;
- faults: `fail[method] = StatusCode` answers that status; `hang` holds calls of those methods
  until they are cancelled; `kv_push_fails_to` (decode worker ids) makes a `Prefill` whose
  ticket names one of them fail as a real prefill worker does when its KV push to a dead decode
  worker fails (UNAVAILABLE, the decode worker named in the `FAILED_PEER` trailer);
  `token_delay_s` / `prefill_delay_s` slow the work down; `hold_streams_after` (CLI
  `--hold-streams-after`) holds every token stream after that many chunks until it is cancelled (a
  request that outlasts whatever the test does, on any machine); `hold_prefills` holds every
  `Prefill` (blocks taken) until `release_prefills`, `hold_reserves` every `Reserve` until
  `release_reserves`; `freeze()` stops the worker as SIGSTOP would (every call, new or
  streaming, and `GetStatus` wait for `thaw`; `freeze(status_too=False)`: only the token streams
  stop, a worker busy elsewhere); `stall_kv_push_to(decode id)` makes a `Prefill` whose ticket
  names that decode worker hold its blocks and not answer until `resume_kv_push_to` (or its
  cancel), as a real prefill worker's push into a frozen decode worker does;
- records: `calls[method]` counts, `last[method]` is the latest request, `aborts` lists
  aborted request ids, `held` maps request ids to their blocks; `free_blocks == total_blocks`
  again means nothing leaked;
- prefix cache (optional, `kv`: a `kv_events.FakeKVWorker`): `Prefill` / `Generate` run the
  prompt through it and report its hit as `cached_tokens` (`prefill_token_delay_s` per token
  *not* cached), `StreamKVEvents` / `GetKVSnapshot` serve its events, and `GetStatus` reports
  its epoch. Without `kv` those two RPCs answer UNIMPLEMENTED.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from model_runtime.hashing import hash_to_bytes
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from proto.pdserve.v1.trailers import FAILED_PEER
from router.indexer import Heartbeat
from tests.fakes.kv_events import FakeKVWorker


@dataclass
class FakeWorkerConfig:
    """Knobs of one fake worker."""

    role: str = "decode"
    vocab_size: int = 1024
    total_blocks: int = 64
    block_size: int = 16
    token_delay_s: float = 0.0
    prefill_delay_s: float = 0.0
    prefill_token_delay_s: float = 0.0
    reserve_answer_delay_s: float = 0.0  # after the blocks are taken: an answer still on the way
    cut_stream_after: int = 0  # > 0: token streams end (not finished) after this many chunks
    hold_streams_after: int = 0  # > 0: token streams hold after this many chunks, until cancelled
    eos_ids: tuple[int, ...] = ()
    release_on_cancel: bool = False
    worker_id: str = ""


@dataclass
class _Held:
    blocks: int
    transfer_id: str = ""


@dataclass
class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """The servicer and its server; `await start()` -> address, `await stop()` kills it."""

    config: FakeWorkerConfig = field(default_factory=FakeWorkerConfig)
    fail: dict[str, grpc.StatusCode] = field(default_factory=dict)
    hang: set[str] = field(default_factory=set)
    kv_push_fails_to: set[str] = field(default_factory=set)
    calls: Counter[str] = field(default_factory=Counter)
    last: dict[str, Any] = field(default_factory=dict)  # method -> its latest request
    # method -> the W3C `traceparent` its latest call carried ("" none)
    traceparents: dict[str, str] = field(default_factory=dict)
    aborts: list[str] = field(default_factory=list)
    held: dict[str, _Held] = field(default_factory=dict)
    draining: bool = False
    address: str = ""
    kv: FakeKVWorker | None = None
    _server: grpc.aio.Server | None = None
    # Cleared by `freeze`: token streams (and, frozen whole, every call) wait for `thaw`.
    _streams_run: asyncio.Event = field(default_factory=asyncio.Event)
    _status_runs: asyncio.Event = field(default_factory=asyncio.Event)
    # decode worker id -> cleared while a push into it stalls (`stall_kv_push_to`)
    _pushes_run: dict[str, asyncio.Event] = field(default_factory=dict)
    # Cleared by `hold_prefills`: a `Prefill` holds its blocks and does not answer until
    # `release_prefills`, so tests can have many requests in flight at once by construction.
    _prefills_run: asyncio.Event = field(default_factory=asyncio.Event)
    _reserves_run: asyncio.Event = field(default_factory=asyncio.Event)
    _next_transfer: int = 0
    _epoch: int = field(default_factory=lambda: time.monotonic_ns())

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on host:port (0 = pick); return the bound address."""
        self._server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self._server)  # type: ignore[no-untyped-call]
        bound = self._server.add_insecure_port(f"{host}:{port}")
        await self._server.start()
        self.address = f"{host}:{bound}"
        if not self.config.worker_id:
            self.config.worker_id = f"fake-{self.config.role}-{bound}"
        if self.kv is not None:
            self.kv.worker_id = self.config.worker_id
        return self.address

    async def stop(self) -> None:
        """Stop at once, cancelling every in-flight call (a crash, as the router sees it)."""
        if self._server is not None:
            await self._server.stop(None)
            self._server = None

    @property
    def free_blocks(self) -> int:
        return self.config.total_blocks - sum(h.blocks for h in self.held.values())

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.config.block_size)

    def __post_init__(self) -> None:
        self._streams_run.set()
        self._status_runs.set()
        self._prefills_run.set()
        self._reserves_run.set()

    def hold_reserves(self) -> None:
        """Every `Reserve` from now on takes its blocks, then waits for `release_reserves`
        before it answers (the router routes other requests while it is out)."""
        self._reserves_run.clear()

    def release_reserves(self) -> None:
        self._reserves_run.set()

    def hold_prefills(self) -> None:
        """Every `Prefill` from now on takes its blocks, then waits for `release_prefills`
        (or its cancel) before it answers."""
        self._prefills_run.clear()

    def release_prefills(self) -> None:
        self._prefills_run.set()

    def stall_kv_push_to(self, decode_worker_id: str) -> None:
        """Every `Prefill` whose ticket names `decode_worker_id` takes its blocks and does not
        answer until `resume_kv_push_to` (or its cancel): its KV push is stuck."""
        self._pushes_run.setdefault(decode_worker_id, asyncio.Event()).clear()

    def resume_kv_push_to(self, decode_worker_id: str) -> None:
        self._pushes_run.setdefault(decode_worker_id, asyncio.Event()).set()

    def freeze(self, status_too: bool = True) -> None:
        """Stop every token stream where it is (as SIGSTOP would); `status_too` (frozen whole):
        every call, new ones and GetStatus included, waits for `thaw` too, else GetStatus and
        new calls are answered (a worker busy elsewhere)."""
        self._streams_run.clear()
        if status_too:
            self._status_runs.clear()

    def thaw(self) -> None:
        self._streams_run.set()
        self._status_runs.set()

    # -- helpers -----------------------------------------------------------------------------

    async def _enter(
        self, method: str, context: grpc.aio.ServicerContext, request: Any = None
    ) -> None:
        self.calls[method] += 1
        self.last[method] = request
        metadata = dict(context.invocation_metadata() or ())
        self.traceparents[method] = str(metadata.get("traceparent", ""))
        if method in self.fail:
            await context.abort(self.fail[method], f"fake {method} failure")
        if method in self.hang:
            await asyncio.Event().wait()  # until the caller's deadline or cancel
        await self._status_runs.wait()  # frozen whole: nothing is answered until `thaw`

    def _take(self, request_id: str, blocks: int, transfer_id: str = "") -> bool:
        if request_id in self.held or blocks > self.free_blocks:
            return False
        self.held[request_id] = _Held(blocks, transfer_id)
        return True

    def _release_if(self, request_id: str, release: bool) -> None:
        if release:
            self.held.pop(request_id, None)

    def _finish_reason(self, token: int, produced: int, s: worker_pb2.WorkerSampling) -> str:
        if token in s.stop_token_ids or (not s.ignore_eos and token in self.config.eos_ids):
            return "stop"
        return "length" if produced >= s.max_tokens else ""

    async def _stream(
        self,
        request_id: str,
        last: int,
        produced: int,
        s: worker_pb2.WorkerSampling,
        first_chunk: list[int],
        admission_ms: float,
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        """Tokens after `last` until max_tokens/stop; `first_chunk` goes out first."""
        reason = self._finish_reason(first_chunk[-1], produced, s) if first_chunk else ""
        if first_chunk or produced >= s.max_tokens:
            yield worker_pb2.TokenChunk(
                token_ids=first_chunk,
                finished=bool(reason) or produced >= s.max_tokens,
                finish_reason=reason or ("length" if produced >= s.max_tokens else ""),
                admission_ms=admission_ms,
                first_step_ms=0.1,
            )
            if reason or produced >= s.max_tokens:
                self.held.pop(request_id, None)
                return
        first = not first_chunk
        sent = 0
        while True:
            if self.config.token_delay_s:
                await asyncio.sleep(self.config.token_delay_s)
            await self._streams_run.wait()
            if request_id not in self.held:
                raise _Aborted()
            if self.config.cut_stream_after and sent >= self.config.cut_stream_after:
                return  # a broken worker: the stream ends without a finished chunk
            if self.config.hold_streams_after and sent >= self.config.hold_streams_after:
                await asyncio.Event().wait()  # a request that outlasts whatever the test does
            sent += 1
            last = (last + 1) % self.config.vocab_size
            produced += 1
            reason = self._finish_reason(last, produced, s)
            chunk = worker_pb2.TokenChunk(
                token_ids=[last], finished=bool(reason), finish_reason=reason
            )
            if first:
                chunk.admission_ms, chunk.first_step_ms, first = admission_ms, 0.1, False
            if reason:
                self.held.pop(request_id, None)
                yield chunk
                return
            yield chunk

    # -- Worker service ----------------------------------------------------------------------

    async def GetStatus(
        self, request: worker_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStatus:
        await self._enter("GetStatus", context)
        return worker_pb2.WorkerStatus(
            worker_id=self.config.worker_id,
            role=self.config.role,
            draining=self.draining,
            num_waiting=0,
            num_running=len(self.held),
            waiting_tokens=0,
            free_blocks=self.free_blocks,
            total_blocks=self.config.total_blocks,
            block_size=self.config.block_size,
            kv_endpoint="",
            epoch=self.kv.epoch if self.kv is not None else self._epoch,
        )

    async def Reserve(
        self, request: worker_pb2.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReserveResponse:
        await self._enter("Reserve", context, request)
        need = self.blocks_for(request.num_prompt_tokens + request.max_tokens)
        self._next_transfer += 1
        transfer_id = f"{self.config.worker_id}-t{self._next_transfer}"
        if request.request_id in self.held:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, "request id already reserved")
        if not self._take(request.request_id, need, transfer_id):
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"need {need} blocks, {self.free_blocks} free"
            )
        first = self.config.total_blocks - self.free_blocks - need
        await self._reserves_run.wait()
        if self.config.reserve_answer_delay_s:  # a cancel now leaves the blocks held
            await asyncio.sleep(self.config.reserve_answer_delay_s)
        return worker_pb2.ReserveResponse(
            ticket=worker_pb2.TransferTicket(
                transfer_id=transfer_id,
                epoch=self._epoch,
                block_ids=list(range(first, first + need)),
                decode_worker_id=self.config.worker_id,
                num_tokens=request.num_prompt_tokens,
            )
        )

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        await self._enter("Prefill", context, request)
        rid = request.request_id
        peer = request.ticket.decode_worker_id
        if peer in self.kv_push_fails_to:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"KV transfer of request {rid!r} to decode worker {peer} failed: send failed",
                ((FAILED_PEER, peer),),
            )
        if not self._take(rid, self.blocks_for(len(request.prompt_token_ids))):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no prefill blocks")
        release = True
        cached = self.kv.prefill(request.prompt_token_ids) if self.kv is not None else 0
        try:
            delay = self.config.prefill_delay_s + self.config.prefill_token_delay_s * (
                len(request.prompt_token_ids) - cached
            )
            if delay:
                await asyncio.sleep(delay)
            await self._prefills_run.wait()
            push = self._pushes_run.get(peer)
            if push is not None:
                await push.wait()
            if rid not in self.held:
                await context.abort(grpc.StatusCode.ABORTED, "aborted during prefill")
        except asyncio.CancelledError:
            release = self.config.release_on_cancel
            raise
        finally:
            self._release_if(rid, release)
        first = (request.prompt_token_ids[-1] + 1) % self.config.vocab_size
        reason = self._finish_reason(first, 1, request.sampling)
        return worker_pb2.PrefillResponse(
            first_token=first,
            cached_tokens=cached,
            queue_ms=0.2,
            compute_ms=1.0,
            transfer_ms=0.3,
            finished=bool(reason),
            finish_reason=reason,
        )

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        await self._enter("Decode", context, request)
        rid = request.request_id
        held = self.held.get(rid)
        if held is None or held.transfer_id != request.transfer_id:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no reservation for {rid}")
        async for chunk in self._guarded(
            rid, self._stream(rid, request.first_token, 1, request.sampling, [], 0.5), context
        ):
            yield chunk

    async def Generate(
        self, request: worker_pb2.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        await self._enter("Generate", context, request)
        rid, s = request.request_id, request.sampling
        if not self._take(rid, self.blocks_for(len(request.prompt_token_ids) + s.max_tokens)):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no blocks")
        try:
            if self.config.prefill_delay_s:
                await asyncio.sleep(self.config.prefill_delay_s)
        except asyncio.CancelledError:
            self._release_if(rid, self.config.release_on_cancel)
            raise
        first = (request.prompt_token_ids[-1] + 1) % self.config.vocab_size
        async for chunk in self._guarded(
            rid, self._stream(rid, first, 1, s, [first], 0.2), context
        ):
            yield chunk

    async def _guarded(
        self,
        rid: str,
        chunks: AsyncIterator[worker_pb2.TokenChunk],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        try:
            async for chunk in chunks:
                yield chunk
        except _Aborted:
            await context.abort(grpc.StatusCode.ABORTED, f"{rid} aborted")
        except asyncio.CancelledError:
            self._release_if(rid, self.config.release_on_cancel)
            raise

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        await self._enter("Abort", context)
        self.aborts.append(request.request_id)
        return worker_pb2.AbortResponse(found=self.held.pop(request.request_id, None) is not None)

    async def StreamKVEvents(
        self, request: worker_pb2.StreamKVEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.KVEvent]:
        await self._enter("StreamKVEvents", context)
        if self.kv is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no fake KV cache")
        assert self.kv is not None
        heartbeat_s = request.heartbeat_s or 1.0
        async for item in self.kv.source().events(request.from_seq, heartbeat_s):
            if isinstance(item, Heartbeat):
                yield worker_pb2.KVEvent(
                    worker_id=item.worker_id, epoch=item.epoch, seq=item.seq, kind="heartbeat"
                )
            else:
                yield worker_pb2.KVEvent(
                    worker_id=item.worker_id,
                    epoch=item.epoch,
                    seq=item.seq,
                    kind=item.kind,
                    block_hashes=[hash_to_bytes(h) for h in item.block_hashes],
                )

    async def GetKVSnapshot(
        self, request: worker_pb2.GetKVSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.KVSnapshot:
        await self._enter("GetKVSnapshot", context)
        if self.kv is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no fake KV cache")
        assert self.kv is not None
        snap = await self.kv.source().snapshot()
        return worker_pb2.KVSnapshot(
            worker_id=snap.worker_id,
            epoch=snap.epoch,
            seq=snap.seq,
            block_hashes=[hash_to_bytes(h) for h in snap.block_hashes],
        )

    async def SetRole(
        self, request: worker_pb2.SetRoleRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStatus:
        await self._enter("SetRole", context)
        self.config.role = request.role
        return await self.GetStatus(worker_pb2.GetStatusRequest(), context)


class _Aborted(Exception):
    """The request was aborted while its stream ran."""


async def _main() -> None:
    p = argparse.ArgumentParser(description="model-free fake pdserve worker")
    p.add_argument("--role", default="decode")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--total-blocks", type=int, default=64)
    p.add_argument("--token-delay-s", type=float, default=0.0)
    p.add_argument(
        "--hold-streams-after", type=int, default=0, help="streams hold after N chunks (0: never)"
    )
    args = p.parse_args()
    worker = FakeWorker(
        FakeWorkerConfig(
            role=args.role,
            vocab_size=args.vocab_size,
            total_blocks=args.total_blocks,
            token_delay_s=args.token_delay_s,
            hold_streams_after=args.hold_streams_after,
        )
    )
    addr = await worker.start(port=args.port)
    print(f"fake-worker port={addr.rsplit(':', 1)[1]}", flush=True)
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(_main())
