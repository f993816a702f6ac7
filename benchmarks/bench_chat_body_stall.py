"""How long a huge ``/v1/chat/completions`` body stalls the router's event loop (issue 26).

Runs as its own process: ``python -m benchmarks.bench_chat_body_stall [--sizes 10 30]`` from
the repository root. It starts a router with its HTTP front in this process (the tiny random
model's tokenizer and limits; no worker is needed: the body is refused before any routing) and
a `tooling.loop_lag.LoopWatchdog` (a 5 ms ticker) on the router's loop. For each size, a
helper thread posts one chat request whose single message is that many MiB of text over a plain
socket and waits for the answer; the watchdog's longest lateness over that request is its
stall: wall clock, and the part the process spent on the CPU (what the code costs, robust to a
busy machine). Reported per size: HTTP status, the error's ``param``, seconds to the answer,
longest stall (CPU-attributed and wall). Output: a table on stderr and JSON in
``runs/bench/chat_body_stall.json`` (``--out FILE``; ``--out -`` for stdout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_router_overhead import _make_model
from benchmarks.output import write_json
from router.app import start_router
from router.config import RouterConfig
from tooling.loop_lag import LoopWatchdog


def _post(port: int, body: bytes) -> tuple[int, bytes]:
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=300) as sock:
        sock.sendall(head + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status = int(data.split(b"\r\n", 1)[0].split()[1])
    return status, data.partition(b"\r\n\r\n")[2]


async def measure(model: Path, sizes: list[int]) -> list[dict[str, Any]]:
    # no worker answers (nothing listens there): the refusal needs none
    unreachable = RouterConfig(
        model_dir=model, http_port=0, prefill_addrs=("127.0.0.1:9",), decode_addrs=("127.0.0.1:7",)
    )
    router = await start_router(unreachable)
    assert router.http is not None
    try:
        out = []
        for mb in sizes:
            unit = "The river flows "
            content = unit * (mb * 2**20 // len(unit))
            msg = {"model": model.name, "messages": [{"role": "user", "content": content}]}
            body = json.dumps(msg).encode()
            del content, msg
            dog = LoopWatchdog(tick_s=0.005)
            dog.start()
            await asyncio.sleep(0.05)
            dog.reset()
            t0 = time.perf_counter()
            status, raw = await asyncio.to_thread(_post, router.http.port, body)
            elapsed = time.perf_counter() - t0
            await dog.stop()
            try:
                param = json.loads(raw)["error"]["param"]
            except (ValueError, KeyError, TypeError):
                param = None
            out.append(
                {
                    "mib": mb,
                    "status": status,
                    "param": param,
                    "answer_s": round(elapsed, 3),
                    "max_stall_ms": round(dog.max_stall_s * 1e3, 1),
                    "max_wall_lag_ms": round(dog.max_wall_s * 1e3, 1),
                }
            )
        return out
    finally:
        await router.stop(grace_s=0.1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10, 30], help="message sizes, MiB")
    p.add_argument("--model", help="model folder (default: a fresh tiny random model)")
    p.add_argument("--out", default="runs/bench/chat_body_stall.json", help="JSON (- for stdout)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-stall-") as tmp:
        model = Path(args.model) if args.model else _make_model(Path(tmp) / "tiny")
        rows = asyncio.run(measure(model, args.sizes))
    print(
        "MiB  status  param                 answer s  stall ms (CPU)  wall lag ms", file=sys.stderr
    )
    for r in rows:
        print(
            f"{r['mib']:>3}  {r['status']:>6}  {r['param']!s:<20}  {r['answer_s']:>8}  "
            f"{r['max_stall_ms']:>14}  {r['max_wall_lag_ms']:>11}",
            file=sys.stderr,
        )
    write_json({"date": time.strftime("%Y-%m-%d"), "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
