"""The HTTP front's aiohttp application and its server. Runs in the router process, on the
router's own event loop (next to the grpc.aio server; no extra process or hop).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (`handlers`).

Middlewares, outermost first: `openai_errors` (gives every request its id, `request_id`, and
turns every failure into an OpenAI error object with its status: a handler's `OpenAIError`,
aiohttp's own 404/405/413, and a bug as a 500 whose message is generic plus the request id —
no exception text ever reaches a client — with the traceback in the log at that id), then the
`middlewares` the caller passes to `build_app` /
`start_http_front` — authentication (`router.auth.PublicAuth.http_middleware`) raises
`OpenAIError(401, ...)` and is answered with an OpenAI error object like every other refusal.
With an `ssl_context` the front serves HTTPS (the public API's certificate, and mutual TLS
when the gRPC port asks for client certificates).

What never reaches a handler is answered here too (`OpenAIRequestHandler.handle_error`): a
request aiohttp's parser refuses (a header line over `max_line_size`, an HTTP/2 preface, bytes
that are not HTTP) gets a JSON OpenAI error object that names the kind of problem and echoes
none of the request — its headers may carry a token — and is logged as one INFO line with the
peer and the exception's class, no text and no traceback: unauthenticated clients cannot write
tokens or ERROR tracebacks into the log. A connection must deliver a complete request head
within `header_timeout_s` of connecting or of its previous response (aiohttp's keep-alive
timer, which closes a connection still waiting for a request), so slow-header sockets are
closed; a body must arrive within `FrontState.body_timeout_s` (408 otherwise). Request bodies
are never decompressed (`auto_decompress` off): a body with a `Content-Encoding` other than
identity is refused 415 by the handlers (`handlers.read_body`), so a compressed or falsely labelled
body neither reaches a decoder nor raises inside aiohttp. An ``Expect`` other than
``100-continue`` gets an OpenAI error object (417), as every other refusal (`expect_continue`).
"""

from __future__ import annotations

import logging
import ssl
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiohttp import HttpVersion11, web
from aiohttp.http_exceptions import BadHttpMethod, BadStatusLine, InvalidHeader, LineTooLong
from aiohttp.typedefs import Handler, Middleware
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from model_runtime.config import ModelConfig
from router.http import handlers
from router.http.body_pool import BodyPool, BodySettings
from router.http.chat_template import ChatTemplate
from router.http.errors import OpenAIError, internal_error
from router.http.handlers import REQUEST_ID, STATE, FrontState
from router.lifecycle import RequestLifecycle

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 2**20
"""Largest request body accepted (413 beyond): room for a long-context prompt as token ids."""


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Give the request its id and turn every failure into an OpenAI error object (module
    docstring): a bug is a 500 saying only "internal router error (request <id>)"; its
    exception and traceback go to the log, on a line with the same id."""
    rid = request[REQUEST_ID] = uuid.uuid4().hex
    try:
        return await handler(request)
    except OpenAIError as err:
        return _error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = exc.reason.lower().replace(" ", "_")  # "Request Entity Too Large" -> ...
        return _error_response(OpenAIError(exc.status, exc.reason, None, code))
    except Exception:
        log.exception("HTTP %s %s failed (request %s)", request.method, request.path, rid)
        return _error_response(internal_error(rid))


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """The routes' ``Expect`` handler: ``100-continue`` (HTTP/1.1) is answered as aiohttp
    does; any other expectation gets a 417 OpenAI error object (aiohttp's own is plain text).
    Runs before the middlewares."""
    expect = request.headers.get("Expect", "")
    if request.version != HttpVersion11:
        return None
    if expect.lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the response proper has not started
        return None
    err = OpenAIError(417, "Expect: only 100-continue is supported", None, "expectation_failed")
    return _error_response(err)


def _error_response(err: OpenAIError) -> web.Response:
    return web.json_response(text=err.body().model_dump_json(), status=err.status)


_PARSER_PROBLEMS: tuple[tuple[type[BaseException], str], ...] = (
    (LineTooLong, "a request line or header is too long"),
    (BadHttpMethod, "not an HTTP/1.x request"),
    (BadStatusLine, "malformed request line"),
    (InvalidHeader, "malformed header"),
)


class OpenAIRequestHandler(RequestHandler):
    """aiohttp's connection handler, with requests its parser refused answered as OpenAI error
    objects and logged without their content (module docstring)."""

    __slots__ = ()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:  # not the client's doing: a bug, logged with its traceback
            rid = uuid.uuid4().hex
            log.error(
                "HTTP front: unhandled error from %s (request %s)",
                request.remote,
                rid,
                exc_info=exc,
            )
            err = internal_error(rid)
        else:
            problem = next(
                (text for kind, text in _PARSER_PROBLEMS if isinstance(exc, kind)),
                "malformed HTTP request",
            )
            log.info(
                "HTTP front: refused a malformed request from %s: %d %s",
                request.remote,
                status,
                type(exc).__name__,
            )
            err = OpenAIError(status, f"bad request: {problem}", None, "bad_request")
        if request.writer.output_size > 0:  # as aiohttp: the response already started
            raise ConnectionError("response already sent, cannot send an error")
        resp = _error_response(err)
        resp.force_close()
        return resp


class _OpenAIServer(web.Server):
    """`web.Server` whose connections are `OpenAIRequestHandler`s."""

    def __call__(self) -> RequestHandler:
        handler = super().__call__()
        handler.__class__ = OpenAIRequestHandler  # same slots: a subclass without state
        return handler


class _OpenAIAppRunner(web.AppRunner):
    """`web.AppRunner` serving through `_OpenAIServer`."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _OpenAIServer  # a subclass without state of its own
        return server


def build_app(state: FrontState, middlewares: Sequence[Middleware] = ()) -> web.Application:
    """The aiohttp application over `state` (routes and middlewares: module docstring)."""
    app = web.Application(middlewares=[openai_errors, *middlewares], client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    expect = expect_continue
    app.router.add_post("/v1/completions", handlers.completions, expect_handler=expect)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions, expect_handler=expect)
    app.router.add_get("/v1/models", handlers.models, expect_handler=expect)
    app.router.add_get("/health", handlers.health, expect_handler=expect)
    app.router.add_get("/metrics", handlers.metrics, expect_handler=expect)
    return app


@dataclass
class HttpFront:
    """A running HTTP front; `port` is the bound port."""

    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        """Base URL of the OpenAI API (what `openai.OpenAI(base_url=...)` takes)."""
        return f"http://{self.host}:{self.port}/v1"

    async def stop(self) -> None:
        """Stop listening; requests still running get the runner's shutdown timeout, then
        their handlers are cancelled (which aborts them on the workers); the body helpers
        stop."""
        await self.runner.cleanup()
        self.runner.app[STATE].bodies.close()


async def start_http_front(
    lifecycle: RequestLifecycle,
    host: str,
    port: int,
    is_serving: Callable[[], bool],
    metrics: Callable[[str], tuple[bytes, str]] | None = None,
    middlewares: Sequence[Middleware] = (),
    shutdown_timeout_s: float = 1.0,
    ssl_context: ssl.SSLContext | None = None,
    header_timeout_s: float = 15.0,
    body_timeout_s: float = 60.0,
) -> HttpFront:
    """Serve the HTTP front on `host:port` (0: a free port) on the running loop.
    `header_timeout_s` / `body_timeout_s`: module docstring.

    Raises ValueError for a model folder whose chat template is unusable and RuntimeError
    when the port cannot be bound.
    """
    config = lifecycle.config
    template = ChatTemplate.load(config.model_dir)
    bodies = BodyPool(
        BodySettings(
            str(config.model_dir),
            config.served_model_name,
            lifecycle.limits,
            config.http_default_max_tokens,
        )
    )
    weights = ModelConfig.from_model_dir(config.model_dir).weights_label()
    state = FrontState(
        lifecycle,
        template,
        is_serving,
        metrics,
        int(time.time()),
        bodies,
        weights,
        body_timeout_s,
    )
    runner = _OpenAIAppRunner(
        build_app(state, middlewares),
        handler_cancellation=True,  # a client that goes away cancels its handler (= abort)
        access_log=None,
        shutdown_timeout=shutdown_timeout_s,
        keepalive_timeout=header_timeout_s,  # no complete request head in time: closed
        auto_decompress=False,  # a Content-Encoding body is refused, never decoded (415)
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise RuntimeError(f"HTTP front cannot bind {host}:{port}: {exc}") from exc
    bound = runner.addresses[0][1]
    scheme = "http" if ssl_context is None else "https"
    log.info("HTTP front (OpenAI API) on %s://%s:%d/v1", scheme, host, bound)
    return HttpFront(runner, host, int(bound))
