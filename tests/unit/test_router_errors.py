"""Unit test of `router.errors.worker_error`: a failed worker call -> the client's status."""

from __future__ import annotations

import grpc
import pytest

from router.errors import worker_error

S = grpc.StatusCode
CASES = [
    (S.UNAVAILABLE, S.UNAVAILABLE),
    (S.DEADLINE_EXCEEDED, S.DEADLINE_EXCEEDED),
    (S.RESOURCE_EXHAUSTED, S.RESOURCE_EXHAUSTED),
    (S.CANCELLED, S.UNAVAILABLE),  # cancelled by the worker (shutdown), not by the client
    (S.ABORTED, S.UNAVAILABLE),
    (S.FAILED_PRECONDITION, S.UNAVAILABLE),
    (S.INTERNAL, S.UNAVAILABLE),
    (S.INVALID_ARGUMENT, S.INTERNAL),  # the router validated: a worker refusing is a bug
    (S.UNIMPLEMENTED, S.INTERNAL),
]


@pytest.mark.parametrize("worker_code,client_code", CASES, ids=[c[0].name for c in CASES])
def test_worker_error_mapping(worker_code: grpc.StatusCode, client_code: grpc.StatusCode) -> None:
    detail = "gloo: connection to 10.0.0.7:29500 closed, transfer 7f3a"
    exc = grpc.aio.AioRpcError(worker_code, grpc.aio.Metadata(), grpc.aio.Metadata(), detail)
    err = worker_error(exc, "Decode on decode worker h:1", "Decode on a decode worker")
    assert err.code == client_code
    assert err.message == f"Decode on decode worker h:1 failed: {worker_code.name}: {detail}"
    # the client's text names the call, never the worker's address or the transport's words
    assert err.public.startswith("Decode on a decode worker failed")
    assert "h:1" not in err.public
    if client_code != S.RESOURCE_EXHAUSTED:  # that one keeps the worker's room figures
        assert detail not in err.public and err.public.endswith(f"({client_code.name})")
