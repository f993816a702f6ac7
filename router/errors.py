"""Errors that end a request with a gRPC status. Runs in the router process.

`RouterError(code, message)` is raised anywhere on the request path and turned into the
client's status once, at the edge: the gRPC `Generate` handler (a gRPC status) or the HTTP front
(an OpenAI error object with the matching HTTP status). `InvalidRequest` is the
INVALID_ARGUMENT case and keeps the offending field's path, so each edge can name the field in
its own vocabulary. `worker_error` maps a failed worker call to the status the client gets,
following the status table in `router/server.py`.
"""

from __future__ import annotations

import grpc


class RouterError(Exception):
    """Ends a request with a gRPC status; `message` goes to the client."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class InvalidRequest(RouterError):
    """Bad client input (INVALID_ARGUMENT). `message` is ``"<field>: <problem>"``."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")
        self.field = field
        self.problem = problem


class Retryable(RouterError):
    """A failure before anything reached the client, on a worker worth avoiding next time."""

    def __init__(self, code: grpc.StatusCode, message: str, address: str) -> None:
        super().__init__(code, message)
        self.address = address


def worker_error(exc: grpc.aio.AioRpcError, what: str) -> RouterError:
    """Map a failed worker call to the status the client gets (`router/server.py`'s table)."""
    code = exc.code()
    text = f"{what} failed: {code.name}: {exc.details()}"
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return RouterError(code, text)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED):
        return RouterError(grpc.StatusCode.INTERNAL, text)  # the router sent something wrong
    # Everything else means the worker cannot serve it, including CANCELLED: a worker call that
    # ends CANCELLED was cancelled on the worker's side (e.g. it shut down); a client cancel
    # reaches the handler as asyncio.CancelledError instead.
    return RouterError(grpc.StatusCode.UNAVAILABLE, text)
