"""Errors that end a request with a gRPC status. Runs in the router process.

`RouterError(code, message)` is raised anywhere on the request path and turned into the
client's status once, at the edge: the gRPC `Generate` handler (a gRPC status) or the HTTP front
(an OpenAI error object with the matching HTTP status). `InvalidRequest` is the
INVALID_ARGUMENT case and keeps the offending field's path, so each edge can name the field in
its own vocabulary. `worker_error` maps a failed worker call to the status the client gets,
following the status table in `router/server.py`.

Two texts per error: `message`, the whole story for the router's log (worker addresses,
transfer ids, the transport's own words), and `public`, what the client reads: what failed in
the client's terms, never a worker address, transfer id or transport text. The lifecycle logs
`message` with the request id and hands the edges an error whose `public` ends with
``(request <id>)``, so a client's report can be matched to the log.
"""

from __future__ import annotations

import grpc


class RouterError(Exception):
    """Ends a request with a gRPC status; `public` (default: `message`) goes to the client,
    `message` to the log (module docstring)."""

    def __init__(self, code: grpc.StatusCode, message: str, public: str | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.public = message if public is None else public


class InvalidRequest(RouterError):
    """Bad client input (INVALID_ARGUMENT). `message` is ``"<field>: <problem>"``."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")
        self.field = field
        self.problem = problem


class Retryable(RouterError):
    """A failure before anything reached the client, on a worker worth avoiding next time."""

    def __init__(
        self, code: grpc.StatusCode, message: str, address: str, public: str | None = None
    ) -> None:
        super().__init__(code, message, public)
        self.address = address


def worker_error(exc: grpc.aio.AioRpcError, what: str, public_what: str) -> RouterError:
    """Map a failed worker call to the status the client gets (`router/server.py`'s table).
    `what` names the call and the worker (the log's text); `public_what` names the call
    without the worker (``"Reserve on a decode worker"``). Only a RESOURCE_EXHAUSTED keeps the
    worker's own words for the client (how much room was missing)."""
    code = exc.code()
    text = f"{what} failed: {code.name}: {exc.details()}"
    public = f"{public_what} failed ({code.name})"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return RouterError(code, text, f"{public_what} failed: {exc.details()}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RouterError(code, text, public)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED):
        # the router sent something wrong
        return RouterError(grpc.StatusCode.INTERNAL, text, f"{public_what} failed (INTERNAL)")
    # Everything else means the worker cannot serve it, including CANCELLED: a worker call that
    # ends CANCELLED was cancelled on the worker's side (e.g. it shut down); a client cancel
    # reaches the handler as asyncio.CancelledError instead.
    return RouterError(grpc.StatusCode.UNAVAILABLE, text, f"{public_what} failed (UNAVAILABLE)")
