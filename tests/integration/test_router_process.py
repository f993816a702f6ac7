"""The router as a process: it never imports torch, and `python -m router` serves requests.

Starts real processes (fake workers and the router) from the repository root and stops them by
PID; readiness is the port line each prints, then a health check (never a sleep).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.pdserve.v1 import inference_pb2 as ipb
from proto.pdserve.v1 import inference_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


def test_router_modules_never_import_torch() -> None:
    code = (
        "import sys\n"
        "import router, router.app, router.server, router.flow, router.pool, router.__main__\n"
        "from tests.fakes import cluster\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@contextmanager
def process(args: list[str], ready_prefix: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """Start `python args...` in the repo root; yield it and the port from its ready line."""
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith(ready_prefix):
            proc.kill()
            raise AssertionError(f"{args}: no ready line, got {line!r}; {proc.stderr.read()}")  # type: ignore[union-attr]
        yield proc, int(line.rsplit("port=", 1)[1])
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.slow
def test_cli_router_serves_and_reports_a_killed_worker(tiny_model_dir: Path) -> None:
    fake = ["-m", "tests.fakes.fake_worker"]
    # the decode worker's streams hold after 10 chunks: the long request is still streaming
    # when the worker is killed, on any machine (a 500-token stream stood in for that once)
    held = [*fake, "--hold-streams-after", "10"]
    with (
        process([*fake, "--role", "prefill"], "fake-worker") as (_, p_port),
        process([*held, "--role", "decode"], "fake-worker") as (decode, d_port),
        process(
            [
                "-m",
                "router",
                "--model",
                str(tiny_model_dir),
                "--mode",
                "disagg",
                "--prefill-addr",
                f"127.0.0.1:{p_port}",
                "--decode-addr",
                f"127.0.0.1:{d_port}",
                "--port",
                "0",
                "--log-level",
                "WARNING",
            ],
            "pdserve-router ready",
        ) as (router, r_port),
    ):

        async def scenario() -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{r_port}") as ch:
                health = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
                assert health.status == health_pb2.HealthCheckResponse.SERVING
                stub = inference_pb2_grpc.InferenceStub(ch)  # type: ignore[no-untyped-call]
                req = ipb.GenerateRequest(
                    token_ids=ipb.TokenIds(ids=[41]), sampling=ipb.SamplingParams(max_tokens=4)
                )
                out = [r async for r in stub.Generate(req, timeout=10)]
                assert [t for r in out for t in r.token_ids] == [42, 43, 44, 45]

                long_req = ipb.GenerateRequest(
                    token_ids=ipb.TokenIds(ids=[41]), sampling=ipb.SamplingParams(max_tokens=500)
                )
                call = stub.Generate(long_req, timeout=20)
                await call.read()
                decode.send_signal(signal.SIGKILL)  # a real crash, mid-stream
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    while await call.read() != grpc.aio.EOF:
                        pass
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()

        asyncio.run(scenario())
        router.send_signal(signal.SIGTERM)
        assert router.wait(timeout=10) == 0
