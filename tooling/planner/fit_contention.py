"""`pdserve plan --validate RUN_DIR... --fit-contention OUT`: fit the contended efficiencies of
a profile's multi-thread cost models to saved bench runs. Pure (reads JSON); runs in the CLI
process.

A step on several torch threads turns less than its processor share into progress while the
cores are oversubscribed (`sim_cpu`, `CostModel.contended_prefill_eff`). How much less in a
served cluster is not what a bare microbenchmark shows: beside a competitor busy half the
time in 2 ms bursts, a 2-thread 256-token prefill of `models/small` kept 0.44-0.56 of its
share and a batch-8 decode step 0.79-0.87, but a simulator charging that predicted the served
colocated runs far slower than measured (docs/performance.md, 2026-11-27). So they are
fitted, like the serving overheads, to served runs:

1. the runs of multi-thread workers among `run_dirs` are loaded once (runs of 1-thread workers
   do not depend on the efficiencies);
2. every pair of `PREFILL_GRID` x `DECODE_GRID` is set on every multi-thread cost model, and
   those runs are replayed and judged as `validate` judges them;
3. the best pair puts the most points inside their bands; among equals, the one whose
   latencies are nearest the measured: the smallest mean |ln(predicted / measured)| over
   every run's TTFT and TPOT p50 and p90; then the one nearer 1 (the least assumed).

Fitting on one set of runs and validating on others (`plan --validate` with the written
profile) is what tells a fitted value from an overfitted one.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tooling.planner.profiles import Profile
from tooling.planner.validate import Validation, judge, load_cases

PREFILL_GRID = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)
DECODE_GRID = (1.0, 0.9, 0.8)


@dataclass(frozen=True)
class FitRow:
    """One candidate pair and how the multi-thread points fared with it."""

    prefill_eff: float
    decode_eff: float
    inside: int
    points: int
    attainment_err: float  # mean |predicted - median measured| attainment over points, 0..1
    latency_err: float  # mean |ln(predicted / measured)| of TTFT and TPOT p50 / p90 over runs


def with_contention(profile: Profile, prefill_eff: float, decode_eff: float) -> Profile:
    """`profile` with these efficiencies on every cost model of more than one thread."""
    costs = {
        t: replace(c, contended_prefill_eff=prefill_eff, contended_decode_eff=decode_eff)
        if t > 1
        else c
        for t, c in profile.costs.items()
    }
    return replace(profile, costs=costs)


LATENCY_KEYS = ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms")


def latency_error(v: Validation) -> float:
    """Mean |ln(predicted / measured)| over every run's `LATENCY_KEYS` that both sides have
    (inf when none has)."""
    logs = [
        abs(math.log(pred / meas))
        for p in v.points
        for r in p.runs
        for k in LATENCY_KEYS
        if (meas := r.measured[k]) and (pred := r.predicted[k])
    ]
    return statistics.fmean(logs) if logs else math.inf


def attainment_error(v: Validation) -> float:
    """Mean |predicted - median measured| attainment over the points."""
    return statistics.fmean(
        abs(p.predicted - statistics.median(float(r.measured["attainment"] or 0.0) for r in p.runs))
        for p in v.points
    )


def fit_contention(
    run_dirs: Sequence[str | Path],
    profile: Profile,
    machine_cores: float | None,
    prefill_grid: Sequence[float] = PREFILL_GRID,
    decode_grid: Sequence[float] = DECODE_GRID,
    margin: float = 0.05,
) -> tuple[Profile, list[FitRow]]:
    """The fitted profile and every candidate's row, best first (module docstring). ValueError
    when no run is of a multi-thread worker or a grid is empty."""
    if not prefill_grid or not decode_grid:
        raise ValueError("the grids of candidate efficiencies are empty")
    cases = [c for d in run_dirs for c in load_cases(d) if c.threads > 1]
    if not cases:
        raise ValueError("no run of a multi-thread worker to fit the contended efficiencies on")
    rows = []
    for pe in prefill_grid:
        for de in decode_grid:
            v = judge(cases, with_contention(profile, pe, de), machine_cores, margin)
            inside = sum(p.inside for p in v.points)
            rows.append(
                FitRow(pe, de, inside, len(v.points), attainment_error(v), latency_error(v))
            )
    rows.sort(key=lambda r: (-r.inside, round(r.latency_err, 9), -r.prefill_eff - r.decode_eff))
    best = rows[0]
    return with_contention(profile, best.prefill_eff, best.decode_eff), rows


def fit_markdown(rows: Sequence[FitRow]) -> str:
    """The candidates as a Markdown table, best first."""
    lines = [
        "| prefill eff | decode eff | inside | attainment error | latency error |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.prefill_eff:.2f} | {r.decode_eff:.2f} | {r.inside} of {r.points} | "
            f"{r.attainment_err:.1%} | {r.latency_err:.3f} |"
        )
    return "\n".join(lines)
