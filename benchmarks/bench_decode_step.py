"""Engine decode step per dtype and batch, next to the weight-streaming floor. Standalone.

    python -m benchmarks.bench_decode_step --threads 1 --batches 1,2,4,8,16,32 \\
        [--profile-batches 1,4,16,32] --out runs/bench/decode_step.json

Two engines in one process, float32 (`--fp32`, default models/small) and bfloat16 (`--bf16`,
default models/small-bf16: the same random draws stored in bf16; both made if missing), each on
its default ('auto') linear kernel. For each batch B, in `--rounds` rounds that alternate the
dtypes (so a slow moment of the shared machine hits both alike): B requests with
`--context`-token prompts are prefilled, then `--steps` decode steps are timed one by one; a
round's step is the median of its steps, and the best round counts.

The floor is the bytes of weights a decode step reads (every Linear and norm; the embedding is
only gathered) divided by the machine's memory bandwidth (`tooling.machine`, with the same
torch thread count, measured before the first batch, after each batch and at the end; the best
counts). Issue 21's targets are reported as ratios: bf16 step at batch 16 / at batch 1,
bf16 / fp32 per batch, and the batch-1 step / the floor per dtype.

`--profile-batches`: after the timed rounds, one run per dtype and batch under torch's profiler:
self time per op per step (the ops that take the most anywhere get a row each, the rest are
summed), and what no op accounts for (Python, scheduling, sampling bookkeeping). The profiler
adds a few microseconds per op, so its step totals sit above the timed ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_engine import prompts_for, weight_bytes
from model_runtime.engine import LLMEngine
from model_runtime.engine_config import EngineConfig
from model_runtime.sampling_params import SamplingParams
from tooling.machine import MachineInfo, measure_machine

DTYPES = ("float32", "bfloat16")
TOP_OPS = 12  # profile rows with their own line; the rest are summed


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_model(path: str, dtype: str) -> None:
    """Make the `small` random model in `path` (in `dtype`) unless it is there."""
    if not (Path(path) / "config.json").is_file():
        from tooling.models.random_model import make_random_model

        _say(f"making the small model ({dtype}) in {path} ...")
        make_random_model(
            path, "small", seed=0, dtype="bfloat16" if dtype == "bfloat16" else "float32"
        )


def make_engine(
    model: str,
    max_batch: int,
    tokens_per_seq: int,
    linear_kernel: str = "auto",
    attention_backend: str = "auto",
) -> LLMEngine:
    """An engine sized for `max_batch` sequences of `tokens_per_seq` tokens."""
    per_seq = -(-tokens_per_seq // 16) + 1
    config = EngineConfig.model_validate(
        {
            "num_kv_blocks": max_batch * per_seq + 8,
            "max_num_batched_tokens": max(4096, max_batch),
            "max_num_seqs": max_batch,
            "linear_kernel": linear_kernel,
            "attention_backend": attention_backend,
        }
    )
    return LLMEngine.from_model_dir(model, config)


# name -> (dtype, linear kernel, attention backend). The first two are the defaults ('auto');
# `--baselines` adds the code paths before issue 21 on this host, side by side.
VARIANTS = {
    "float32": ("float32", "auto", "auto"),
    "bfloat16": ("bfloat16", "auto", "auto"),
}
BASELINES = {
    "float32-before": ("float32", "onednn", "torch"),  # oneDNN GEMM + reference attention
    "bfloat16-before": ("bfloat16", "torch", "torch"),  # bf16 F.linear + reference attention
}


def decode_steps(
    engine: LLMEngine, prompts: list[list[int]], steps: int, profile: bool = False
) -> tuple[list[float], Any]:
    """Prefill `prompts`, then run `steps` decode steps; (each step's seconds, profiler or None).

    Every request decodes exactly `steps` tokens after its first, so all steps run the full
    batch; the blocks are all free again when it returns (checked)."""
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    engine.block_pool.reset_prefix_cache()
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    while _prefilling(engine):
        engine.step()
    times: list[float] = []
    prof = None
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        prof = torch_profile(activities=[ProfilerActivity.CPU])
        prof.start()
    try:
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
    finally:
        if prof is not None:
            prof.stop()
    engine.check_integrity()
    assert engine.block_pool.num_free == engine.num_kv_blocks, "blocks leaked"
    return times, prof


def _prefilling(engine: LLMEngine) -> bool:
    return any(
        r.num_computed_tokens < len(r.prompt_token_ids)
        for r in engine.scheduler.requests.values()
        if r.finish_reason is None
    )


def op_table(prof: Any, steps: int) -> dict[str, float]:
    """Self CPU milliseconds per step for every op the profiler saw."""
    return {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--fp32", default="models/small", help="float32 model folder")
    ap.add_argument("--bf16", default="models/small-bf16", help="bfloat16 model folder")
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a 1P1D worker has 1)")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile-batches", default="", help="e.g. 1,4,16,32 (empty: no profile)")
    ap.add_argument(
        "--baselines", action="store_true", help=f"also time {sorted(BASELINES)} side by side"
    )
    ap.add_argument("--out", default="runs/bench/decode_step.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    profile_batches = [int(b) for b in args.profile_batches.split(",") if b]
    models = {"float32": args.fp32, "bfloat16": args.bf16}
    for dtype, path in models.items():
        ensure_model(path, dtype)
    max_b = max(batches + profile_batches)
    tokens = args.context + args.steps + 2
    variants = VARIANTS | (BASELINES if args.baselines else {})
    engines = {
        name: make_engine(models[dtype], max_b, tokens, kernel, attn)
        for name, (dtype, kernel, attn) in variants.items()
    }
    for name, e in engines.items():
        dtype = variants[name][0]
        assert str(e.runner.kv_cache.dtype).endswith(dtype), (name, e.runner.kv_cache.dtype)
    _say(
        "kernels: "
        + str({n: (e.runner.linear_kernel, e.runner.backend.name) for n, e in engines.items()})
    )
    _say("measuring the machine ...")
    machine = measure_machine()
    vocab = engines["float32"].model_config.vocab_size
    rows: list[dict[str, Any]] = []
    for b in batches:
        prompts = prompts_for(b, args.context, vocab, seed=b)
        for e in engines.values():
            decode_steps(e, prompts, 2)  # warm-up at this shape
        best: dict[str, float] = {}
        for rnd in range(args.rounds):
            for d, e in engines.items():
                med = statistics.median(decode_steps(e, prompts, args.steps)[0])
                best[d] = min(best.get(d, float("inf")), med)
            _say(
                f"batch {b} round {rnd + 1}: "
                + ", ".join(f"{d} {t * 1e3:.2f} ms" for d, t in best.items())
            )
        machine = machine.best_of(measure_machine(size_mb=256, gemm_n=512, repeats=3))
        rows.append({"batch": b} | {f"step_ms_{d}": t * 1e3 for d, t in best.items()})
    profiles: dict[str, dict[str, dict[str, float]]] = {}
    for b in profile_batches:
        prompts = prompts_for(b, args.context, vocab, seed=b)
        for d, e in engines.items():
            times, prof = decode_steps(e, prompts, max(4, args.steps // 2), profile=True)
            ops = op_table(prof, len(times))
            ops["(step wall time, profiled)"] = statistics.mean(times) * 1e3
            profiles.setdefault(d, {})[str(b)] = ops
            _say(f"profiled {d} batch {b}: {statistics.mean(times) * 1e3:.1f} ms/step")
    machine = measure_machine().best_of(machine)
    result = summarize(args, engines, machine, rows, profiles)
    result["variants"] = {n: list(v) for n, v in variants.items()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    table = render(result)
    out.with_suffix(".md").write_text(table)
    print(table)
    return 0


def summarize(
    args: argparse.Namespace,
    engines: dict[str, LLMEngine],
    machine: MachineInfo,
    rows: list[dict[str, Any]],
    profiles: dict[str, dict[str, dict[str, float]]],
) -> dict[str, Any]:
    bw = machine.memory_bandwidth_gbs * 1e9
    floors = {d: weight_bytes(engines[d]) / bw * 1e3 for d in DTYPES}
    macs = weight_bytes(engines["float32"]) / 4  # multiply-adds per token (weights, fp32 bytes)
    for row in rows:
        row["bf16_over_fp32"] = row["step_ms_bfloat16"] / row["step_ms_float32"]
        # The step can be no faster than its weight GEMMs at the machine's fp32 GEMM peak
        # (same thread count; bf16 computes in fp32 here, so the same peak bounds it).
        row["compute_floor_ms"] = 2 * macs * row["batch"] / (machine.matmul_gflops * 1e9) * 1e3
    by_batch = {r["batch"]: r for r in rows}
    targets: dict[str, Any] = {
        "bf16_over_fp32_max": max(r["bf16_over_fp32"] for r in rows),
    }
    if 1 in by_batch:
        for d in DTYPES:
            targets[f"batch1_over_floor_{d}"] = by_batch[1][f"step_ms_{d}"] / floors[d]
        if 16 in by_batch:
            targets["bf16_batch16_over_batch1"] = (
                by_batch[16]["step_ms_bfloat16"] / by_batch[1]["step_ms_bfloat16"]
            )
    return {
        "benchmark": "decode_step",
        "models": {"float32": args.fp32, "bfloat16": args.bf16},
        "kernels": {n: [e.runner.linear_kernel, e.runner.backend.name] for n, e in engines.items()},
        "threads": args.threads,
        "context": args.context,
        "steps": args.steps,
        "rounds": args.rounds,
        "machine": machine.to_json(),
        "weight_bytes": {d: weight_bytes(engines[d]) for d in DTYPES},
        "floor_ms": floors,
        "rows": rows,
        "targets": targets,
        "profiles": profiles,
    }


def render(result: dict[str, Any]) -> str:
    m, fl = result["machine"], result["floor_ms"]
    names = list(result["kernels"])
    lines = [
        f"# Decode step by batch — {result['threads']} torch thread(s), context "
        f"{result['context']}",
        "",
        "Variants (linear kernel, attention backend): "
        + ", ".join(f"{n} ({k[0]}, {k[1]})" for n, k in result["kernels"].items())
        + ".",
        "",
        f"Memory bandwidth {m['memory_bandwidth_gbs']:.1f} GB/s, fp32 GEMM peak "
        f"{m['matmul_gflops']:.0f} GFLOP/s ({m['torch_threads']} thread(s), measured in this "
        f"run); weight-streaming floor {fl['float32']:.2f} ms (float32), {fl['bfloat16']:.2f} ms "
        "(bfloat16); compute floor = the step's weight FLOPs at that peak.",
        "",
        "| batch | "
        + " | ".join(f"{n} step ms" for n in names)
        + " | bf16 / fp32 | compute floor ms |",
        "|---:|" + "---:|" * (len(names) + 2),
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['batch']} | "
            + " | ".join(f"{r[f'step_ms_{n}']:.2f}" for n in names)
            + f" | {r['bf16_over_fp32']:.2f} | {r['compute_floor_ms']:.2f} |"
        )
    lines += [
        "",
        "Targets (issue 21): " + json.dumps({k: round(v, 3) for k, v in result["targets"].items()}),
    ]
    if result["profiles"]:
        lines += ["", *render_profile(result["profiles"])]
    return "\n".join(lines) + "\n"


def render_profile(profiles: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    """One table per variant: ops as rows (the same ops, in the same order, in every table),
    batches as columns, self ms per step."""
    cols = [(d, b) for d in profiles for b in profiles[d]]
    wall = "(step wall time, profiled)"
    names: set[str] = set()
    for d, b in cols:
        ops = {k: v for k, v in profiles[d][b].items() if k != wall}
        names |= set(sorted(ops, key=ops.__getitem__, reverse=True)[:TOP_OPS])
    order = sorted(names, key=lambda n: -max(profiles[d][b].get(n, 0.0) for d, b in cols))
    lines: list[str] = []
    for d, by_batch in profiles.items():
        batches = list(by_batch)
        lines += [
            f"### {d}: self ms per decode step",
            "",
            "| op | " + " | ".join(f"batch {b}" for b in batches) + " |",
            "|---|" + "---:|" * len(batches),
        ]
        for n in order:
            cells = " | ".join(f"{by_batch[b].get(n, 0.0):.2f}" for b in batches)
            lines.append(f"| `{n}` | {cells} |")
        ops_sum = {b: sum(v for k, v in by_batch[b].items() if k != wall) for b in batches}
        other = {b: ops_sum[b] - sum(by_batch[b].get(n, 0.0) for n in order) for b in batches}
        outside = {b: by_batch[b][wall] - ops_sum[b] for b in batches}
        lines.append("| other ops | " + " | ".join(f"{other[b]:.2f}" for b in batches) + " |")
        lines.append(
            "| outside ops (Python, bookkeeping) | "
            + " | ".join(f"{outside[b]:.2f}" for b in batches)
            + " |"
        )
        lines.append(
            "| **step (profiled)** | "
            + " | ".join(f"**{by_batch[b][wall]:.2f}**" for b in batches)
            + " |"
        )
        lines.append("")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
