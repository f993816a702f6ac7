"""The HTTP front's request handlers (aiohttp). Runs in the router process, on its event loop.

`/v1/completions` and `/v1/chat/completions`: read the body (`read_body`: a body too large for
any request the model can serve is refused unparsed), parse it (pydantic; a 400 names the
field), check the model name (404), translate to a `GenerateRequest` (`translate`) — a body
over `body_pool.INLINE_BODY_BYTES` all of that in a helper process (`body_pool.BodyPool`: a
large JSON body holds the GIL in proportion to its structure), a small one here with a chat
request's render and tokenization on the lifecycle's tokenizer threads — and run it
through the router's `RequestLifecycle` — the same path, admission, deadline
(`default_timeout_s`), aborts and metrics as a gRPC `Generate`.

Streaming (`stream: true`) is Server-Sent Events: ``data: <chunk JSON>\\n\\n`` per chunk
(`responses`), then ``data: [DONE]\\n\\n``. The 200 and its headers go out with the first
chunk, i.e. once the first token exists, so a request refused before that (400, 429, 503,
504) still gets its status and an error object. A failure after the stream started is sent as
one ``data: {"error": {...}}`` event, then ``[DONE]``.

Client disconnect: the server runs with aiohttp's handler cancellation, so a client that goes
away cancels the handler task, and the lifecycle aborts the request on every worker holding
it, exactly as a gRPC cancel does. A write that finds the connection already closed does the
same (it raises `asyncio.CancelledError`), the first one included (the 200's headers): a client
gone by then is a cancel, never a router error.

Each HTTP request's id (`REQUEST_ID`, set by `server.openai_errors`) is the id of its
`GenerateRequest` too, so an error a client quotes is the id in the router's log.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from proto.pdserve.v1 import inference_pb2
from router.errors import RouterError
from router.http.body_pool import INLINE_BODY_BYTES, BodyPool, parse_body
from router.http.chat_template import ChatTemplate
from router.http.errors import OpenAIError, from_router_error
from router.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from router.http.responses import ChatFormatter, CompletionFormatter, dump
from router.http.translate import Translated, chat_request, completion_request, oversized_body
from router.lifecycle import RequestLifecycle
from router.request_trace import TraceStart
from router.validation import ModelLimits

Formatter = CompletionFormatter | ChatFormatter


@dataclass
class FrontState:
    """What every handler needs; one per HTTP front (`app[STATE]`)."""

    lifecycle: RequestLifecycle
    template: ChatTemplate | None
    is_serving: Callable[[], bool]
    # (body, content type) of /metrics for a scrape's Accept header (OpenMetrics when asked)
    metrics: Callable[[str], tuple[bytes, str]] | None
    created: int  # when the front started (the model card's `created`)
    bodies: BodyPool  # large bodies are translated in its helper processes
    weights: str  # what the weights are (`ModelConfig.weights_label`), for the model card
    body_timeout_s: float = 60.0  # a request body must arrive within this (408 otherwise)

    @property
    def model_name(self) -> str:
        return self.lifecycle.config.served_model_name


STATE = web.AppKey("pdserve_front", FrontState)
REQUEST_ID = web.RequestKey("pdserve_request_id", str)
"""The request's id, given by the outermost middleware (`server.openai_errors`)."""


async def read_body(request: web.Request, limits: ModelLimits, chat: bool) -> bytes:
    """The request body's bytes. A body beyond `limits.max_json_body_bytes` is refused before
    it is parsed (`oversized_body`, from its first bound + 1 bytes, the rest never read into
    memory): no request the model can serve is that large. A body
    sent compressed (any `Content-Encoding` but identity) is refused 415 unread: the front
    never decompresses (`server`), so a gzip bomb or a mislabelled body costs nothing."""
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise OpenAIError(
            415,
            "Content-Encoding: request bodies must be sent uncompressed (identity)",
            None,
            "unsupported_media_type",
        )
    bound = limits.max_json_body_bytes
    try:
        async with asyncio.timeout(request.app[STATE].body_timeout_s):
            declared, most = request.content_length, request.client_max_size
            if not bound or (declared is not None and most and declared > most):
                return await request.read()  # aiohttp refuses past client_max_size: 413
            # At most the bound + 1 bytes are ever held: what lies beyond is never buffered
            # or copied on the loop (aiohttp discards it after the answer), so refusing a body
            # costs the same at 20 MB as at the bound.
            try:
                raw = await request.content.readexactly(bound + 1)
            except asyncio.IncompleteReadError as short:  # the whole body, within the bound
                return short.partial
    except TimeoutError:
        raise OpenAIError(408, "request body not received in time", None, "timeout") from None
    raise oversized_body(raw, limits, chat)


class SSEWriter:
    """An SSE response, started (200 + headers) by its first event."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response: web.StreamResponse | None = None

    async def send(self, data: str) -> None:
        """Write one event (the first also writes the 200 and its headers). A client gone by
        then, at the first write or any later one, raises `asyncio.CancelledError`: the same
        path as a cancel (the request is aborted, counted CANCELLED, nothing logged as an
        error)."""
        try:
            if self.response is None:
                response = web.StreamResponse(
                    headers={
                        "Content-Type": "text/event-stream; charset=utf-8",
                        "Cache-Control": "no-cache",
                        "X-Accel-Buffering": "no",
                    }
                )
                self.response = response
                await response.prepare(self._request)
            await self.response.write(f"data: {data}\n\n".encode())
        except ConnectionResetError as exc:  # the client is gone: same path as a cancel
            raise asyncio.CancelledError("client disconnected") from exc

    async def close(self) -> web.StreamResponse:
        assert self.response is not None, "close() before any event"
        await self.response.write_eof()
        return self.response


def _trace_start(request: web.Request, operation: str, arrived_ns: int | None = None) -> TraceStart:
    """The request's trace: its W3C headers (only ``traceparent`` / ``tracestate`` are read;
    with tracing off, none), the GenAI operation, when it arrived if work ran before `run`."""
    tracing = request.app[STATE].lifecycle.tracer.enabled
    return TraceStart(request.headers if tracing else None, operation, arrived_ns)


async def _serve(
    request: web.Request, t: Translated, fmt: Formatter, trace: TraceStart
) -> web.StreamResponse:
    lifecycle = request.app[STATE].lifecycle
    if not t.stream:

        async def collect(resp: inference_pb2.GenerateResponse) -> None:
            fmt.add(resp)

        try:
            await lifecycle.run(t.request, collect, trace=trace)
        except RouterError as exc:
            raise from_router_error(exc, t.rename) from None
        return web.Response(body=fmt.whole().model_dump_json(), content_type="application/json")

    sse = SSEWriter(request)

    async def stream(resp: inference_pb2.GenerateResponse) -> None:
        for chunk in fmt.chunks(resp):
            await sse.send(dump(chunk, t.include_usage))

    try:
        await lifecycle.run(t.request, stream, trace=trace)
    except RouterError as exc:
        err = from_router_error(exc, t.rename)
        if sse.response is None:
            raise err from None
        await sse.send(err.body().model_dump_json())
    else:
        if t.include_usage:
            await sse.send(dump(fmt.usage_chunk(), True))
    await sse.send("[DONE]")
    return await sse.close()


async def completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/completions`."""
    state = request.app[STATE]
    raw = await read_body(request, state.lifecycle.limits, chat=False)
    rid = request[REQUEST_ID]
    if len(raw) > INLINE_BODY_BYTES:
        t = await state.bodies.translate("completion", raw, rid)
    else:
        t = completion_request(parse_body(raw, CompletionRequest, state.model_name), rid)
    fmt = CompletionFormatter(
        f"cmpl-{rid}", int(time.time()), state.model_name, state.lifecycle.tokenizer, t.logprobs
    )
    return await _serve(request, t, fmt, _trace_start(request, "text_completion"))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/chat/completions`."""
    state = request.app[STATE]
    lc = state.lifecycle
    arrived_ns = time.time_ns()
    raw = await read_body(request, lc.limits, chat=True)
    rid = request[REQUEST_ID]
    if len(raw) > INLINE_BODY_BYTES:
        t = await state.bodies.translate("chat", raw, rid)
    else:
        render = functools.partial(
            chat_request,
            parse_body(raw, ChatCompletionRequest, state.model_name),
            rid,
            state.template,
            lc.tokenizer,
            lc.limits,
            str(lc.config.model_dir),
            lc.config.http_default_max_tokens,
        )
        t = await lc.run_blocking(render)  # render + tokenize: never on the event loop
    created = int(time.time())
    fmt = ChatFormatter(
        f"chatcmpl-{rid}",
        created,
        state.model_name,
        lc.tokenizer,
        t.logprobs,
        parse_tools=t.parse_tools,
    )
    return await _serve(request, t, fmt, _trace_start(request, "chat", arrived_ns))


async def models(request: web.Request) -> web.Response:
    """`GET /v1/models`: the one served model."""
    state = request.app[STATE]
    card = ModelCard(
        id=state.model_name,
        created=state.created,
        max_model_len=state.lifecycle.limits.context_length,
        weights=state.weights,
    )
    return web.json_response(text=ModelList(data=[card]).model_dump_json())


async def health(request: web.Request) -> web.Response:
    """`GET /health`: 200 while a request could be routed now, else 503."""
    serving = request.app[STATE].is_serving()
    status = "serving" if serving else "not_serving"
    return web.json_response({"status": status}, status=200 if serving else 503)


async def metrics(request: web.Request) -> web.Response:
    """`GET /metrics`: the router's Prometheus metrics: the text exposition format, or
    OpenMetrics (with the histograms' trace-id exemplars) when the scrape's Accept asks for
    ``application/openmetrics-text``."""
    source = request.app[STATE].metrics
    if source is None:
        raise OpenAIError(404, "this router exports no metrics", None, "not_found")
    body, content_type = source(request.headers.get("Accept", ""))
    return web.Response(body=body, headers={"Content-Type": content_type})
