"""OpenAI error objects and the HTTP status of each router outcome. Runs in the router process.

Every failure at the HTTP front becomes ``{"error": {"message", "type", "param", "code"}}``
with the status below; `code` is the gRPC status name in lower case (what a gRPC client of the
same request would have got), `param` the OpenAI field at fault when there is one.

| router outcome (gRPC status)          | HTTP | type                    |
|---------------------------------------|------|-------------------------|
| INVALID_ARGUMENT (bad input)          | 400  | invalid_request_error   |
| unknown model (NOT_FOUND)             | 404  | not_found_error         |
| RESOURCE_EXHAUSTED (queue full)       | 429  | rate_limit_error        |
| UNAVAILABLE (no healthy worker)       | 503  | service_unavailable     |
| DEADLINE_EXCEEDED                     | 504  | timeout_error           |
| INTERNAL and anything else            | 500  | server_error            |

Any other 4xx (413 body too large, 408 body too slow, a malformed request) is an
`invalid_request_error` with a `code` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc
from pydantic import ValidationError

from router.errors import InvalidRequest, RouterError
from router.http.protocol import ErrorInfo, ErrorResponse

_BY_CODE: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
}
_BY_STATUS: dict[int, str] = {status: kind for status, kind in _BY_CODE.values()}


class OpenAIError(Exception):
    """Ends an HTTP request with `status` and an OpenAI error object."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def __reduce__(self) -> tuple[type[OpenAIError], tuple[int, str, str | None, str | None]]:
        """Pickled whole (a body helper process raises it: `router.http.body_pool`)."""
        return (OpenAIError, (self.status, self.message, self.param, self.code))

    @classmethod
    def invalid(cls, param: str, problem: str) -> OpenAIError:
        """A 400 naming `param`: message ``"<param>: <problem>"``."""
        return cls(400, f"{param}: {problem}", param, "invalid_argument")

    def body(self) -> ErrorResponse:
        kind = _BY_STATUS.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code)
        )


def internal_error(request_id: str) -> OpenAIError:
    """The 500 a client gets for a failure that is not its doing: no detail, only the id to
    quote (the log line with the exception carries the same id)."""
    return OpenAIError(500, f"internal router error (request {request_id})", None, "internal")


def from_router_error(err: RouterError, rename: FieldRename | None = None) -> OpenAIError:
    """The HTTP form of a router outcome. An `InvalidRequest`'s field path (gRPC names, e.g.
    ``sampling.top_p``) becomes the OpenAI field this request used (`field_name`)."""
    status, _ = _BY_CODE.get(err.code, (500, "server_error"))
    if isinstance(err, InvalidRequest):
        param = field_name(err.field, rename or FieldRename())
        return OpenAIError(status, f"{param}: {err.problem}", param, "invalid_argument")
    return OpenAIError(status, err.public, None, err.code.name.lower())


@dataclass(frozen=True)
class FieldRename:
    """How one HTTP request's fields map onto `GenerateRequest` paths: `heads` renames a
    leading name (``prompt`` -> ``messages``, ``max_tokens`` -> ``max_completion_tokens``);
    `scalar` lists names the client sent as one value, whose ``[i]`` suffix is dropped (a
    `stop` given as a string)."""

    heads: dict[str, str] = field(default_factory=dict)
    scalar: frozenset[str] = frozenset()


def field_name(path: str, rename: FieldRename) -> str:
    """An OpenAI field name for a gRPC request path: ``sampling.top_p`` -> ``top_p``,
    ``sampling.stop[1]`` -> ``stop[1]``, ``token_ids.ids[3]`` -> ``prompt[3]``, ``text`` ->
    ``prompt``; then `rename` applies."""
    name = path.removeprefix("sampling.")
    for prompt_path in ("token_ids.ids", "token_ids", "text"):
        if name.startswith(prompt_path):
            name = "prompt" + name[len(prompt_path) :]
            break
    head, sep, rest = name.partition("[")
    if head in rename.scalar:
        sep = rest = ""
    return rename.heads.get(head, head) + (sep + rest if sep else "")


def _loc(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a field path: union-member tags (``str``,
    ``list[int]``, model names) are dropped, list indexes become ``[i]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part.islower() and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out or "body"


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})

_UNION_HINTS = {
    "prompt": "must be a string, a list of token ids, or a list holding one such item",
    "stop": "must be a string or a list of strings",
}


def from_validation_error(exc: ValidationError) -> OpenAIError:
    """A 400 for a request body pydantic refused, naming the first field at fault."""
    errors: list[Any] = exc.errors(include_url=False)
    first = errors[0]
    path = _loc(tuple(first["loc"]))
    kind = first["type"]
    top = path.split(".")[0].split("[")[0]
    if kind == "json_invalid":
        return OpenAIError(400, f"request body is not valid JSON: {first['msg']}", None)
    if kind == "extra_forbidden":
        return OpenAIError.invalid(path, "unsupported field (pdserve does not implement it)")
    if kind == "missing":
        return OpenAIError.invalid(path, "field required")
    if top in _UNION_HINTS and len(errors) > 1 and path == top:
        return OpenAIError.invalid(top, _UNION_HINTS[top])
    return OpenAIError.invalid(path, str(first["msg"]))
