"""`pdserve profile`: measure a model's step costs on this machine (the planner's cost model).

Runs in the CLI process; torch and the engine are imported inside the subcommand.

    pdserve profile --model DIR --out PROFILE.json [--threads 1,2] [--chunk 256]
                    [--max-prompt 512] [--max-batch 32] [--repeats 3] [--calibrate]

It times the model's prefill and decode steps (`LLMEngine`, as a worker runs it) with each
thread count and fits one cost model per count; `--calibrate` also starts local clusters to
measure the serving overheads (router, RPCs, KV transfer, token streaming, CPU beside the
steps): a 1P+1D cluster for 1 thread, one colocated worker for more — the configurations
`pdserve bench` runs with those thread counts. Exit codes: 0 ok, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from deploy.plan_cli import ints


def add_profile_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `profile`: fit the planner's cost model on this machine."""
    p = subparsers.add_parser(
        "profile",
        help="measure prefill/decode step costs of a model on this machine (for `plan`)",
        description="Time prefill and decode engine steps of --model with --threads torch "
        "threads (as a worker runs them), fit the planner's cost model and write it to --out. "
        "--calibrate also measures serving overheads on a local 1P+1D cluster.",
    )
    p.add_argument("--model", required=True, help="HF model folder")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument(
        "--threads",
        type=ints,
        metavar="N[,N...]",
        default=(1,),
        help="torch threads per worker to profile, a comma list, e.g. 1,2 (one cost model each)",
    )
    p.add_argument("--chunk", type=int, default=256, help="prefill step budget in tokens")
    p.add_argument("--max-prompt", type=int, default=512, help="longest prompt timed")
    p.add_argument("--max-batch", type=int, default=32, help="largest decode batch timed")
    p.add_argument("--max-context", type=int, default=640, help="longest decode context timed")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions per shape")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure serving overheads on local clusters: 1 thread on a 1P+1D cluster, more "
        "threads on one colocated worker (as `pdserve bench` runs them)",
    )
    p.add_argument("--num-kv-blocks", type=int, default=1024, help="KV blocks (calibration)")
    p.add_argument("--context", type=int, default=512, help="context of calibration loads")
    p.set_defaults(func=profile_main)


def profile_main(args: argparse.Namespace) -> int:
    from tooling.planner.profiler import profile_engine
    from tooling.planner.profiles import EngineDefaults, Profile

    model = Path(args.model)
    if not (model / "config.json").is_file():
        print(f"pdserve profile: --model {model} is not a model folder", file=sys.stderr)
        return 2
    if min(args.chunk, args.max_prompt, args.max_batch, args.repeats) < 1:
        print("pdserve profile: numeric options must be >= 1", file=sys.stderr)
        return 2
    engine = {
        "block_size": 16,
        "num_kv_blocks": args.num_kv_blocks,
        "max_num_batched_tokens": max(args.chunk, args.max_batch),
        "max_num_seqs": args.max_batch,
    }
    costs = {}
    try:
        for threads in args.threads:
            cost = profile_engine(
                model,
                threads=threads,
                chunk=args.chunk,
                max_prompt=args.max_prompt,
                max_batch=args.max_batch,
                max_context=args.max_context,
                repeats=args.repeats,
            )
            if args.calibrate:
                from deploy.tool_launchers import launch_cluster
                from tooling.planner.calibrate import calibrate_local

                mode = "disagg" if threads == 1 else "colocated"
                logs = Path(tempfile.mkdtemp(prefix="pdserve-profile-"))
                cost = calibrate_local(
                    model, cost, engine, threads, logs, launch_cluster, args.context, mode=mode
                )
            costs[threads] = cost
            print(f"--- {threads} thread(s)\n{cost.summary()}", flush=True)
    except ValueError as exc:
        print(f"pdserve profile: {exc}", file=sys.stderr)
        return 2
    profile = Profile(
        costs=costs,
        name=model.name,
        device="cpu",
        worker=f"one CPU worker process of {model} ({os.cpu_count()} cores on this machine)",
        engine=EngineDefaults(args.num_kv_blocks, 16, args.max_batch, args.chunk),
        derivation=(
            "measured by `pdserve profile` on this machine: engine steps timed with "
            "LLMEngine, coefficients fitted (non-negative least squares, relative error); "
            "serving overheads from local clusters when --calibrate",
        ),
    )
    out = profile.save(args.out)
    print(f"wrote {out}")
    return 0
