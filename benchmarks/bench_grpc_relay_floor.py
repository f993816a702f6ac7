"""The floor under the router's overhead: what one bare Python gRPC relay hop costs on this host.

    python -m benchmarks.bench_grpc_relay_floor [--requests 1000] [--out FILE]

The JSON goes to `runs/bench/grpc_relay_floor.json` unless `--out` says otherwise (`-`: stdout).

Four processes, as in `bench_router_overhead --layout procs`: a backend with two unary calls
and an 8-message server stream (the shape of Reserve, Prefill and Decode); two relays whose
one server-streaming call makes those three calls and forwards every message as it comes — no
validation, routing, text or bookkeeping — one on grpc.aio (as the router is), one on the
thread-pool server with blocking stubs (the other way to write a Python gRPC server); and this
process as the client. Per request, in a shuffled order: direct (the client makes the three
calls), through the aio relay, through the thread relay. Reported: p50/p99 of time to the first
message and to the end, and relayed - direct (top-level keys: the aio relay; `thread_*`: the
thread relay). Whatever the router adds beyond this is its own work; this much a Python gRPC
relay pays.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from benchmarks.output import write_json

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


def thread_relay(port_file: Path, backend_port: int) -> None:
    """The same relay on `grpc.server` (a thread per call) with blocking stubs."""
    ch = grpc.insecure_channel(f"127.0.0.1:{backend_port}")
    unary = ch.unary_unary(f"/{SERVICE}/Unary", _ident, _ident)
    stream = ch.unary_stream(f"/{SERVICE}/Stream", _ident, _ident)

    def generate(req: bytes, ctx: Any) -> Any:
        unary(req)
        unary(req)
        yield from stream(req)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers(
        (_handlers({"Generate": grpc.unary_stream_rpc_method_handler(generate, _ident, _ident)}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_file.write_text(str(port))
    server.wait_for_termination()


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


async def client(backend_port: int, relay_ports: dict[str, int], requests: int) -> dict[str, Any]:
    """Time direct and relayed requests, alternating; `relay_ports`: {"": aio, "thread_": ...}."""
    unary, stream = _stubs(grpc.aio.insecure_channel(f"127.0.0.1:{backend_port}"))
    generates = {
        name: grpc.aio.insecure_channel(f"127.0.0.1:{port}").unary_stream(
            f"/{SERVICE}/Generate", _ident, _ident
        )
        for name, port in relay_ports.items()
    }

    async def direct() -> tuple[float, float]:
        t0 = time.perf_counter()
        await unary(b"x")
        await unary(b"x")
        first = 0.0
        async for _ in stream(b"x"):
            first = first or time.perf_counter() - t0
        return first, time.perf_counter() - t0

    async def relayed(generate: Any) -> tuple[float, float]:
        t0 = time.perf_counter()
        first = 0.0
        async for _ in generate(b"x"):
            first = first or time.perf_counter() - t0
        return first, time.perf_counter() - t0

    ways = ["direct", *generates]
    rng = random.Random(0)
    got: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
    for i in range(50 + requests):  # the first 50: warm-up (channels, code paths)
        rng.shuffle(ways)
        for way in ways:
            res = await (direct() if way == "direct" else relayed(generates[way]))
            if i >= 50:
                got[way].append(res)
    out: dict[str, Any] = {"requests": requests, "messages": MESSAGES}
    d = got["direct"]
    for prefix in generates:
        r = got[prefix]
        for i, what in enumerate(("first", "e2e")):
            for q, name in ((0.5, "p50"), (0.99, "p99")):
                dq = _quantile([x[i] for x in d], q) * 1e3
                rq = _quantile([x[i] for x in r], q) * 1e3
                out[f"{prefix}{what}_direct_{name}_ms"] = dq
                out[f"{prefix}{what}_relayed_{name}_ms"] = rq
                out[f"{prefix}{what}_overhead_{name}_ms"] = rq - dq
            out[f"{prefix}{what}_paired_diff_median_ms"] = statistics.median(
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
    ap.add_argument(
        "--out",
        default="runs/bench/grpc_relay_floor.json",
        help="write the JSON here (- for stdout)",
    )
    ap.add_argument("--role", choices=("backend", "relay", "thread-relay"), help=argparse.SUPPRESS)
    ap.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--backend-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "backend":
        asyncio.run(backend(args.port_file))
        return
    if args.role == "relay":
        asyncio.run(relay(args.port_file, args.backend_port))
        return
    if args.role == "thread-relay":
        thread_relay(args.port_file, args.backend_port)
        return
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            b, b_port = _start(["--role", "backend", "--port-file", f"{tmp}/b"], Path(tmp, "b"))
            procs.append(b)
            ports = {}
            for key, role in (("", "relay"), ("thread_", "thread-relay")):
                pf = Path(tmp, role)
                r, ports[key] = _start(
                    ["--role", role, "--port-file", str(pf), "--backend-port", str(b_port)], pf
                )
                procs.append(r)
            res = asyncio.run(client(b_port, ports, args.requests))
        finally:
            for p in procs:  # stop what this run started, by PID
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:  # ignored SIGTERM: kill, then reap
                    p.kill()
                    p.wait()
    res["load_avg_1m"] = os.getloadavg()[0]
    for key, name in (("", "grpc.aio"), ("thread_", "thread-pool")):
        print(
            f"bare {name} relay ({args.requests} requests, 2 unary + {MESSAGES}-message "
            f"stream), ms: first message +{res[key + 'first_overhead_p50_ms']:.3f} p50 / "
            f"+{res[key + 'first_overhead_p99_ms']:.3f} p99; end "
            f"+{res[key + 'e2e_overhead_p50_ms']:.3f} p50 / "
            f"+{res[key + 'e2e_overhead_p99_ms']:.3f} p99",
            file=sys.stderr,
        )
    write_json(res, args.out)


if __name__ == "__main__":
    main()
