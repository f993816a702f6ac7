"""Property-based fuzzing of the public API against a router over fake workers.

Runs in the pytest process: the router and two fake workers live on an event loop in a
background thread for the whole module; hypothesis drives a sync gRPC client from the test
thread. Every fuzzed call must end with a documented status (`tests.fakes.fuzz.GENERATE_OK`),
never INTERNAL or UNKNOWN, the router must stay up and serve a plain request right after, and
no fake worker may be left holding blocks. Example counts are bounded so the module takes a few
seconds.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from proto.pdserve.v1 import inference_pb2 as ipb
from tests.fakes.cluster import FakeCluster, fake_cluster
from tests.fakes.fuzz import GENERATE_OK, generate_requests, wire_payloads

FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
PLAIN = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5, 6, 7]), sampling={"max_tokens": 3})


class _Background:
    """A fake cluster on its own loop thread; `address` is the router's."""

    def __init__(self, model_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._stop = asyncio.Event()
        self._ready: Future[FakeCluster] = Future()
        self._done = asyncio.run_coroutine_threadsafe(self._main(model_dir), self.loop)
        self.cluster = self._ready.result(timeout=30)

    async def _main(self, model_dir: Path) -> None:
        self._stop = asyncio.Event()
        try:
            async with fake_cluster(model_dir, n_prefill=1, n_decode=1) as c:
                self._ready.set_result(c)
                await self._stop.wait()
        except BaseException as exc:
            if not self._ready.done():
                self._ready.set_exception(exc)
            raise

    def free_blocks_back(self) -> bool:
        return all(w.free_blocks == w.config.total_blocks for w in self.cluster.workers)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._done.result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def background(tiny_model_dir: Path) -> Iterator[_Background]:
    bg = _Background(tiny_model_dir)
    try:
        yield bg
    finally:
        bg.close()


@pytest.fixture(scope="module")
def channel(background: _Background) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(
        background.cluster.router.address, [("grpc.enable_http_proxy", 0)]
    ) as ch:
        yield ch


def _raw_generate(channel: grpc.Channel) -> Any:
    return channel.unary_stream(
        "/pdserve.v1.Inference/Generate",
        request_serializer=None,  # the payload goes out as it is
        response_deserializer=ipb.GenerateResponse.FromString,
    )


def _call(channel: grpc.Channel, payload: bytes) -> tuple[grpc.StatusCode, str]:
    try:
        for _ in _raw_generate(channel)(payload, timeout=10.0):
            pass
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, ""


def _still_serves(channel: grpc.Channel) -> None:
    code, details = _call(channel, PLAIN.SerializeToString())
    assert code == grpc.StatusCode.OK, f"the next plain request failed: {code.name} {details}"


@FUZZ
@given(req=generate_requests())
def test_random_field_values_get_a_documented_status(
    channel: grpc.Channel, background: _Background, req: ipb.GenerateRequest
) -> None:
    code, details = _call(channel, req.SerializeToString())
    assert code in GENERATE_OK, f"{code.name}: {details} for {req}"
    _still_serves(channel)


@FUZZ
@given(payload=wire_payloads())
def test_random_bytes_get_a_documented_status(
    channel: grpc.Channel, background: _Background, payload: bytes
) -> None:
    code, details = _call(channel, payload)
    assert code in GENERATE_OK, f"{code.name}: {details} for {payload!r}"
    _still_serves(channel)


def test_fuzzing_left_no_blocks_held(background: _Background, channel: grpc.Channel) -> None:
    _still_serves(channel)
    deadline = 50
    while not background.free_blocks_back() and deadline:
        threading.Event().wait(0.1)
        deadline -= 1
    assert background.free_blocks_back(), [w.held for w in background.cluster.workers]


@settings(max_examples=60, deadline=None)
@given(payload=wire_payloads())
def test_get_model_info_never_internal(channel: grpc.Channel, payload: bytes) -> None:
    info = channel.unary_unary(
        "/pdserve.v1.Inference/GetModelInfo",
        request_serializer=None,
        response_deserializer=ipb.ModelInfo.FromString,
    )
    try:
        info(payload, timeout=5.0)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc  # type: ignore[attr-defined]
    _still_serves(channel)


def test_get_model_info_malformed_is_invalid_argument(channel: grpc.Channel) -> None:
    info = channel.unary_unary(
        "/pdserve.v1.Inference/GetModelInfo",
        request_serializer=None,
        response_deserializer=ipb.ModelInfo.FromString,
    )
    with pytest.raises(grpc.RpcError) as err:
        info(b"\x12\x05ab", timeout=5.0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
