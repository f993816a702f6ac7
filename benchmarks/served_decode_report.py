"""Analysis and tables of `bench_served_decode`: served inter-token times by the decode batch
that was running, next to the engine's step at that batch and the weight-streaming floor.

Pure functions over JSON-able data (no torch, no I/O); the benchmark calls them.

Batch attribution: the benchmark samples the decode worker's `GetStatus().num_running` (its
running decode batch) every few milliseconds on the host's monotonic clock; the load generator's
records are on the same clock (`RunResult.t0_monotonic`). Each inter-token gap of a request is
attributed the batch sampled nearest its end; a request's TPOT is attributed the mean batch
over its decode span, rounded. Gaps are grouped by batch: their p50 is the served step at that
batch, compared with the engine's step at the same batch (interpolated between measured batch
sizes) and with the decode worker's own step (wall and engine-thread CPU, from the cumulative
counters in its status): ITL - worker wall is delivery (engine loop outside the step, token
streaming, router hop); worker wall - worker CPU is waiting (for a core or the GIL); worker CPU
- engine step is extra work or slower work (caches) inside the served step.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np


def batch_at(samples: Sequence[tuple[float, int]], t: float) -> int:
    """The sampled batch nearest in time to `t` (samples sorted by time, non-empty)."""
    times = [s[0] for s in samples]
    i = bisect.bisect_left(times, t)
    if i == 0:
        return samples[0][1]
    if i == len(samples):
        return samples[-1][1]
    before, after = samples[i - 1], samples[i]
    return before[1] if t - before[0] <= after[0] - t else after[1]


def mean_batch(samples: Sequence[tuple[float, int]], lo: float, hi: float) -> float | None:
    """Mean sampled batch within [lo, hi] (None when no sample falls in it)."""
    inside = [b for t, b in samples if lo <= t <= hi]
    return float(np.mean(inside)) if inside else None


def attribute(run: dict[str, Any], samples: Sequence[tuple[float, int]]) -> dict[str, Any]:
    """Per-batch gap lists and per-request (TPOT, mean batch) pairs of one run.

    `run` is a `RunResult.to_json()`; only successful requests with two or more tokens count.
    """
    t0 = run["t0_monotonic"]
    gaps: dict[int, list[float]] = {}
    requests: list[dict[str, float]] = []
    for rec in run["records"]:
        if rec["status"] != "OK" or rec["ttft_ms"] is None or rec["tpot_ms"] is None:
            continue
        first = t0 + rec["sent_s"] + rec["ttft_ms"] / 1e3
        t = first
        for gap in rec["itl_ms"]:
            t += gap / 1e3
            gaps.setdefault(batch_at(samples, t), []).append(gap)
        span_batch = mean_batch(samples, first, t)
        if span_batch is not None:
            requests.append({"tpot_ms": rec["tpot_ms"], "batch": span_batch})
    return {"gaps": gaps, "requests": requests}


def worker_steps(samples: Sequence[Sequence[float]]) -> dict[int, dict[str, float]]:
    """The decode worker's own step time by batch, from its cumulative counters: for each pair
    of consecutive samples [t, batch, steps, wall_s, cpu_s] with the same batch at both ends
    and steps run between them, the steps' wall and CPU seconds go to that batch.
    Returns {batch: {"steps", "wall_ms", "cpu_ms"}} (mean per step)."""
    acc: dict[int, list[float]] = {}
    for a, b in itertools.pairwise(samples):
        steps = b[2] - a[2]
        if a[1] != b[1] or steps <= 0 or b[1] < 1:
            continue
        tot = acc.setdefault(int(b[1]), [0.0, 0.0, 0.0])
        tot[0] += steps
        tot[1] += b[3] - a[3]
        tot[2] += b[4] - a[4]
    return {
        k: {"steps": v[0], "wall_ms": v[1] / v[0] * 1e3, "cpu_ms": v[2] / v[0] * 1e3}
        for k, v in acc.items()
    }


def engine_step_at(engine_ms: dict[int, float], batch: float) -> float:
    """The engine's step at `batch`, linearly interpolated between measured batch sizes
    (clamped to the measured range)."""
    sizes = sorted(engine_ms)
    if batch <= sizes[0]:
        return engine_ms[sizes[0]]
    if batch >= sizes[-1]:
        return engine_ms[sizes[-1]]
    j = bisect.bisect_left(sizes, batch)
    lo, hi = sizes[j - 1], sizes[j]
    w = (batch - lo) / (hi - lo)
    return engine_ms[lo] * (1 - w) + engine_ms[hi] * w


def by_batch_rows(
    gaps: dict[int, list[float]],
    engine_ms: dict[int, float],
    min_gaps: int,
    worker: dict[int, dict[str, float]] | None = None,
) -> list[dict[str, Any]]:
    """One row per decode batch with at least `min_gaps` gaps: ITL p50/p99, the engine step,
    their ratio, and (from `worker_steps`) the worker's own step wall/CPU ms at that batch."""
    rows = []
    for b in sorted(gaps):
        g = gaps[b]
        if b < 1 or len(g) < min_gaps:
            continue
        p50 = float(np.percentile(g, 50))
        step = engine_step_at(engine_ms, b)
        w = (worker or {}).get(b, {})
        rows.append(
            {
                "batch": b,
                "gaps": len(g),
                "itl_p50_ms": p50,
                "itl_p99_ms": float(np.percentile(g, 99)),
                "engine_step_ms": step,
                "served_over_engine": p50 / step,
                "worker_step_wall_ms": w.get("wall_ms", float("nan")),
                "worker_step_cpu_ms": w.get("cpu_ms", float("nan")),
            }
        )
    return rows


def tpot_rows(
    requests: list[dict[str, float]], engine_ms: dict[int, float]
) -> list[dict[str, Any]]:
    """Requests grouped by their mean decode batch (rounded): TPOT p50/p99 and the engine step."""
    groups: dict[int, list[float]] = {}
    for r in requests:
        groups.setdefault(max(1, round(r["batch"])), []).append(r["tpot_ms"])
    return [
        {
            "batch": b,
            "requests": len(v),
            "tpot_p50_ms": float(np.percentile(v, 50)),
            "tpot_p99_ms": float(np.percentile(v, 99)),
            "engine_step_ms": engine_step_at(engine_ms, b),
            "tpot_p50_over_engine": float(np.percentile(v, 50)) / engine_step_at(engine_ms, b),
        }
        for b, v in sorted(groups.items())
    ]


def render(result: dict[str, Any]) -> str:
    """The Markdown summary: per dtype and rate, then per dtype and decode batch."""
    m = result["machine"]
    lines = [
        f"# Served decode — 1P1D, {result['threads']} torch thread per worker, prompts "
        f"{result['prompt_len']} tokens, {result['output_len']} output tokens, Poisson arrivals",
        "",
        f"Memory bandwidth {m['memory_bandwidth_gbs']:.1f} GB/s ({m['torch_threads']} thread, "
        "measured in this run). Floor = weight bytes / bandwidth.",
        "",
        "| dtype | rate req/s | requests ok | mean decode batch | TTFT p50 ms | TPOT p50 ms "
        "| TPOT p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in result["runs"]:
        lines.append(
            f"| {run['dtype']} | {run['rate']:g} | {run['ok']}/{run['requests']} "
            f"| {run['mean_batch']:.1f} | {run['ttft_p50_ms']:.0f} | {run['tpot_p50_ms']:.1f} "
            f"| {run['tpot_p99_ms']:.1f} |"
        )
    lines += [
        "",
        "CPU ms per decoded token, by process (decode worker split into its engine steps and the "
        "rest: event loop, gRPC, KV receives):",
        "",
        "| dtype | rate | router | prefill | decode | decode: engine steps | decode: rest |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in result["runs"]:
        c = run.get("cpu_ms_per_token") or {}
        cells = [c.get(k, float("nan")) for k in ("router", "prefill", "decode")]
        cells += [c.get("decode_engine_steps", float("nan")), c.get("decode_rest", float("nan"))]
        lines.append(
            f"| {run['dtype']} | {run['rate']:g} | " + " | ".join(f"{v:.2f}" for v in cells) + " |"
        )
    lines += [
        "",
        "The decode worker's engine thread per step, ms (all batches of the run): wall and CPU "
        "from its status counters, runqueue wait (runnable, no free core) from the kernel's "
        "schedstat, blocked = wall - CPU - runqueue wait (waiting for the GIL, mostly):",
        "",
        "| dtype | rate | wall | CPU | runqueue wait | blocked |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for run in result["runs"]:
        e = run.get("engine_thread_per_step") or {}
        cells = [e.get(k, float("nan")) for k in ("wall", "cpu", "runqueue_wait", "blocked")]
        lines.append(
            f"| {run['dtype']} | {run['rate']:g} | " + " | ".join(f"{v:.1f}" for v in cells) + " |"
        )
    for dtype, d in result["by_dtype"].items():
        floor = result["floor_ms"][dtype]
        lines += [
            "",
            f"## {dtype}: served inter-token time by running decode batch (all rates pooled)",
            "",
            f"Floor {floor:.1f} ms; engine step measured in this run at batch "
            + ", ".join(f"{b}: {v:.1f}" for b, v in sorted(d["engine_ms"].items()))
            + " ms.",
            "",
            "| decode batch | gaps | ITL p50 ms | ITL p99 ms | engine step ms | p50 / engine "
            "| worker step wall ms | worker step CPU ms |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in d["itl_by_batch"]:
            lines.append(
                f"| {r['batch']} | {r['gaps']} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} "
                f"| {r['engine_step_ms']:.1f} | {r['served_over_engine']:.2f} "
                f"| {r['worker_step_wall_ms']:.1f} | {r['worker_step_cpu_ms']:.1f} |"
            )
        lines += [
            "",
            "| request's mean batch | requests | TPOT p50 ms | TPOT p99 ms | engine step ms "
            "| TPOT p50 / engine |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for r in d["tpot_by_batch"]:
            lines.append(
                f"| {r['batch']} | {r['requests']} | {r['tpot_p50_ms']:.1f} "
                f"| {r['tpot_p99_ms']:.1f} | {r['engine_step_ms']:.1f} "
                f"| {r['tpot_p50_over_engine']:.2f} |"
            )
    return "\n".join(lines) + "\n"
