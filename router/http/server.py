"""The HTTP front's aiohttp application and its server. Runs in the router process, on the
router's own event loop (next to the grpc.aio server; no extra process or hop).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (`handlers`).

Middlewares, outermost first: `openai_errors` (every failure becomes an OpenAI error object
with its status: a handler's `OpenAIError`, aiohttp's own 404/405/413, and a bug as a 500 with
its traceback in the log), then the `middlewares` the caller passes to `build_app` /
`start_http_front` — authentication (`router.auth.PublicAuth.http_middleware`) raises
`OpenAIError(401, ...)` and is answered with an OpenAI error object like every other refusal.
With an `ssl_context` the front serves HTTPS (the public API's certificate, and mutual TLS
when the gRPC port asks for client certificates).
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from router.http import handlers
from router.http.chat_template import ChatTemplate
from router.http.errors import OpenAIError
from router.http.handlers import STATE, FrontState
from router.lifecycle import RequestLifecycle

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 2**20
"""Largest request body accepted (413 beyond): room for a long-context prompt as token ids."""


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into an OpenAI error object (module docstring)."""
    try:
        return await handler(request)
    except OpenAIError as err:
        return _error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error_response(OpenAIError(exc.status, exc.reason, None, None))
    except Exception as exc:
        log.exception("HTTP %s %s failed", request.method, request.path)
        return _error_response(OpenAIError(500, f"router error: {exc!r}", None, "internal"))


def _error_response(err: OpenAIError) -> web.Response:
    return web.json_response(text=err.body().model_dump_json(), status=err.status)


def build_app(state: FrontState, middlewares: Sequence[Middleware] = ()) -> web.Application:
    """The aiohttp application over `state` (routes and middlewares: module docstring)."""
    app = web.Application(middlewares=[openai_errors, *middlewares], client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.metrics)
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
        their handlers are cancelled (which aborts them on the workers)."""
        await self.runner.cleanup()


async def start_http_front(
    lifecycle: RequestLifecycle,
    host: str,
    port: int,
    is_serving: Callable[[], bool],
    metrics: Callable[[], tuple[bytes, str]] | None = None,
    middlewares: Sequence[Middleware] = (),
    shutdown_timeout_s: float = 1.0,
    ssl_context: ssl.SSLContext | None = None,
) -> HttpFront:
    """Serve the HTTP front on `host:port` (0: a free port) on the running loop.

    Raises ValueError for a model folder whose chat template is unusable and RuntimeError
    when the port cannot be bound.
    """
    template = ChatTemplate.load(lifecycle.config.model_dir)
    state = FrontState(lifecycle, template, is_serving, metrics, int(time.time()))
    runner = web.AppRunner(
        build_app(state, middlewares),
        handler_cancellation=True,  # a client that goes away cancels its handler (= abort)
        access_log=None,
        shutdown_timeout=shutdown_timeout_s,
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
