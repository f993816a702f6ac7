"""`pdserve plan`: recommend a configuration by simulation, or validate the simulator.

Runs in the CLI process. Heavy imports happen inside the subcommand.

    pdserve plan (--workload chat --rate 2 | --phases chat:4:60,summarize:1:60 | --trace F)
                 --slo-ttft-ms MS --slo-tpot-ms MS (--profile PROFILE.json | --model DIR)
                 [--workers 2] [--threads 1] [--colocated-workers 1] [--context 1024]
                 [--num-requests 200] [--cores 2] [--chunk-tokens 128,256] [--search-rate]
                 [--seeds 3] [--search-duration 30] [--policy prefix_aware]
                 [--hybrid-thresholds 128,512 | --no-hybrid]
                 [--adaptive] [--json OUT.json]
    pdserve plan --validate RUN_DIR [RUN_DIR ...] --profile PROFILE.json [--anchor-unloaded]
                 [--cores 2] [--report validation.md] [--json validation.json]
                 [--fit-contention FITTED.json]

`plan` simulates the alternatives for a budget of --workers workers of --threads threads:
colocated (--colocated-workers workers sharing the same threads; each chunk budget, and whole
prompts), every prefill:decode split (each chunk budget) and every split in hybrid mode (decode
workers prefill the prompts whose uncached part is at most the threshold themselves; each
threshold of --hybrid-thresholds, default the workload's prompt-length quartiles and longest
prompt), on the workload's requests, routed by the router's --policy; it prints them ranked,
each with its predicted goodput (with --search-rate: its max rate meeting the attainment
target, DistServe's goodput), the best of each mode, and the recommended (mode, ratio,
threshold, chunk budget).
`plan --validate` replays the exact requests of saved `pdserve bench` runs and compares
predicted with measured attainment and latency percentiles (`tooling.planner.validate`);
`--fit-contention` first fits the profile's contended efficiencies to those runs
(`tooling.planner.fit_contention`) and validates with the fitted profile.
Exit codes: 0 ok, 2 bad arguments, 1 failure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace
from datetime import date
from pathlib import Path
from typing import Any


def ints(value: str) -> tuple[int, ...]:
    """argparse type: '128,256' -> (128, 256), each >= 1."""
    try:
        out = tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {value!r}"
        ) from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {value!r}")
    return out


def add_plan_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `plan`: recommend a mode, ratio and chunk budget by simulation."""
    p = subparsers.add_parser(
        "plan",
        help="recommend colocated or a prefill:decode ratio (and chunk budget) for a workload; "
        "or validate the simulator against saved bench runs (--validate)",
        description="Simulate colocated and every prefill:decode split of --workers workers "
        "on the workload with profiled costs; print them ranked with their predicted goodput "
        "and the recommendation. --validate RUN_DIR... replays saved `pdserve bench` runs.",
    )
    w = p.add_mutually_exclusive_group(required=True)
    w.add_argument("--workload", help="chat | code | summarize | prefix | multiturn")
    w.add_argument(
        "--phases",
        metavar="W:RATE:S[,...]",
        help="shifting workload, a comma list of WORKLOAD[@CONTEXT]:RATE:SECONDS phases",
    )
    w.add_argument("--trace", help="request trace (.csv/.jsonl) of the goodput bench")
    w.add_argument("--validate", nargs="+", metavar="RUN_DIR", help="saved bench runs to replay")
    p.add_argument(
        "--rate", type=float, help="requests/s for --workload (required with it; no default)"
    )
    p.add_argument("--num-requests", type=int, default=200, help="requests of --workload")
    p.add_argument("--context", type=int, default=1024, help="context budget of the lengths")
    p.add_argument(
        "--output-len", type=int, help="fixed output length (default: the workload's draw)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's lengths")
    p.add_argument(
        "--slo-ttft-ms", type=float, help="TTFT SLO in ms (required unless --validate; no default)"
    )
    p.add_argument(
        "--slo-tpot-ms", type=float, help="TPOT SLO in ms (required unless --validate; no default)"
    )
    p.add_argument(
        "--long-prompt-slo",
        metavar="N:TTFT_MS:TPOT_MS",
        help="judge prompts of >= N tokens by these SLOs instead, as `pdserve bench "
        "--long-prompt-slo` (default: one SLO for every request)",
    )
    p.add_argument("--target", type=float, default=0.9, help="attainment target")
    p.add_argument("--workers", type=int, default=2, help="workers of a disaggregated cluster")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument(
        "--colocated-workers",
        type=int,
        default=1,
        help="colocated workers sharing the disaggregated cluster's threads (1: one with all)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="cost profile JSON (`pdserve profile`, deploy/profiles)")
    src.add_argument("--model", help="profile this model folder first (no calibration)")
    p.add_argument(
        "--cores",
        type=float,
        default=float(os.cpu_count() or 1),
        help="CPU cores the workers share (default: this machine's); 0 = a device each (GPU)",
    )
    p.add_argument(
        "--chunk-tokens",
        type=ints,
        metavar="N[,N...]",
        default=(256,),
        help="prefill step budgets to try, a comma list, e.g. 128,256,512",
    )
    p.add_argument("--max-num-seqs", type=int, default=32, help="decode batch limit per worker")
    p.add_argument("--num-kv-blocks", type=int, default=1024, help="KV blocks per worker")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-inflight", type=int, default=64, help="router's running limit")
    p.add_argument("--max-queued", type=int, default=256, help="router's waiting limit")
    p.add_argument("--search-rate", action="store_true", help="also find each max rate")
    p.add_argument(
        "--search-duration",
        type=float,
        default=0.0,
        metavar="S",
        help="--search-rate: each simulated rate sends max(--num-requests, rate x S) requests, "
        "as a bench of S seconds of arrivals per rate (default: 0, --num-requests only)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="--search-rate: the max rate is the median over trace seeds SEED .. SEED+N-1 "
        "(as a bench's repeats on different seeds; default: 1, --seed only)",
    )
    p.add_argument(
        "--policy",
        default="prefix_aware",
        help="the router's routing policy to simulate (default: the router's, prefix_aware)",
    )
    h = p.add_mutually_exclusive_group()
    h.add_argument(
        "--hybrid-thresholds",
        type=ints,
        metavar="N[,N...]",
        help="hybrid thresholds (uncached prompt tokens) to try with every split "
        "(default: the workload's prompt-length quartiles and longest prompt)",
    )
    h.add_argument("--no-hybrid", action="store_true", help="compare the fixed modes only")
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="also simulate the ratio controller (mode 'adaptive'), starting at N//2 prefill",
    )
    p.add_argument("--window-s", type=float, default=8.0, help="controller window (--adaptive)")
    p.add_argument("--cooldown-s", type=float, default=6.0, help="controller cooldown")
    p.add_argument("--min-requests", type=int, default=6, help="controller min_requests")
    p.add_argument(
        "--report", help="--validate: write the Markdown report here (default: print only)"
    )
    p.add_argument(
        "--anchor-unloaded",
        action="store_true",
        help="--validate: scale the profile's step costs to each bench's own unloaded probes "
        "of the configuration first (tests the load model with the environment's unloaded "
        "costs)",
    )
    p.add_argument(
        "--fit-contention",
        metavar="OUT",
        help="--validate: first fit the contended efficiencies of the profile's multi-thread "
        "cost models to the runs, write the fitted profile to OUT and validate with it "
        "(default: validate with the profile as it is)",
    )
    p.add_argument(
        "--json", help="write the rows (or the validation) as JSON here (default: print only)"
    )
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


def _long_prompt(args: argparse.Namespace) -> Any:
    """--long-prompt-slo as a `LongPromptSLO` (None when not given); ValueError when malformed."""
    from tooling.goodput.analysis import LongPromptSLO

    return None if args.long_prompt_slo is None else LongPromptSLO.parse(args.long_prompt_slo)


def _profile(args: argparse.Namespace) -> Any:
    from tooling.planner.profiles import Profile, load_profile

    if args.profile:
        return load_profile(args.profile)
    from tooling.planner.profiler import profile_engine

    threads = {args.threads, args.threads * args.workers // max(1, args.colocated_workers)}
    return Profile(costs={t: profile_engine(args.model, threads=t) for t in sorted(threads)})


def validate_main(args: argparse.Namespace, profile: Any) -> int:
    from tooling.planner.validate import validate, validation_markdown

    cores = args.cores if args.cores > 0 else None
    if args.fit_contention:
        profile = _fit_contention(args, profile, cores)
    v = validate(args.validate, profile, cores, anchor=args.anchor_unloaded)
    text = validation_markdown(v, args.profile or args.model)
    print(text)
    if args.report:
        Path(args.report).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(v.to_json(), indent=1) + "\n")
    return 0


def _fit_contention(args: argparse.Namespace, profile: Any, cores: float | None) -> Any:
    """`--fit-contention OUT`: print the candidates, write and return the fitted profile."""
    from tooling.planner.fit_contention import fit_contention, fit_markdown

    fitted, rows = fit_contention(args.validate, profile, cores)
    best = rows[0]
    print(f"## Contended efficiencies fitted to {len(args.validate)} run folder(s)\n")
    print(fit_markdown(rows) + "\n")
    fitted = replace(
        fitted,
        derivation=(
            *fitted.derivation,
            f"contended efficiencies (prefill {best.prefill_eff:g}, decode {best.decode_eff:g}) "
            f"fitted on {date.today().isoformat()} by `pdserve plan --validate "
            f"{' '.join(map(str, args.validate))} --fit-contention`",
        ),
    )
    print(f"wrote {fitted.save(args.fit_contention)}\n")
    return fitted


def request_maker(args: argparse.Namespace, seed: int) -> Any:
    """--search-rate's requests of --workload at a given rate, on trace seed `seed`."""
    from tooling.planner.workload import requests, to_sim

    def make(rate: float) -> list[Any]:
        n = max(args.num_requests, math.ceil(rate * args.search_duration), 1)
        return to_sim(requests(args.workload, n, rate, args.context, seed, args.output_len))

    return make


def plan_main(args: argparse.Namespace) -> int:
    from tooling.planner.planner import (
        alternatives,
        best_by_mode,
        plan_alternatives,
        table,
        threshold_grid,
    )
    from tooling.planner.sim import ClusterSpec
    from tooling.planner.workload import to_sim

    try:
        if args.validate:
            return validate_main(args, _profile(args))
        if args.slo_ttft_ms is None or args.slo_tpot_ms is None:
            raise ValueError("--slo-ttft-ms and --slo-tpot-ms are required")
        long_prompt = _long_prompt(args)
        if long_prompt is not None and args.adaptive:
            raise ValueError("--adaptive judges by one SLO pair (the controller's); drop "
                             "--long-prompt-slo")  # fmt: skip
        if args.workers < 2:
            raise ValueError(f"--workers must be >= 2, got {args.workers}")
        specs = _specs(args)
        profile = _profile(args)
        colocated_workers = args.colocated_workers
        shared = args.threads * args.workers // max(1, colocated_workers)
        if shared not in profile.costs:
            print(
                f"pdserve plan: the profile has no costs for {shared} threads; colocated is "
                f"planned as {args.workers} workers of {args.threads} thread(s)",
                file=sys.stderr,
            )
            colocated_workers = args.workers
        base = ClusterSpec(
            prefill=1,
            decode=1,
            max_num_seqs=args.max_num_seqs,
            num_kv_blocks=args.num_kv_blocks,
            block_size=args.block_size,
            max_inflight=args.max_inflight,
            max_queued=args.max_queued,
            cores=args.cores if args.cores > 0 else None,
        )
        reqs = to_sim(specs)
        if args.no_hybrid:
            thresholds: list[int] = []
        elif args.hybrid_thresholds:
            thresholds = list(args.hybrid_thresholds)
        else:
            thresholds = threshold_grid(reqs, args.block_size)
        alts = alternatives(
            base,
            args.workers,
            args.threads,
            colocated_workers,
            args.chunk_tokens,
            args.context,
            thresholds,
        )
        search = []
        if args.search_rate:
            if not args.workload:
                raise ValueError("--search-rate needs --workload (a rate-free request list)")
            if args.seeds < 1 or args.search_duration < 0:
                raise ValueError(
                    f"--seeds must be >= 1 and --search-duration >= 0, got {args.seeds} and "
                    f"{args.search_duration}"
                )
            search = [request_maker(args, args.seed + k) for k in range(args.seeds)]

        rows = plan_alternatives(
            reqs,
            profile.cost,
            alts,
            args.slo_ttft_ms / 1e3,
            args.slo_tpot_ms / 1e3,
            rate_search=search,
            target=args.target,
            policy=args.policy,
            long_prompt=long_prompt,
        )
        adaptive = None
        if args.adaptive:
            adaptive = _adaptive(args, reqs, profile.cost(args.threads), base)
    except (ValueError, OSError, KeyError) as exc:
        print(f"pdserve plan: {exc}", file=sys.stderr)
        return 2
    print(table(rows, args.slo_ttft_ms, args.slo_tpot_ms, long_prompt))
    if adaptive is not None:
        print(
            f"\nadaptive controller from {adaptive['start']}: predicted attainment "
            f"{adaptive['attainment']:.1%}, goodput {adaptive['goodput_rps']:.2f} req/s, "
            f"{len(adaptive['changes']) - 1} role switches"
        )
    best = rows[0]
    what = "max rate" if best.max_rate is not None else "goodput at this rate"
    modes = best_by_mode(rows)
    print(f"\nbest of each mode ({what}, req/s):")
    for mode, row in modes.items():
        print(f"  {mode}: {_describe(row)}: {_value(row):.2f} (attainment {row.attainment:.1%})")
    print(
        f"\nrecommended: {_describe(best)}, chunk {best.chunk_label}, "
        f"{best.threads} thread(s)/worker, max_num_seqs={best.max_num_seqs}: predicted "
        f"attainment {best.attainment:.1%}, {what} {_value(best):.2f} req/s"
    )
    if args.json:
        data = {
            "args": {k: v for k, v in vars(args).items() if k != "func"},
            "requests": len(specs),
            "profile": profile.to_json(),
            "rows": [r.to_json() | {"mode": r.mode, "ratio": r.ratio} for r in rows],
            "recommended": rows[0].to_json() | {"mode": rows[0].mode, "ratio": rows[0].ratio},
            "best_by_mode": {
                m: r.to_json() | {"mode": r.mode, "ratio": r.ratio, "value_rps": _value(r)}
                for m, r in modes.items()
            },
            "hybrid_thresholds": thresholds,
            "adaptive": adaptive,
        }
        Path(args.json).write_text(json.dumps(data, indent=1, default=str) + "\n")
    return 0


def _describe(row: Any) -> str:
    """'colocated x1', 'disagg 1:1' or 'hybrid 1:1, threshold 256'."""
    if row.colocated:
        return str(row.ratio)
    if row.hybrid_threshold is None:
        return f"disagg {row.ratio}"
    return f"hybrid {row.ratio}, threshold {row.hybrid_threshold}"


def _value(row: Any) -> float:
    """The row's predicted max goodput (searched max rate), else its goodput at the rate."""
    return float(row.max_rate if row.max_rate is not None else row.goodput_rps)


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
        max_num_seqs=args.max_num_seqs,
    )
    res = simulate_adaptive(reqs, spec, cost, cfg)
    slo = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    return {
        "start": f"{spec.prefill}:{spec.decode}",
        "attainment": attainment(res.outcomes, *slo)[2],
        "goodput_rps": goodput_rps(reqs, res.outcomes, *slo),
        "changes": [list(c) for c in res.changes],
    }
