"""`pdserve simulate`: the ratio controller against every fixed split, on a simulated cluster.

Runs in the CLI process (pure simulation, no workers; it imports torch through the workers' KV
hand-off owner, `worker.kv_handoff`, which the simulator drives over a simulated transport).

    pdserve simulate --profile deploy/profiles/h100-llama3-8b.json --workers 16
                     --workload shifting|stationary|WORKLOAD[@CTX]:RATE:SECONDS,...
                     [--policy adaptive|fixed:P:D] [--slo-ttft-ms MS --slo-tpot-ms MS]
                     [--seed N] --out DIR

Writes DIR/simulation.json (adaptive_goodput, best_fixed_goodput, best_fixed_split, every
fixed split's goodput, the controller's decisions), DIR/report.md and its plots; prints the
headline. Exit codes: 0 ok, 2 bad arguments. `add_simulate_parser` registers it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_simulate_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `simulate`: the controller at cluster scale, in simulation."""
    p = subparsers.add_parser(
        "simulate",
        help="simulate the ratio controller vs every fixed prefill:decode split at scale",
        description="Simulate a cluster of --workers workers with a cost --profile on a "
        "workload: every fixed prefill:decode split, and the router's ratio controller "
        "(adaptive) starting from the best of them. Writes simulation.json, report.md and "
        "plots to --out.",
    )
    p.add_argument("--profile", required=True, help="cost profile JSON (deploy/profiles/*.json)")
    p.add_argument("--workers", type=int, required=True, help="workers in the cluster (>= 2)")
    p.add_argument(
        "--workload",
        required=True,
        help="built-in (shifting, stationary: rates scale with --workers) or phases "
        "WORKLOAD[@CONTEXT]:RATE:SECONDS,... with cluster rates in req/s",
    )
    p.add_argument(
        "--policy",
        default="adaptive",
        help="adaptive | fixed:P:D — the run the timeline shows (all are simulated)",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=1500.0, help="TTFT SLO in ms")
    p.add_argument("--slo-tpot-ms", type=float, default=50.0, help="TPOT SLO in ms")
    p.add_argument("--target", type=float, default=0.9, help="attainment target")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's draws")
    p.add_argument(
        "--start",
        default="",
        help="P:D the adaptive run starts from (default: the best fixed split)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="spread the workers over this many nodes: pair-aware routing, KV across nodes "
        "over --cross-node-gbps links, and a node-blind vs pair-aware comparison",
    )
    p.add_argument(
        "--cross-node-gbps",
        type=float,
        help="link between nodes in GB/s (default: the profile's links.cross_node_gbps)",
    )
    p.add_argument(
        "--hybrid",
        default="",
        help="hybrid cluster: START:MIN:MAX local-prefill threshold in tokens (every split runs "
        "hybrid at START; the adaptive run's controller moves it within MIN..MAX); default: "
        "off, no local prefill",
    )
    p.add_argument("--out", required=True, help="folder for simulation.json, report.md, plots")
    p.set_defaults(func=simulate_main)


def simulate_main(args: argparse.Namespace) -> int:
    from tooling.planner.profiles import load_profile
    from tooling.planner.scale import ScaleSetup, run_scale
    from tooling.planner.scale_report import write_scale_report

    try:
        setup = ScaleSetup(
            profile=load_profile(args.profile),
            workers=args.workers,
            workload=args.workload,
            slo_ttft_s=args.slo_ttft_ms / 1e3,
            slo_tpot_s=args.slo_tpot_ms / 1e3,
            target=args.target,
            seed=args.seed,
            policy=args.policy,
            start=args.start,
            nodes=args.nodes,
            cross_node_gbps=args.cross_node_gbps,
            hybrid=args.hybrid,
        )
        res = run_scale(setup)
    except (ValueError, KeyError, OSError) as exc:
        print(f"pdserve simulate: {exc}", file=sys.stderr)
        return 2
    report = write_scale_report(res, Path(args.out))
    print(
        f"adaptive {res.adaptive_goodput:.1f} req/s vs best fixed {res.best_fixed_split} "
        f"{res.best_fixed_goodput:.1f} req/s: {res.adaptive_vs_best_fixed:.2f}x"
    )
    if res.pairing:
        pr = res.pairing
        print(
            f"pairs at {pr['split']} over {args.nodes} nodes: pair-aware "
            f"{pr['pair_aware']['goodput_rps']:.1f} req/s vs node-blind "
            f"{pr['node_blind']['goodput_rps']:.1f} req/s"
        )
    print(f"report: {report}")
    return 0
