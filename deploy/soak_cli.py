"""`pdserve soak`: a seeded chaos soak of a whole local cluster. CLI process (the soak runs here).

    pdserve soak --model DIR [--topology 2p2d] [--requests N] [--rate R] [--seed S]
                 [--faults LIST] [--num-faults N] [--launcher ray|processes]
                 [--long-stop-s S] [--stall-timeout-s S] [--stall-slack-s S] --out DIR

Prints the report's path and the summary line; exits 0 when every check passed, 1 when one
failed (a wrong token, a hung request, a leaked block, ...: see `tooling.soak.check`) or the
cluster did not start, 2 for bad arguments. `add_soak_parser(subparsers)` registers the parser
and sets `func` (see deploy/cli.py). Heavy imports happen inside `soak_main`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_soak_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `soak`."""
    from tooling.soak.config import DEFAULT_FAULTS, FAULT_KINDS

    p = subparsers.add_parser(
        "soak",
        help="chaos soak: mixed load through worker kills, freezes and Redis restarts",
        description="Start a local cluster (its own redis-server, workers, router), compute "
        "the reference output of every request with the colocated engine, send a seeded "
        "open-loop mixed load (greedy, sampled, shared prefixes, stop strings, cancels, short "
        "deadlines, bursts above the queue bound) while injecting faults at seeded times, then "
        "check every request (exact or a clear status, in time) and the cluster (no leaked "
        "block, nothing in flight, no stale Redis entry, restarted workers serve). Writes "
        "soak.json, requests.jsonl, report.md and timeline.png to --out.",
    )
    a = p.add_argument
    a("--model", required=True, help="model folder; built (tiny preset) when it has none")
    a("--out", required=True, help="run folder")
    a("--topology", default="2p2d", help="workers as <P>p<D>d")
    a("--requests", type=int, default=300, help="requests in total")
    a("--rate", type=float, default=4.0, help="mean Poisson arrival rate, requests/s")
    a("--seed", type=int, default=0, help="seeds the workload and the fault schedule")
    a("--faults", default=DEFAULT_FAULTS,
      help=f"comma list of kind[:count] from {list(FAULT_KINDS)}, or 'none'")  # fmt: skip
    a("--num-faults", type=int, help="faults of the kinds listed without a count "
      "(default: max(5, requests / 50))")  # fmt: skip
    a("--bursts", type=int, help="bursts above the queue bound (default: 1 per 300 requests)")
    a("--storms", type=int, help="deadline storms: 10 requests with 5..95 ms deadlines at once "
      "(default: 1 per 150 requests)")  # fmt: skip
    a("--oversized", type=int, help="oversized HTTP chat bodies, each must get a 400 naming "
      "messages[0].content (default: 1 per 150 requests)")  # fmt: skip
    a("--oversized-mb", type=int, default=10, help="size of an oversized chat message, MiB")
    a("--disconnects", type=int, help="HTTP streams reset by their client after the first "
      "event (default: 1 per 60 requests)")  # fmt: skip
    a("--launcher", choices=["processes", "ray"], default="processes",
      help="who starts and restarts the workers")  # fmt: skip
    a("--stop-max-s", type=float, default=10.0, help="longest SIGSTOP of a worker, seconds")
    a("--long-stop-s", type=float, help="how long a long-stop fault stops its worker, seconds "
      "(default: the deadline + 10 s, longer than any request's deadline)")  # fmt: skip
    a("--default-timeout-s", type=float, default=30.0,
      help="the router's deadline of requests that set none, seconds")  # fmt: skip
    a("--stall-timeout-s", type=float, default=3.0, help="the router's stall timeout: a "
      "silent worker that does not answer a status call is frozen and left, seconds")  # fmt: skip
    a("--stall-slack-s", type=float, default=3.0, help="a request waiting on the cluster "
      "longer than the stall timeout + this, beyond its own work, fails the soak")  # fmt: skip
    p.set_defaults(func=soak_main)


def soak_main(args: argparse.Namespace) -> int:
    from deploy.tool_launchers import launch_workers
    from tooling.models.random_model import make_random_model
    from tooling.soak.config import SoakConfig
    from tooling.soak.run import run_soak

    try:
        config = SoakConfig(
            model=Path(args.model), out=Path(args.out), topology=args.topology,
            launcher=args.launcher, requests=args.requests, rate=args.rate, seed=args.seed,
            faults=args.faults, num_faults=args.num_faults, bursts=args.bursts,
            storms=args.storms, oversized=args.oversized, oversized_mb=args.oversized_mb,
            disconnects=args.disconnects,
            stop_max_s=args.stop_max_s, stop_min_s=min(1.0, args.stop_max_s),
            long_stop_s=args.long_stop_s, default_timeout_s=args.default_timeout_s,
            stall_timeout_s=args.stall_timeout_s, stall_slack_s=args.stall_slack_s,
        )  # fmt: skip
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        print(f"pdserve soak: {exc}", file=sys.stderr)
        return 2
    if not (config.model / "config.json").is_file():
        print(f"pdserve soak: building the tiny random model in {config.model}", file=sys.stderr)
        make_random_model(config.model, "tiny", seed=0)
    try:
        result = run_soak(config, launch_workers)
    except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
        print(f"pdserve soak: failed: {exc}", file=sys.stderr)
        return 1
    s = result.summary
    print(f"report: {result.report}")
    print(
        f"{'PASSED' if result.passed else 'FAILED'}: {s['requests']} requests, "
        f"{len(s['faults'])} faults: {s['completed_exact']} exact, {s['near_tie']} near-tie, "
        f"statuses {s['ended_with_status']}, wrong {s['wrong']}, hung {s['hung']}, "
        f"stalled {s['stalled']}, "
        f"unclear {s['unclear']}, leaked blocks {s['leaked_blocks']}"
    )
    for line in s["failures"]:
        print(f"  - {line}")
    return 0 if result.passed else 1
