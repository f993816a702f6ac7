"""Single-stream served decode, side by side: pdserve colocated, pdserve 1P1D and (optionally)
llama.cpp's `llama-server`, each served TPOT next to the serving worker's own engine-step
counters and the in-process engine step at the worker's threads. Standalone.

    python -m benchmarks.bench_single_stream [--model DIR] [--threads 2] [--rounds 2]
        [--repeats 5] [--llamacpp] [--llamacpp-gguf FILE] [--llamacpp-args "--poll 0"]
        [--out runs/bench/single_stream.json]

Issue 40 (pdserve on SmolLM2's own Q4_1 file, kept quantized, beside llama.cpp on that file):

    pdserve pull smollm2-135m-instruct --weights keep --out models/smollm2-135m-instruct-q4
    python -m benchmarks.bench_single_stream --model models/smollm2-135m-instruct-q4 \\
        --llamacpp --llamacpp-gguf ~/.cache/pdserve/models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --llamacpp-args "--poll 0" --threads 2 --out runs/bench/single_stream_q4_t2.json
    (and the same with --threads 1: each side's best thread setting counts)

One run, in order:

1. starts a colocated cluster (one worker, `--threads` torch threads) and a 1P1D cluster (one
   prefill and one decode worker, `--threads` / 2 each; not with `--threads 1`), and with
   `--llamacpp` a
   llama-server with `--threads` threads (`bench_llamacpp`'s build) on the same weights as F16
   GGUF, or on `--llamacpp-gguf` (e.g. the very file `--model` was converted from);
2. `--rounds` rounds, targets interleaved: one request at a time (`--prompt-len` token-id
   prompt, `--output-len` tokens, greedy, ignore_eos; `tooling.goodput.calibrate`), the median
   TPOT of `--repeats` requests; around each target's requests, every process's CPU seconds
   (/proc) and the decoding worker's `GetStatus` step counters (steps, step wall, step CPU);
3. stops every server, then times the engine's batch-1 decode step in this process at the
   workers' thread counts (`bench_decode_step.decode_steps`, context = prompt + half the
   output, best of `--rounds`).

Per target: served TPOT; the decoding worker's step wall and CPU per step (its engine thread,
over the requests); served TPOT / engine step (issue 30: <= 1.15x); CPU ms per token of each
process. JSON to `--out`, Markdown next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_served_decode import process_cpu_s
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc

LLAMACPP = "llama.cpp"


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def worker_counters(cluster: Any, role: str) -> tuple[float, float, float]:
    """(engine steps, step wall s, step CPU s) of the cluster's first `role` worker."""
    address = cluster.workers.addresses()[role][0]
    auth = cluster.workers.internal
    async with auth.aio_channel(address) as ch:
        stub = auth.stub(worker_pb2_grpc.WorkerStub(ch))  # type: ignore[no-untyped-call]
        s = await stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=10.0)
    return float(s.engine_steps), s.engine_step_wall_s, s.engine_step_cpu_s


async def measure(
    name: str, address: str, pids: dict[str, int], cluster: Any, role: str | None,
    args: argparse.Namespace, fields: dict[str, Any], seed: int,
) -> dict[str, Any]:  # fmt: skip
    """One target's single-stream TPOT with CPU and step counters over its requests."""
    from tooling.goodput.calibrate import calibrate

    c0 = await worker_counters(cluster, role) if role else None
    cpu0 = {k: process_cpu_s(p) for k, p in pids.items()}
    cal = await calibrate(
        name, address, args.prompt_len, args.output_len, repeats=args.repeats,
        token_seed=seed, **fields,
    )  # fmt: skip
    cpu1 = {k: process_cpu_s(p) for k, p in pids.items()}
    # calibrate runs one warm-up request and `repeats` measured ones, each output_len tokens
    tokens = (args.repeats + 1) * args.output_len
    out: dict[str, Any] = {
        "tpot_ms": cal.decode_ms,
        "ttft_ms": cal.prefill_ms,
        "tpot_samples_ms": list(cal.tpot_samples),
        "cpu_ms_per_token": {k: (cpu1[k] - cpu0[k]) * 1e3 / tokens for k in pids},
    }
    if role and c0 is not None:
        c1 = await worker_counters(cluster, role)
        steps = c1[0] - c0[0]
        out["worker_steps"] = steps
        out["worker_step_wall_ms"] = (c1[1] - c0[1]) * 1e3 / max(steps, 1)
        out["worker_step_cpu_ms"] = (c1[2] - c0[2]) * 1e3 / max(steps, 1)
    return out


def engine_steps(
    model: str, threads: list[int], context: int, steps: int, rounds: int
) -> dict[int, float]:
    """{threads: best-of-rounds median batch-1 decode step ms} in this process."""
    from benchmarks.bench_decode_step import decode_steps, make_engine
    from benchmarks.bench_engine import prompts_for

    out: dict[int, float] = {}
    old = torch.get_num_threads()
    try:
        for t in threads:
            torch.set_num_threads(t)
            engine = make_engine(model, 1, context + steps + 2)
            prompts = prompts_for(1, context, engine.model_config.vocab_size, seed=1)
            decode_steps(engine, prompts, 2)
            for _ in range(rounds):
                ms = statistics.median(decode_steps(engine, prompts, steps)[0]) * 1e3
                out[t] = min(out.get(t, float("inf")), ms)
            say(f"engine step, {t} thread(s), path {engine.runner.decode_path}: {out[t]:.1f} ms")
            del engine
    finally:
        torch.set_num_threads(old)
    return out


def render(result: dict[str, Any]) -> str:
    eng = result["engine_step_ms"]
    lines = [
        f"Single stream, {result['prompt_len']} in / {result['output_len']} out, "
        f"{result['threads']} threads per target; engine step (batch 1, in process): "
        + ", ".join(f"{t} thread(s) {ms:.1f} ms" for t, ms in eng.items()),
        "",
        "| target | round | TPOT p50 ms | worker step wall / CPU ms | TPOT / engine step "
        "| CPU ms per token (per process) |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in result["runs"]:
        threads = str(r["worker_threads"]) if r["worker_threads"] else None
        ratio = f"{r['tpot_ms'] / eng[threads]:.2f}x" if threads in eng else "-"
        step = (
            f"{r['worker_step_wall_ms']:.1f} / {r['worker_step_cpu_ms']:.1f}"
            if "worker_step_wall_ms" in r
            else "-"
        )
        cpu = ", ".join(f"{k} {v:.1f}" for k, v in r["cpu_ms_per_token"].items())
        lines.append(
            f"| {r['target']} | {r['round']} | {r['tpot_ms']:.1f} | {step} | {ratio} | {cpu} |"
        )
    return "\n".join(lines) + "\n"


async def run_targets(args: argparse.Namespace, model: Path, out_dir: Path) -> list[dict[str, Any]]:
    from deploy.config import load_cluster_config
    from deploy.launcher import launch_local_cluster
    from tooling.goodput.clusters import EngineSizing, cluster_settings

    sizing = EngineSizing(context=args.prompt_len + args.output_len + 16, num_kv_blocks=256)
    clusters: dict[str, Any] = {}
    server: subprocess.Popen[bytes] | None = None
    try:
        # 1P1D needs a thread per worker: with --threads 1, colocated (and llama.cpp) only
        for name in ("colocated", "disagg") if args.threads >= 2 else ("colocated",):
            cfg = load_cluster_config(None, cluster_settings(name, model, sizing, args.threads))
            clusters[name] = await asyncio.to_thread(
                launch_local_cluster, cfg, out_dir / name, port=0
            )
            say(f"{name} up at {clusters[name].address}")
        targets: list[
            tuple[str, str, dict[str, int], Any, str | None, dict[str, Any], int | None]
        ] = []
        for name, c in clusters.items():
            pids = {"router": c.router.process.pid}
            pids |= {w.role: w.process.pid for w in c.workers.workers}
            serving = "colocated" if name == "colocated" else "decode"
            threads = args.threads if name == "colocated" else args.threads // 2
            targets.append((name, c.address, pids, c, serving, {}, threads))
        if args.llamacpp:
            from benchmarks import bench_llamacpp as lc

            gguf = Path(args.llamacpp_gguf) if args.llamacpp_gguf else lc.f16_gguf(model)
            server, url = lc.start_server(
                lc.build_server(), gguf, args.threads, 1, 2 * sizing.context,
                out_dir / "llama-server.log", args.llamacpp_args.split(),
            )  # fmt: skip
            cfg = json.loads((model / "config.json").read_text())
            fields = {"api": "openai", "model": "smollm2", "vocab_size": cfg["vocab_size"]}
            targets.insert(
                0, (LLAMACPP, f"{url}/v1", {"server": server.pid}, None, None, fields, None)
            )
        runs = []
        for k in range(args.rounds):
            order = targets if k % 2 == 0 else targets[::-1]
            for name, address, pids, c, role, fields, threads in order:
                r = await measure(name, address, pids, c, role, args, fields, 7 * 10**6 + k)
                r |= {"target": name, "round": k, "worker_threads": threads}
                say(json.dumps({key: v for key, v in r.items() if key != "tpot_samples_ms"}))
                runs.append(r)
        return runs
    finally:
        for c in clusters.values():
            await asyncio.to_thread(c.stop)
        if server is not None:
            server.terminate()
            server.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2, help="total threads of every target")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="requests per target and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--llamacpp", action="store_true", help="also llama-server (F16 GGUF)")
    ap.add_argument(
        "--llamacpp-gguf", default="", help="llama-server's GGUF (default: --model as F16)"
    )
    ap.add_argument("--llamacpp-args", default="", help='more llama-server flags, e.g. "--poll 0"')
    ap.add_argument("--out", default="runs/bench/single_stream.json")
    args = ap.parse_args(argv)
    model = Path(args.model).resolve()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    runs = asyncio.run(run_targets(args, model, out.parent / f"{out.stem}_logs"))
    threads = sorted({t for t in (args.threads // 2, args.threads) if t})
    context = args.prompt_len + args.output_len // 2
    engine = engine_steps(str(model), threads, context, 30, args.rounds)
    result = {
        "benchmark": "single_stream",
        "started": started,
        "model": str(model),
        "threads": args.threads,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "engine_step_ms": {str(t): ms for t, ms in engine.items()},
        "runs": runs,
    }
    out.write_text(json.dumps(result, indent=1))
    table = render(result)
    out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
