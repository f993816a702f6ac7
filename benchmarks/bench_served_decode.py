"""Served decode: TPOT of a 1P1D cluster by the decode batch actually running, bf16 and float32
side by side, next to the engine's step at that batch and the weight-streaming floor. Standalone.

    flock /work/heavy.lock python -m benchmarks.bench_served_decode --rates 0.5,1,2 \\
        --duration 40 --out runs/bench/served_decode.json

One run, in order:

1. the engine reference: an in-process engine per dtype (`--threads` torch threads, the
   workers' count) times its decode step at each batch of `--engine-batches`
   (`bench_decode_step.decode_steps`, dtypes interleaved, context = prompt + half the output);
   and the machine's memory bandwidth with the same threads;
2. two 1P1D clusters (router + prefill worker + decode worker, local processes), one on the
   float32 model (`--fp32`), one on the bfloat16 model (`--bf16`, the same random draws stored
   in bf16), both started at once; an idle cluster only answers status polls;
3. per rate (ascending), each dtype in turn (the order alternates between rates): a warm-up,
   then Poisson arrivals for `--duration` seconds of fixed-length requests (`--prompt-len`,
   `--output-len`, greedy, ignore_eos) from a separate load-generator process, while this
   process samples the decode worker's `GetStatus().num_running` every `--poll-ms`;
4. the engine reference again (best of both counts), the clusters stopped.

Inter-token gaps are attributed to the decode batch running when they ended
(`served_decode_report`); the report gives ITL p50/p99 per batch next to the engine step at that
batch (issue 21's target: served <= 1.15x engine) and each request's TPOT by its mean batch.
JSON (every record and sample) to `--out`, a Markdown summary next to it, process logs and
load-generator files in `<out stem>_logs/`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import served_decode_report as report
from benchmarks.bench_decode_step import decode_steps, ensure_model, make_engine
from benchmarks.bench_engine import prompts_for, weight_bytes
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from security.channels import InternalAuth
from tooling.goodput.arrivals import arrival_times
from tooling.goodput.clusters import EngineSizing, cluster_settings
from tooling.goodput.loadgen import LoadJob, run_load_process_async
from tooling.goodput.records import RequestSpec
from tooling.machine import MachineInfo, measure_machine

DTYPES = ("bfloat16", "float32")


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def engine_reference(
    models: dict[str, str], batches: list[int], context: int, steps: int, rounds: int
) -> tuple[dict[str, dict[int, float]], dict[str, int]]:
    """({dtype: {batch: median step ms}}, {dtype: weight bytes}), dtypes interleaved per batch,
    the best round counting. Engines are freed before returning."""
    engines = {d: make_engine(p, max(batches), context + steps + 2) for d, p in models.items()}
    nbytes = {d: weight_bytes(e) for d, e in engines.items()}
    vocab = engines["float32"].model_config.vocab_size
    out: dict[str, dict[int, float]] = {d: {} for d in models}
    for b in batches:
        prompts = prompts_for(b, context, vocab, seed=b)
        for e in engines.values():
            decode_steps(e, prompts, 2)
        for _ in range(rounds):
            for d, e in engines.items():
                ms = statistics.median(decode_steps(e, prompts, steps)[0]) * 1e3
                out[d][b] = min(out[d].get(b, float("inf")), ms)
        say(f"engine batch {b}: " + ", ".join(f"{d} {out[d][b]:.1f} ms" for d in models))
    del engines
    gc.collect()
    return out, nbytes


async def poll_status(
    address: str, interval_s: float, stop: asyncio.Event, auth: InternalAuth
) -> list[list[float]]:
    """[monotonic time, num_running, engine_steps, engine_step_wall_s, engine_step_cpu_s] of
    the worker at `address` every `interval_s` until `stop` is set (each sample timed at the
    midpoint of its call)."""
    samples: list[list[float]] = []
    async with auth.aio_channel(address) as ch:
        stub = auth.stub(worker_pb2_grpc.WorkerStub(ch))  # type: ignore[no-untyped-call]
        while not stop.is_set():
            t0 = time.monotonic()
            status = await stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=2.0)
            samples.append(
                [
                    (t0 + time.monotonic()) / 2,
                    status.num_running,
                    status.engine_steps,
                    status.engine_step_wall_s,
                    status.engine_step_cpu_s,
                ]
            )
            with contextlib.suppress(TimeoutError):  # the poll interval passed
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
    return samples


async def run_point(
    job: LoadJob, decode_addr: str, auth: InternalAuth, poll_s: float, workdir: Path
) -> tuple[dict[str, Any], list[list[float]]]:
    """One load run with the decode worker sampled throughout: (RunResult JSON, samples)."""
    stop = asyncio.Event()
    poller = asyncio.create_task(poll_status(decode_addr, poll_s, stop, auth))
    try:
        result = await run_load_process_async(job, workdir)
    finally:
        stop.set()
        samples = await poller
    return result.to_json(), samples


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_ticks(pid: int) -> dict[int, int]:
    """CPU clock ticks (user + system) of every thread of `pid` so far."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        out[int(tid)] = int(fields[11]) + int(fields[12])
    return out


def busiest_thread(pid: int, before: dict[int, int]) -> int:
    """The thread of `pid` that used the most CPU since `before` (`thread_ticks`): in a decode
    worker with one torch thread, measured over a warm-up that decodes, its engine thread."""
    now = thread_ticks(pid)
    return max(now, key=lambda tid: now[tid] - before.get(tid, 0))


def schedstat_s(pid: int, tid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of thread `tid` so far."""
    run_ns, wait_ns, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
    return int(run_ns) / 1e9, int(wait_ns) / 1e9


def cluster_pids(cluster: Any) -> dict[str, int]:
    """{"router": pid, "prefill": pid, "decode": pid} of a 1P1D `LocalCluster`."""
    pids = {"router": cluster.router.process.pid}
    for w in cluster.workers.workers:
        pids[w.role] = w.process.pid
    return pids


def specs(n: int, rate: float, prompt_len: int, output_len: int, seed: int) -> list[RequestSpec]:
    times = arrival_times(n, rate, "poisson", seed=seed)
    return [RequestSpec(i, t, prompt_len, output_len) for i, t in enumerate(times)]


def summarize_run(run: dict[str, Any], samples: list[list[float]]) -> dict[str, Any]:
    ok = [r for r in run["records"] if r["status"] == "OK" and r["tpot_ms"] is not None]
    t0 = run["t0_monotonic"]
    busy = [s[1] for s in samples if t0 <= s[0] <= t0 + run["duration_s"] and s[1] > 0]
    return {
        "requests": len(run["records"]),
        "ok": len(ok),
        "mean_batch": float(np.mean(busy)) if busy else 0.0,
        "ttft_p50_ms": float(np.percentile([r["ttft_ms"] for r in ok], 50)) if ok else 0.0,
        "tpot_p50_ms": float(np.percentile([r["tpot_ms"] for r in ok], 50)) if ok else 0.0,
        "tpot_p99_ms": float(np.percentile([r["tpot_ms"] for r in ok], 99)) if ok else 0.0,
        "send_lag_p99_ms": run["send_lag_p99_ms"],
    }


def cpu_per_token(
    run: dict[str, Any], samples: list[list[float]], pids: dict[str, int], cpu0: dict[str, float]
) -> dict[str, float]:
    """CPU milliseconds per decoded token of each process over the run, and of the decode
    worker's engine steps (its status counters) and the rest of that process (loop, gRPC,
    KV receives)."""
    tokens = sum(max(r["num_tokens"] - 1, 0) for r in run["records"])
    if tokens == 0 or len(samples) < 2:
        return {}
    out = {k: (process_cpu_s(p) - cpu0[k]) * 1e3 / tokens for k, p in pids.items()}
    out["decode_engine_steps"] = (samples[-1][4] - samples[0][4]) * 1e3 / tokens
    out["decode_rest"] = out["decode"] - out["decode_engine_steps"]
    return out


def per_step(
    samples: list[list[float]], sched0: tuple[float, float], sched1: tuple[float, float]
) -> dict[str, float]:
    """The decode worker's engine thread per step over a run, in ms: step wall and CPU (status
    counters), and the thread's runqueue wait (runnable, no core free) from the kernel's
    schedstat; wall - CPU - runqueue wait is time blocked inside steps (the GIL, mostly)."""
    steps = samples[-1][2] - samples[0][2] if len(samples) > 1 else 0
    if steps <= 0:
        return {}
    wall = (samples[-1][3] - samples[0][3]) * 1e3 / steps
    cpu = (samples[-1][4] - samples[0][4]) * 1e3 / steps
    runq = (sched1[1] - sched0[1]) * 1e3 / steps
    return {"wall": wall, "cpu": cpu, "runqueue_wait": runq, "blocked": wall - cpu - runq}


async def load_phase(args: argparse.Namespace, models: dict[str, str], out_dir: Path) -> list[Any]:
    """Steps 2-3 of the module doc: start both clusters, run every (rate, dtype) point."""
    from deploy.config import load_cluster_config
    from deploy.launcher import launch_local_cluster

    sizing = EngineSizing(
        context=args.prompt_len + args.output_len,
        num_kv_blocks=args.max_seqs * (-(-(args.prompt_len + args.output_len) // 16) + 1) + 16,
        max_num_seqs=args.max_seqs,
    )
    clusters = {}
    try:
        for d in DTYPES:
            settings = cluster_settings("disagg", Path(models[d]), sizing, 2 * args.threads)
            cfg = load_cluster_config(None, settings)
            clusters[d] = await asyncio.to_thread(launch_local_cluster, cfg, out_dir / d, port=0)
            say(f"{d} cluster up at {clusters[d].address}")
        runs: list[Any] = []
        for k, rate in enumerate(sorted(args.rates)):
            order = DTYPES if k % 2 == 0 else DTYPES[::-1]
            for d in order:
                c = clusters[d]
                decode_addr = c.workers.addresses()["decode"][0]
                n = max(args.min_requests, round(rate * args.duration))
                pids = cluster_pids(c)
                ticks = thread_ticks(pids["decode"])
                warm = LoadJob(c.address, specs(4, 4.0, args.prompt_len, 16, seed=99), label="warm")
                await run_load_process_async(warm, out_dir / "jobs")
                engine_tid = busiest_thread(pids["decode"], ticks)
                job = LoadJob(
                    c.address,
                    specs(n, rate, args.prompt_len, args.output_len, seed=k),
                    config=d,
                    rate=rate,
                    seed=k,
                    label=f"{d}-r{rate:g}",
                    timeout_s=300.0,
                )
                cpu0 = {k: process_cpu_s(p) for k, p in pids.items()}
                sched0 = schedstat_s(pids["decode"], engine_tid)
                auth = clusters[d].workers.internal  # the workers take the cluster secret
                run, samples = await run_point(
                    job, decode_addr, auth, args.poll_ms / 1e3, out_dir / "jobs"
                )
                sched1 = schedstat_s(pids["decode"], engine_tid)
                summary = summarize_run(run, samples)
                summary["cpu_ms_per_token"] = cpu_per_token(run, samples, pids, cpu0)
                summary["engine_thread_per_step"] = per_step(samples, sched0, sched1)
                say(
                    f"{d} rate {rate:g}: "
                    + json.dumps(
                        {k: v if isinstance(v, dict) else round(v, 2) for k, v in summary.items()}
                    )
                )
                runs.append({"dtype": d, "rate": rate, **summary, "run": run, "samples": samples})
        return runs
    finally:
        for c in clusters.values():
            await asyncio.to_thread(c.stop)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--fp32", default="models/small")
    ap.add_argument("--bf16", default="models/small-bf16")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1, 2])
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per point")
    ap.add_argument("--min-requests", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-seqs", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--poll-ms", type=float, default=50.0, help="decode status sampling period")
    ap.add_argument("--engine-batches", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--engine-steps", type=int, default=12)
    ap.add_argument("--min-gaps", type=int, default=30, help="fewest gaps for a batch's row")
    ap.add_argument("--out", default="runs/bench/served_decode.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = {"bfloat16": args.bf16, "float32": args.fp32}
    for d, path in models.items():
        ensure_model(path, d)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.engine_batches.split(",")]
    context = args.prompt_len + args.output_len // 2
    machine: MachineInfo = measure_machine()
    ref1, nbytes = engine_reference(models, batches, context, args.engine_steps, 2)
    runs = asyncio.run(load_phase(args, models, out.parent / f"{out.stem}_logs"))
    ref2, _ = engine_reference(models, batches, context, args.engine_steps, 1)
    machine = measure_machine().best_of(machine)
    engine_ms = {d: {b: min(ref1[d][b], ref2[d][b]) for b in batches} for d in models}
    result = assemble(args, machine, engine_ms, nbytes, runs)
    out.write_text(json.dumps(result))
    table = report.render(result)
    out.with_suffix(".md").write_text(table)
    print(table)
    return 0


def assemble(
    args: argparse.Namespace,
    machine: MachineInfo,
    engine_ms: dict[str, dict[int, float]],
    nbytes: dict[str, int],
    runs: list[dict[str, Any]],
) -> dict[str, Any]:
    by_dtype: dict[str, Any] = {}
    for d in DTYPES:
        gaps: dict[int, list[float]] = {}
        requests: list[dict[str, float]] = []
        samples: list[list[float]] = []
        for r in (r for r in runs if r["dtype"] == d):
            a = report.attribute(r["run"], [(s[0], int(s[1])) for s in r["samples"]])
            for b, g in a["gaps"].items():
                gaps.setdefault(b, []).extend(g)
            requests += a["requests"]
            samples += r["samples"]
        worker = report.worker_steps(samples)
        by_dtype[d] = {
            "engine_ms": engine_ms[d],
            "worker_steps": worker,
            "itl_by_batch": report.by_batch_rows(gaps, engine_ms[d], args.min_gaps, worker),
            "tpot_by_batch": report.tpot_rows(requests, engine_ms[d]),
        }
    bw = machine.memory_bandwidth_gbs * 1e9
    return {
        "benchmark": "served_decode",
        "threads": args.threads,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "duration_s": args.duration,
        "machine": machine.to_json(),
        "weight_bytes": nbytes,
        "floor_ms": {d: nbytes[d] / bw * 1e3 for d in DTYPES},
        "by_dtype": by_dtype,
        "runs": runs,
    }


if __name__ == "__main__":
    raise SystemExit(main())
