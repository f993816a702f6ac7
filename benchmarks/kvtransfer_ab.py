"""Two versions of the KV transport side by side in one run: a transfer's time on each, rep by
rep, for a bfloat16 and an int8 cache, and what a transfer costs each process.

    git archive <commit> | tar -x -C /tmp/base
    python -m benchmarks.kvtransfer_ab --base /tmp/base --sizes 16,512,1024,2048

`--base` is another checkout of pdserve: its `kvtransfer` package is copied beside this one as
`kvtransfer_base` (its own imports renamed), so both versions run in the same two processes —
this one the prefill worker, a spawned one the decode worker — over caches of the `--model`
folder's layout (bfloat16 model; "auto" and "int8" caches), one pair per version and cache,
alternating which version goes first in each rep. Each side waits like an engine thread
(`benchmarks.kvtransfer_stages.EngineWait`). Per transfer (the prompt's KV already in the
cache, every layer handed over right after `open`, as `bench_kv_int8 --parts transfer` does):

- `recv`: `open` -> the decode side's `poll()` returns the result (the KV is usable there: what
  `bench_kv_int8` times);
- `send`: `open` -> the prefill side's `poll()` returns its result (the acknowledgement: the
  source blocks are free, and a prefill worker answers `Prefill`).

Before the timed reps, `--count-reps` 16-token transfers per version (twice, interleaved) count
each process's context switches (every thread's, from /proc) and CPU time per transfer: on a
shared host those say what a transfer costs better than its wall time does. Prints medians, the
paired (rep-by-rep) ratios new / base and int8 / bfloat16 per version; writes JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import re
import shutil
import statistics
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from benchmarks.kvtransfer_stages import (
    BLOCK,
    EngineWait,
    decode_loop,
    small_cache,
    transfer_once,
)
from kvtransfer.types import blocks_needed

VERSIONS = ("base", "new")
CACHES = ("auto", "int8")
_PACKAGE = {"base": "kvtransfer_base", "new": "kvtransfer"}


def copy_base(tree: str, into: str) -> None:
    """`tree`'s kvtransfer package as `into`/kvtransfer_base, its own imports renamed."""
    dst = Path(into) / "kvtransfer_base"
    shutil.copytree(Path(tree) / "kvtransfer", dst)
    for f in dst.glob("*.py"):
        text = re.sub(r"\b(from|import) kvtransfer\b", r"\1 kvtransfer_base", f.read_text())
        f.write_text(text)


def _module(version: str, name: str) -> Any:
    return importlib.import_module(f"{_PACKAGE[version]}.{name}")


def _ticket(t: Any, tokens: int) -> Any:
    ids = list(range(blocks_needed(tokens, BLOCK)))
    version = "base" if type(t).__module__.startswith("kvtransfer_base") else "new"
    return _module(version, "types").new_ticket(t.endpoint, t.layout, "ab", ids, tokens, 60.0)


def _decode_main(conn: Connection, path: str, model_dir: str, blocks: int) -> None:
    sys.path.insert(0, path)
    receivers = {
        (v, kv): _module(v, "torch_dist").TorchDistTransport(
            small_cache(model_dir, blocks, kv), f"ab-d-{v}-{kv}"
        )
        for v in VERSIONS
        for kv in CACHES
    }
    decode_loop(conn, receivers, _ticket)


def counters(pid: int) -> tuple[int, float]:
    """(context switches of every thread, CPU seconds) of process `pid` so far (Linux /proc)."""
    switches = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                switches += int(line.split()[1])
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return switches, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(model_dir: str, sizes: list[int], reps: int, path: str, count_reps: int) -> dict[str, Any]:
    blocks = blocks_needed(max(sizes), BLOCK) + 2
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_main, args=(child, path, model_dir, blocks))
    proc.start()
    engine = EngineWait()
    senders = {}
    for v in VERSIONS:
        for kv in CACHES:
            t = _module(v, "torch_dist").TorchDistTransport(
                small_cache(model_dir, blocks, kv), f"ab-p-{v}-{kv}", serve=False
            )
            t.set_waker(engine.wake)
            senders[v, kv] = t

    def once(v: str, kv: str, n: int) -> tuple[float, float]:
        ticket_type = _module(v, "types").TransferTicket
        t0, received, sent, _ = transfer_once(conn, (v, kv), senders[v, kv], n, engine, ticket_type)
        return received - t0, sent - t0

    out: dict[str, Any] = {"sizes": [], "per_transfer": {}}
    try:
        assert conn.recv()[0] == "ready" and proc.pid is not None
        pids = {"prefill": os.getpid(), "decode": proc.pid}
        for v in VERSIONS:  # join every pair, warm up
            for kv in CACHES:
                for _ in range(3):
                    once(v, kv, max(sizes))
        for v in VERSIONS * 2:
            before = {side: counters(pid) for side, pid in pids.items()}
            for _ in range(count_reps):
                once(v, "auto", 16)
            row = {}
            for side, pid in pids.items():
                sw, cpu = counters(pid)
                row[side] = {
                    "switches": (sw - before[side][0]) / count_reps,
                    "cpu_ms": (cpu - before[side][1]) * 1e3 / count_reps,
                }
            out["per_transfer"].setdefault(v, []).append(row)
            print(
                f"{v}: per 16-token transfer " + ", ".join(
                    f"{side} {r['switches']:.1f} context switches, {r['cpu_ms']:.2f} ms CPU"
                    for side, r in row.items()
                ),
                flush=True,
            )  # fmt: skip
        for n in sizes:
            times: dict[str, list[float]] = {}
            for rep in range(reps):
                for v in VERSIONS if rep % 2 == 0 else VERSIONS[::-1]:
                    for kv in CACHES:
                        recv, send = once(v, kv, n)
                        times.setdefault(f"{v}/{kv}/recv", []).append(recv)
                        times.setdefault(f"{v}/{kv}/send", []).append(send)
            out["sizes"].append({"tokens": n, "seconds": times})
            _say(n, times)
    finally:
        conn.send(("stop", None))
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        for t in senders.values():
            t.close()
    return out


def _paired(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def _say(n: int, times: dict[str, list[float]]) -> None:
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    for what in ("recv", "send"):
        cells = []
        for v in VERSIONS:
            b, i = times[f"{v}/auto/{what}"], times[f"{v}/int8/{what}"]
            cells.append(
                f"{v}: bf16 {med[f'{v}/auto/{what}']:.2f} / int8 {med[f'{v}/int8/{what}']:.2f} ms "
                f"(int8/bf16 {statistics.median(i) / statistics.median(b):.2f}x, "
                f"paired {_paired(i, b):.2f}x)"
            )
        new_base = ", ".join(
            f"{kv} {_paired(times[f'new/{kv}/{what}'], times[f'base/{kv}/{what}']):.2f}x"
            for kv in CACHES
        )
        print(f"{n:5d} tokens {what}: " + "; ".join(cells) + f"; new/base paired {new_base}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the other pdserve checkout")
    ap.add_argument("--model", default="models/small-bf16", help="model folder (its config)")
    ap.add_argument("--sizes", default="16,512,1024,2048")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--count-reps", type=int, default=200, help="transfers per counter batch")
    ap.add_argument("--out", default="runs/bench/kvtransfer_ab.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        copy_base(args.base, tmp)
        sys.path.insert(0, tmp)
        print(f"load {os.getloadavg()[0]:.1f} at start", flush=True)
        sizes = [int(s) for s in args.sizes.split(",")]
        res = run(args.model, sizes, args.reps, tmp, args.count_reps)
    res["load_avg_1m_end"] = os.getloadavg()[0]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
