"""The floor under the router's overhead: what one bare grpc.aio relay hop costs on this host.

    python -m benchmarks.bench_grpc_relay_floor [--requests 1000] [--out FILE]

Three processes, as in `bench_router_overhead --layout procs`: a backend with two unary calls
and an 8-message server stream (the shape of Reserve, Prefill and Decode), a relay whose one
server-streaming call makes those three calls and forwards every message as it comes — no
validation, routing, text or bookkeeping — and this process as the client. Per request, in
alternation: direct (the client makes the three calls) and relayed (the client calls the
relay). Reported: p50/p99 of time to the first message and to the end, and relayed - direct.
Whatever the router adds beyond this is its own work; this much any Python grpc.aio relay pays.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

SERVICE = "pdserve.bench.Relay"
MESSAGES = 8


def _ident(b: bytes) -> bytes:
    return b


def _handlers(methods: dict[str, grpc.RpcMethodHandler]) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, methods)


def _stubs(ch: grpc.aio.Channel) -> tuple[Any, Any]:
    unary = ch.unary_unary(f"/{SERVICE}/Unary", _ident, _ident)
    stream = ch.unary_stream(f"/{SERVICE}/Stream", _ident, _ident)
    return unary, stream


async def _serve(methods: dict[str, grpc.RpcMethodHandler], port_file: Path) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handlers(methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_file.write_text(str(port))
    await server.wait_for_termination()


async def backend(port_file: Path) -> None:
    async def unary(req: bytes, ctx: Any) -> bytes:
        return req

    async def stream(req: bytes, ctx: Any) -> Any:
        for i in range(MESSAGES):
            yield b"token %d" % i

    await _serve(
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, _ident, _ident),
            "Stream": grpc.unary_stream_rpc_method_handler(stream, _ident, _ident),
        },
        port_file,
    )


async def relay(port_file: Path, backend_port: int) -> None:
    unary, stream = _stubs(grpc.aio.insecure_channel(f"127.0.0.1:{backend_port}"))

    async def generate(req: bytes, ctx: Any) -> Any:
        await unary(req)
        await unary(req)
        async for msg in stream(req):
            yield msg

    await _serve(
        {"Generate": grpc.unary_stream_rpc_method_handler(generate, _ident, _ident)}, port_file
    )


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


async def client(backend_port: int, relay_port: int, requests: int) -> dict[str, Any]:
    unary, stream = _stubs(grpc.aio.insecure_channel(f"127.0.0.1:{backend_port}"))
    generate = grpc.aio.insecure_channel(f"127.0.0.1:{relay_port}").unary_stream(
        f"/{SERVICE}/Generate", _ident, _ident
    )

    async def direct() -> tuple[float, float]:
        t0 = time.perf_counter()
        await unary(b"x")
        await unary(b"x")
        first = 0.0
        async for _ in stream(b"x"):
            first = first or time.perf_counter() - t0
        return first, time.perf_counter() - t0

    async def relayed() -> tuple[float, float]:
        t0 = time.perf_counter()
        first = 0.0
        async for _ in generate(b"x"):
            first = first or time.perf_counter() - t0
        return first, time.perf_counter() - t0

    for _ in range(50):  # warm-up: channels, code paths
        await direct()
        await relayed()
    d: list[tuple[float, float]] = []
    r: list[tuple[float, float]] = []
    for _ in range(requests):
        d.append(await direct())
        r.append(await relayed())
    out: dict[str, Any] = {"requests": requests, "messages": MESSAGES}
    for i, what in enumerate(("first", "e2e")):
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            dq = _quantile([x[i] for x in d], q) * 1e3
            rq = _quantile([x[i] for x in r], q) * 1e3
            out[f"{what}_direct_{name}_ms"] = dq
            out[f"{what}_relayed_{name}_ms"] = rq
            out[f"{what}_overhead_{name}_ms"] = rq - dq
        out[f"{what}_paired_diff_median_ms"] = statistics.median(
            (b[i] - a[i]) * 1e3 for a, b in zip(d, r, strict=True)
        )
    return out


def _start(args: list[str], port_file: Path) -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_grpc_relay_floor", *args])
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if port_file.exists() and port_file.read_text():
            return proc, int(port_file.read_text())
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    proc.wait(5)
    raise RuntimeError(f"{args[0]} process did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here (else stdout)")
    ap.add_argument("--role", choices=("backend", "relay"), help=argparse.SUPPRESS)
    ap.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--backend-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "backend":
        asyncio.run(backend(args.port_file))
        return
    if args.role == "relay":
        asyncio.run(relay(args.port_file, args.backend_port))
        return
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            b, b_port = _start(["--role", "backend", "--port-file", f"{tmp}/b"], Path(tmp, "b"))
            procs.append(b)
            r, r_port = _start(
                ["--role", "relay", "--port-file", f"{tmp}/r", "--backend-port", str(b_port)],
                Path(tmp, "r"),
            )
            procs.append(r)
            res = asyncio.run(client(b_port, r_port, args.requests))
        finally:
            for p in procs:  # stop what this run started, by PID
                p.terminate()
                p.wait(10)
    res["load_avg_1m"] = os.getloadavg()[0]
    print(
        f"bare grpc.aio relay ({args.requests} requests, 2 unary + {MESSAGES}-message stream), "
        f"ms: first message +{res['first_overhead_p50_ms']:.3f} p50 / "
        f"+{res['first_overhead_p99_ms']:.3f} p99; end +{res['e2e_overhead_p50_ms']:.3f} p50 / "
        f"+{res['e2e_overhead_p99_ms']:.3f} p99",
        file=sys.stderr,
    )
    text = json.dumps(res, indent=2) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
