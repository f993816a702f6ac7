"""`pdserve profile` and `pdserve plan`: measure step costs, recommend a prefill:decode ratio.

Runs in the CLI process. Heavy imports (torch, the engine) happen inside the subcommands.

    pdserve profile --model DIR --out PROFILE.json [--threads 1] [--chunk 256]
                    [--max-prompt 512] [--max-batch 32] [--repeats 3] [--calibrate]
    pdserve plan (--workload chat --rate 2 | --phases chat:4:60,summarize:1:60 | --trace F)
                 --slo-ttft-ms MS --slo-tpot-ms MS --workers N
                 (--profile PROFILE.json | --model DIR) [--context 1024] [--num-requests 200]
                 [--cores 2] [--chunk-tokens 128,256] [--max-num-seqs 16,32] [--search-rate]
                 [--json OUT.json]

`profile` times the model's prefill and decode steps on this machine (`LLMEngine`, as a worker
runs it) and fits the planner's cost model; `--calibrate` also starts a local 1P+1D cluster to
measure the serving overheads (router, RPCs, KV transfer, token streaming). `plan` simulates
every split of `--workers` workers (and the listed chunk / batch settings) on the workload's
requests and prints a table, best first, and the recommendation. Exit codes: 0 ok, 2 bad
arguments, 1 failure. `add_profile_parser` / `add_plan_parser` register the subcommands
(deploy/cli.py's convention: `func(args) -> int`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def _ints(value: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {value!r}"
        ) from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {value!r}")
    return out


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
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--chunk", type=int, default=256, help="prefill step budget in tokens")
    p.add_argument("--max-prompt", type=int, default=512, help="longest prompt timed")
    p.add_argument("--max-batch", type=int, default=32, help="largest decode batch timed")
    p.add_argument("--max-context", type=int, default=640, help="longest decode context timed")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions per shape")
    p.add_argument(
        "--calibrate", action="store_true", help="measure overheads on a local 1P+1D cluster"
    )
    p.add_argument("--num-kv-blocks", type=int, default=1024, help="KV blocks (calibration)")
    p.add_argument("--context", type=int, default=512, help="context of calibration loads")
    p.set_defaults(func=profile_main)


def profile_main(args: argparse.Namespace) -> int:
    from tooling.planner.profiler import profile_engine

    model = Path(args.model)
    if not (model / "config.json").is_file():
        print(f"pdserve profile: --model {model} is not a model folder", file=sys.stderr)
        return 2
    if min(args.threads, args.chunk, args.max_prompt, args.max_batch, args.repeats) < 1:
        print("pdserve profile: numeric options must be >= 1", file=sys.stderr)
        return 2
    try:
        cost = profile_engine(
            model,
            threads=args.threads,
            chunk=args.chunk,
            max_prompt=args.max_prompt,
            max_batch=args.max_batch,
            max_context=args.max_context,
            repeats=args.repeats,
        )
        if args.calibrate:
            from tooling.planner.calibrate import calibrate_local

            engine = {
                "block_size": 16,
                "num_kv_blocks": args.num_kv_blocks,
                "max_num_batched_tokens": max(args.chunk, args.max_batch),
                "max_num_seqs": args.max_batch,
            }
            logs = Path(tempfile.mkdtemp(prefix="pdserve-profile-"))
            cost = calibrate_local(model, cost, engine, args.threads, logs, args.context)
    except ValueError as exc:
        print(f"pdserve profile: {exc}", file=sys.stderr)
        return 2
    out = cost.save(args.out)
    print(cost.summary())
    print(f"wrote {out}")
    return 0


def add_plan_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `plan`: recommend a prefill:decode ratio by simulation."""
    p = subparsers.add_parser(
        "plan",
        help="recommend a prefill:decode ratio (and batch/chunk settings) for a workload",
        description="Simulate every prefill:decode split of --workers workers on the workload "
        "with costs profiled on this machine; print the ranking and the recommendation.",
    )
    w = p.add_mutually_exclusive_group(required=True)
    w.add_argument("--workload", help="chat | code | summarize | prefix | multiturn")
    w.add_argument(
        "--phases",
        metavar="W:RATE:S[,...]",
        help="shifting workload, a comma list of WORKLOAD:RATE:SECONDS phases",
    )
    w.add_argument("--trace", help="request trace (.csv/.jsonl) of the goodput bench")
    p.add_argument(
        "--rate", type=float, help="requests/s for --workload (required with it; no default)"
    )
    p.add_argument("--num-requests", type=int, default=200, help="requests of --workload")
    p.add_argument("--context", type=int, default=1024, help="context budget of the lengths")
    p.add_argument(
        "--output-len", type=int, help="fixed output length (default: the workload's draw)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's lengths")
    p.add_argument("--slo-ttft-ms", type=float, required=True, help="TTFT SLO in ms")
    p.add_argument("--slo-tpot-ms", type=float, required=True, help="TPOT SLO in ms")
    p.add_argument("--target", type=float, default=0.9, help="attainment target")
    p.add_argument("--workers", type=int, required=True, help="prefill + decode workers")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="cost profile JSON from `pdserve profile`")
    src.add_argument("--model", help="profile this model folder first (no calibration)")
    p.add_argument("--threads", type=int, default=1, help="torch threads when profiling")
    p.add_argument(
        "--cores",
        type=float,
        default=float(os.cpu_count() or 1),
        help="CPU cores the workers share (default: this machine's); 0 = one core each",
    )
    p.add_argument(
        "--chunk-tokens",
        type=_ints,
        metavar="N[,N...]",
        default=(256,),
        help="prefill step budgets to try, a comma list, e.g. 128,256,512",
    )
    p.add_argument(
        "--max-num-seqs",
        type=_ints,
        metavar="N[,N...]",
        default=(32,),
        help="decode batch limits to try, a comma list, e.g. 16,32,64",
    )
    p.add_argument("--num-kv-blocks", type=int, default=1024, help="KV blocks per worker")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-inflight", type=int, default=64, help="router's running limit")
    p.add_argument("--search-rate", action="store_true", help="also find each max rate")
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="also simulate the ratio controller (mode 'adaptive'), starting at N//2 prefill",
    )
    p.add_argument("--window-s", type=float, default=8.0, help="controller window (--adaptive)")
    p.add_argument("--cooldown-s", type=float, default=6.0, help="controller cooldown")
    p.add_argument("--min-requests", type=int, default=6, help="controller min_requests")
    p.add_argument("--json", help="write the rows and inputs as JSON here (default: print only)")
    p.set_defaults(func=plan_main)


def _specs(args: argparse.Namespace) -> list[Any]:
    from tooling.planner.workload import parse_phases, requests, shifting

    if args.trace:
        from tooling.goodput.traces import read_trace

        return read_trace(args.trace)
    if args.phases:
        return shifting(parse_phases(args.phases), args.context, args.seed, args.output_len)
    if args.rate is None or args.rate <= 0:
        raise ValueError("--workload needs --rate > 0")
    return requests(
        args.workload, args.num_requests, args.rate, args.context, args.seed, args.output_len
    )


def plan_main(args: argparse.Namespace) -> int:
    from tooling.planner.costs import CostModel
    from tooling.planner.planner import plan, table
    from tooling.planner.sim import ClusterSpec
    from tooling.planner.workload import requests, to_sim

    try:
        if args.workers < 2:
            raise ValueError(f"--workers must be >= 2, got {args.workers}")
        specs = _specs(args)
        if args.profile:
            cost = CostModel.load(args.profile)
        else:
            from tooling.planner.profiler import profile_engine

            cost = profile_engine(args.model, threads=args.threads)
        base = ClusterSpec(
            prefill=1,
            decode=1,
            num_kv_blocks=args.num_kv_blocks,
            block_size=args.block_size,
            max_inflight=args.max_inflight,
            cores=args.cores if args.cores > 0 else None,
        )
        search = None
        if args.search_rate:
            if not args.workload:
                raise ValueError("--search-rate needs --workload (a rate-free request list)")

            def search(rate: float) -> list[Any]:
                return to_sim(
                    requests(
                        args.workload,
                        args.num_requests,
                        rate,
                        args.context,
                        args.seed,
                        args.output_len,
                    )
                )

        rows = plan(
            to_sim(specs),
            cost,
            args.workers,
            args.slo_ttft_ms / 1e3,
            args.slo_tpot_ms / 1e3,
            base,
            args.chunk_tokens,
            args.max_num_seqs,
            rate_search=search,
            target=args.target,
        )
        adaptive = _adaptive(args, to_sim(specs), cost, base) if args.adaptive else None
    except (ValueError, OSError, KeyError) as exc:
        print(f"pdserve plan: {exc}", file=sys.stderr)
        return 2
    print(table(rows, args.slo_ttft_ms, args.slo_tpot_ms))
    if adaptive is not None:
        print(
            f"\nadaptive controller from {adaptive['start']}: predicted attainment "
            f"{adaptive['attainment']:.1%}, goodput {adaptive['goodput_rps']:.2f} req/s, "
            f"{len(adaptive['changes']) - 1} role switches"
        )
    best = rows[0]
    print(
        f"\nrecommended: {best.ratio} (prefill:decode), chunk_tokens={best.chunk_tokens}, "
        f"max_num_seqs={best.max_num_seqs}: predicted attainment {best.attainment:.1%}"
        + (f", max rate {best.max_rate:.2f} req/s" if best.max_rate is not None else "")
    )
    if args.json:
        data = {
            "args": {k: v for k, v in vars(args).items() if k != "func"},
            "requests": len(specs),
            "cost": cost.to_json(),
            "rows": [r.to_json() for r in rows],
            "adaptive": adaptive,
        }
        Path(args.json).write_text(json.dumps(data, indent=1, default=str) + "\n")
    return 0


def _adaptive(args: argparse.Namespace, reqs: list[Any], cost: Any, base: Any) -> dict[str, Any]:
    """Simulate the controller (mode 'adaptive', bounds 1..N-1) from an N//2 : N - N//2 start."""
    from dataclasses import replace

    from router.ratio.config import RatioConfig
    from tooling.planner.planner import goodput_rps
    from tooling.planner.sim import attainment
    from tooling.planner.sim_adaptive import simulate_adaptive

    n = args.workers
    cfg = RatioConfig(
        mode="adaptive",
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        attainment_target=args.target,
        max_prefill=n - 1,
        max_decode=n - 1,
        window_s=args.window_s,
        interval_s=1.0,
        cooldown_s=args.cooldown_s,
        min_requests=args.min_requests,
    )
    spec = replace(
        base,
        prefill=n // 2,
        decode=n - n // 2,
        chunk_tokens=args.chunk_tokens[0],
        max_num_seqs=args.max_num_seqs[0],
    )
    res = simulate_adaptive(reqs, spec, cost, cfg)
    slo = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    return {
        "start": f"{spec.prefill}:{spec.decode}",
        "attainment": attainment(res.outcomes, *slo)[2],
        "goodput_rps": goodput_rps(reqs, res.outcomes, *slo),
        "changes": [list(c) for c in res.changes],
    }
