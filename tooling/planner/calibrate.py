"""Serving overheads for the planner's cost model, measured through a real cluster.

Runs in the CLI / benchmark process. Two kinds of overhead, each measured, never assumed:

1. latency (`measure_overheads`): requests sent one at a time (nothing queued; the goodput
   bench's `calibrate.sequential`) at a few prompt lengths -> (prompt tokens, TTFT s, TPOT s)
   samples; `costs.calibrate_overheads` fits the TTFT overhead (router, RPCs, KV transfer,
   first-token delivery) and the per-token TPOT excess;
2. CPU (`measure_cpu`): a chat-like and a summarize-like load at a moderate rate (about half
   a core of model work per role, from the profile), with the CPU time of every process read
   from /proc; `costs.fit_cpu_overheads` compares it with the CPU the simulator's model steps
   take for the same requests (`sim.charged`: step time x the worker's threads) and fits the
   CPU the serving path burns outside the model steps: prefill per request and per KV token
   sent, decode per token and per KV token received, router + client per request and per
   token. On a shared CPU this work competes with the model for cores.

`calibrate_local` does both on a 1 prefill + 1 decode cluster (or one colocated worker) of
local processes that it starts and stops itself (`harness.start_cluster`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tooling.cpu import CpuMeter
from tooling.goodput.calibrate import sequential
from tooling.launch import Cluster, LaunchCluster
from tooling.planner.costs import CostModel, CpuSample, calibrate_overheads, fit_cpu_overheads
from tooling.planner.harness import cluster_pids, send_all, start_cluster
from tooling.planner.sim import ClusterSpec, charged
from tooling.planner.workload import requests, to_sim

PROMPT_LENGTHS = (32, 128, 384)
CPU_WORKLOADS = ("chat", "summarize")


async def measure_overheads(
    address: str,
    prompt_lens: Sequence[int] = PROMPT_LENGTHS,
    output_len: int = 16,
    repeats: int = 3,
    token_seed: int = 7 * 10**6,
) -> list[tuple[int, float, float | None]]:
    """(prompt tokens, TTFT s, TPOT s) of `repeats` sequential requests per prompt length,
    after one discarded warm-up request per length."""
    out: list[tuple[int, float, float | None]] = []
    for k, n in enumerate(prompt_lens):
        seed = token_seed + 100 * k
        await sequential(address, n, output_len, 1, seed, "planner-warmup")
        for ttft_ms, tpot_ms in await sequential(
            address, n, output_len, repeats, seed + 1, "planner-calib"
        ):
            out.append((n, ttft_ms / 1e3, tpot_ms / 1e3 if tpot_ms else None))
    return out


def moderate_rate(cost: CostModel, name: str, context: int) -> float:
    """Requests/s of workload `name` that keep about half a core busy with model steps on its
    busier role (a 1P+1D cluster, one core each)."""
    probe = to_sim(requests(name, 64, 1.0, context, seed=5))
    busy = charged(probe, ClusterSpec(1, 1), cost)
    per_request = max(busy["prefill_steps_s"], busy["decode_steps_s"]) / len(probe)
    return max(0.05, min(0.5 / max(per_request, 1e-6), 50.0))


async def measure_cpu(
    cluster: Cluster,
    cost: CostModel,
    vocab_size: int,
    context: int,
    seconds: float = 20.0,
    spec: ClusterSpec | None = None,
) -> list[CpuSample]:
    """One `CpuSample` per workload in `CPU_WORKLOADS` (module docstring, step 2). `spec`:
    the cluster as the simulator sees it (default 1 prefill + 1 decode); a colocated
    worker's CPU counts as decode (its per-token side work)."""
    spec = spec or ClusterSpec(1, 1)
    out = []
    for k, name in enumerate(CPU_WORKLOADS):
        rate = moderate_rate(cost, name, context)
        specs = requests(name, max(8, round(rate * seconds)), rate, context, seed=11 + k)
        pids = cluster_pids(cluster)
        meter = CpuMeter()
        meter.start(pids)
        records, _ = await send_all(cluster.address, specs, vocab_size, 900 + k, f"cpu-{name}")
        cpu = meter.stop()["cpu_s"]
        sent = [s for s, r in zip(specs, records, strict=True) if r.ok]
        model = charged(to_sim(sent), spec, cost)
        workers = {w.worker_id: w.role for w in cluster.members()}
        out.append(
            CpuSample(
                requests=len(sent),
                tokens=int(model["tokens"]),
                prefill_steps_s=model["prefill_steps_s"],
                decode_steps_s=model["decode_steps_s"],
                prefill_cpu_s=sum(v for k2, v in cpu.items() if workers.get(k2) == "prefill"),
                decode_cpu_s=sum(
                    v for k2, v in cpu.items() if workers.get(k2) in ("decode", "colocated")
                ),
                host_cpu_s=cpu["router"] + cpu["client"],
                kv_prompt_tokens=int(model["kv_prompt_tokens"]),
            )
        )
    return out


def calibrate_local(
    model: Path,
    cost: CostModel,
    engine: dict[str, Any],
    threads: int,
    log_dir: Path,
    launch: LaunchCluster[Cluster],
    context: int = 512,
    prompt_lens: Sequence[int] = PROMPT_LENGTHS,
    output_len: int = 16,
    repeats: int = 3,
    mode: str = "disagg",
) -> CostModel:
    """Start a local cluster of `model` with `launch` (`engine`: EngineConfig fields,
    `threads` torch threads per worker): 1 prefill + 1 decode worker (`mode` "disagg") or one
    colocated worker ("colocated"); measure both kinds of overhead, stop it; `cost` with them
    fitted."""
    from model_runtime.config import ModelConfig

    vocab = ModelConfig.from_model_dir(model).vocab_size
    if mode == "colocated":
        spec = ClusterSpec(0, 0, colocated=1, threads=threads)
        cluster = start_cluster(model, 1, engine, threads, log_dir, launch, mode="colocated")
    elif mode == "disagg":
        spec = ClusterSpec(1, 1)
        cluster = start_cluster(model, 2, engine, threads, log_dir, launch)
    else:
        raise ValueError(f"mode must be 'disagg' or 'colocated', got {mode!r}")
    try:

        async def go() -> tuple[list[tuple[int, float, float | None]], list[CpuSample]]:
            lat = await measure_overheads(cluster.address, prompt_lens, output_len, repeats)
            return lat, await measure_cpu(cluster, cost, vocab, context, spec=spec)

        samples, cpu = asyncio.run(go())
    finally:
        cluster.stop()
    cal = fit_cpu_overheads(calibrate_overheads(cost, samples), cpu)
    meta = {
        **cal.meta,
        "calibration": [list(s) for s in samples],
        "calibration_engine": engine,
        "calibration_mode": mode,
    }
    return dataclasses.replace(cal, meta=meta)
