"""What the client sees of one request: token batches turned into `GenerateResponse`s (text
deltas, stop strings) and the final message's usage, timings and workers.

Runs in the router process, inside the `Generate` handler's task (`flow.RequestRun` owns one).
Whatever happens among the workers — a retry before the first token, a migration to another
decode worker mid-stream — the client gets one stream: every token exactly once, in order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from model_runtime.tokenizer import Tokenizer
from proto.pdserve.v1 import inference_pb2
from router.textstream import TextStream

Send = Callable[[inference_pb2.GenerateResponse], Awaitable[None]]


log = logging.getLogger(__name__)


@dataclass
class RunTimings:
    """Milliseconds, filled in as the request goes; becomes `inference_pb2.Timings` (same
    field names)."""

    router_queue_ms: float = 0.0
    prefill_queue_ms: float = 0.0
    prefill_compute_ms: float = 0.0
    kv_transfer_ms: float = 0.0
    decode_admission_ms: float = 0.0
    first_decode_step_ms: float = 0.0
    ttft_ms: float = 0.0


@dataclass
class FinalFacts:
    """What the final message reports besides the stream itself (set by the worker calls)."""

    prompt_tokens: int
    cached_tokens: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""
    migrations: int = 0
    prefill_path: str = ""  # the first leg's: "remote" | "local" (hybrid), "" colocated
    prefill_path_reason: str = ""  # why (`router.hybrid.PathReason`)


@dataclass
class ClientStream:
    """The client's side of one request.

    `push` queues each batch of tokens and returns; one writer task sends the queue in order.
    While a write is in flight, later batches pile up and go out as one message (their tokens
    and text joined), so a router whose loop is busy — many streams, a burst of new calls —
    writes fewer, larger messages instead of falling further behind. The final message is
    waited for (`push` returns True once it is written); `close()` stops the writer when the
    request ends any other way.
    """

    request_id: str
    send: Send
    tokenizer: Tokenizer
    stop: Sequence[str]
    t_arrival: float  # time.perf_counter() when the handler started
    facts: FinalFacts
    min_tokens: int = 0  # stop strings are not looked for before this many tokens
    timings: RunTimings = field(default_factory=RunTimings)
    tokens: list[int] = field(default_factory=list)  # every token sent so far
    _text: TextStream | None = None
    _outbox: list[inference_pb2.GenerateResponse] = field(default_factory=list)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _writer: asyncio.Task[None] | None = None

    async def push(
        self,
        tokens: Sequence[int],
        finished: bool,
        finish_reason: str = "",
        logprobs: Sequence[inference_pb2.TokenLogprob] = (),
    ) -> bool:
        """Send `tokens` (cut at a stop string) with their `logprobs` (empty when not asked
        for) and, when the request ends here — a stop string matched, or the worker says
        `finished` — the final info; True when it ended."""
        if self._text is None:
            self._text = TextStream(self.tokenizer, self.stop, self.min_tokens)
        text = self._text
        sent: list[int] = []
        pieces: list[str] = []
        for tok in tokens:
            sent.append(tok)
            delta = text.push([tok])
            pieces.append(delta.text)
            if delta.stopped:
                break
        self.tokens += sent
        finish = ""
        if text.stopped:
            finish = "stop"  # holders (D) are aborted by the caller: the worker still runs
        elif finished:
            pieces.append(text.finish())
            finish = "stop" if text.stopped else (finish_reason or "length")
        resp = inference_pb2.GenerateResponse(
            request_id=self.request_id,
            token_ids=sent,
            text="".join(pieces),
            logprobs=list(logprobs)[: len(sent)],
        )
        if sent and not self.timings.ttft_ms:
            self.timings.ttft_ms = (time.perf_counter() - self.t_arrival) * 1e3
        if finish:
            resp.final.CopyFrom(self._final(finish))
        self._outbox.append(resp)
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_all())
            self._writer.add_done_callback(self._writer_ended)
        elif self._writer.done():
            await self._writer  # it failed: raise its error here
        self._wake.set()
        if finish:
            await asyncio.shield(self._writer)  # the final message is out when we return
        return bool(finish)

    def close(self) -> None:
        """Stop the writer (the request ended without a final message); idempotent."""
        if self._writer is not None and not self._writer.done():
            self._writer.cancel()

    def _writer_ended(self, task: asyncio.Task[None]) -> None:
        """Retrieve a failed writer's error (a send to a client that went away): `push` raises
        it if it runs again; if the request was ended instead (`close`), it is logged here at
        DEBUG rather than by asyncio as an unretrieved task exception at ERROR."""
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.debug("request %s: writing to the client failed: %r", self.request_id, exc)

    async def _write_all(self) -> None:
        """Send queued messages in order, joining what piled up; end after the final one."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._outbox:
                batch, self._outbox = self._outbox, []
                resp = batch[0] if len(batch) == 1 else _join(batch)
                await self.send(resp)
                if resp.HasField("final"):
                    return

    def _final(self, finish_reason: str) -> inference_pb2.FinalInfo:
        t, f = self.timings, self.facts
        return inference_pb2.FinalInfo(
            finish_reason=finish_reason,
            usage=inference_pb2.Usage(
                prompt_tokens=f.prompt_tokens,
                completion_tokens=len(self.tokens),
                cached_tokens=f.cached_tokens,
            ),
            timings=inference_pb2.Timings(
                **dataclasses.asdict(t), e2e_ms=(time.perf_counter() - self.t_arrival) * 1e3
            ),
            prefill_worker=f.prefill_worker,
            decode_worker=f.decode_worker,
            migrations=f.migrations,
            prefill_path=f.prefill_path,
            prefill_path_reason=f.prefill_path_reason,
        )


def _join(batch: list[inference_pb2.GenerateResponse]) -> inference_pb2.GenerateResponse:
    """Consecutive responses as one: tokens, logprobs and text in order, the last one's final
    info."""
    out = inference_pb2.GenerateResponse(request_id=batch[0].request_id)
    for resp in batch:
        out.token_ids.extend(resp.token_ids)
        out.logprobs.extend(resp.logprobs)
    out.text = "".join(resp.text for resp in batch)
    if batch[-1].HasField("final"):
        out.final.CopyFrom(batch[-1].final)
    return out
