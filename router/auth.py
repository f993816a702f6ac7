"""The public API's credentials in a running router (`PublicAuth`). Runs in the router process.

Built from `RouterConfig.security` at start: the token file is read (and then watched for
changes on the router's loop), the TLS files are read when the port is bound. The gRPC server
gets `interceptors()` (the bearer-token check; health and reflection exempt) and binds with
`add_port` (TLS, or mutual TLS with `tls_client_ca`). An HTTP front shares the same rules:
`ssl_context()` for its socket and `http_allowed(path, authorization)` for each request
(`/health` open, `/metrics` open with `metrics_public`, everything else needs a token; a
refusal is HTTP 401 with an OpenAI error object: `http_middleware()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl

import grpc
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from router.http.errors import OpenAIError
from security.config import SecurityConfig
from security.grpc_auth import BearerTokenInterceptor
from security.tls import server_credentials
from security.tokens import TokenFile, bearer_token

OPEN_HTTP_PATHS = frozenset({"/health"})
"""HTTP paths every caller may use without a token (probes)."""
METRICS_PATH = "/metrics"

log = logging.getLogger(__name__)


class PublicAuth:
    """TLS and bearer tokens of the public API. `start()` after the loop runs, `stop()` once."""

    def __init__(self, security: SecurityConfig) -> None:
        security.check_files()
        self.security = security
        self.tokens = (
            TokenFile(security.auth_token_file) if security.auth_token_file is not None else None
        )
        self._watch: asyncio.Task[None] | None = None

    def describe(self) -> str:
        """How the API is protected, for the start-up log (no secret in it)."""
        s = self.security
        tls = "mutual TLS" if s.tls_client_ca else ("TLS" if s.tls else "plaintext")
        auth = f"{self.tokens.count} bearer token(s)" if self.tokens else "no token"
        return f"{tls}, {auth}"

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """The gRPC server's interceptors: the token check when a token file is set."""
        return [] if self.tokens is None else [BearerTokenInterceptor(self.tokens)]

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Bind the public `address` (TLS when configured); the bound port."""
        s = self.security
        if s.tls_cert is None or s.tls_key is None:
            return int(server.add_insecure_port(address))
        creds = server_credentials(s.tls_cert, s.tls_key, s.tls_client_ca)
        return int(server.add_secure_port(address, creds))

    def ssl_context(self) -> ssl.SSLContext | None:
        """A server TLS context for an HTTP socket (None: plaintext): the same certificate,
        and with `tls_client_ca` the same demand for a client certificate."""
        s = self.security
        if s.tls_cert is None or s.tls_key is None:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(s.tls_cert, s.tls_key)
        if s.tls_client_ca is not None:
            ctx.load_verify_locations(cafile=s.tls_client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def http_allowed(self, path: str, authorization: str | None) -> bool:
        """Whether an HTTP request for `path` with this ``Authorization`` header may proceed
        (module docstring); False is answered 401."""
        if self.tokens is None or path in OPEN_HTTP_PATHS:
            return True
        if path == METRICS_PATH and self.security.metrics_public:
            return True
        return self.tokens.check(bearer_token(authorization))

    def http_middleware(self) -> Middleware:
        """The HTTP front's aiohttp middleware: a request `http_allowed` refuses is answered
        401 with an OpenAI error object (the token is never echoed or logged)."""

        @web.middleware
        async def check_token(request: web.Request, handler: Handler) -> web.StreamResponse:
            if not self.http_allowed(request.path, request.headers.get("Authorization")):
                raise OpenAIError(401, "missing or invalid bearer token", code="invalid_api_key")
            return await handler(request)

        return check_token

    def start(self) -> None:
        """Watch the token file for changes (no-op without one)."""
        if self.tokens is not None and self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(
                self.tokens.watch(self.security.token_reload_s), name="token-file-watch"
            )

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
