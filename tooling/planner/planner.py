"""The offline ratio planner: simulate every prefill:decode split of N workers (and a few
batch/chunk settings) on a workload and rank them. Pure; runs in `pdserve plan`.

In the spirit of DistServe's placement search, but for one machine's worth of workers: the
search space is small (N - 1 ratios x chunk budgets x batch limits), so it is enumerated and
each point is simulated (`sim.simulate`) on the very requests a real run would send:

- at the given rate, each point gets its TTFT / TPOT / both-SLO attainment and its goodput
  (requests meeting both SLOs per second of the run);
- with `rate_search`, each point also gets its *max rate*: the highest offered rate whose
  attainment is >= `target` (bisection between `lo` and `hi`, assuming attainment falls as
  the rate rises — DistServe's per-GPU goodput, here per cluster).

`rank` orders the rows best first: max rate (when searched), then attainment, then goodput,
then fewer prefill workers (the cheaper side on ties, deterministic).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from tooling.planner.costs import CostModel
from tooling.planner.sim import ClusterSpec, SimOutcome, SimRequest, attainment, simulate


@dataclass(frozen=True)
class PlanRow:
    """One simulated configuration."""

    prefill: int
    decode: int
    chunk_tokens: int
    max_num_seqs: int
    ttft_attainment: float
    tpot_attainment: float
    attainment: float
    goodput_rps: float
    max_rate: float | None = None

    @property
    def ratio(self) -> str:
        return f"{self.prefill}:{self.decode}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def goodput_rps(
    reqs: Sequence[SimRequest], outs: Sequence[SimOutcome], slo_ttft_s: float, slo_tpot_s: float
) -> float:
    """Requests meeting both SLOs per second, over t = 0 .. the last request's end."""
    if not reqs:
        return 0.0
    span = max([o.end_s or 0.0 for o in outs] + [r.arrival_s for r in reqs])
    _, _, both = attainment(outs, slo_ttft_s, slo_tpot_s)
    return both * len(reqs) / span if span > 0 else 0.0


def max_rate(
    make: Callable[[float], list[SimRequest]],
    spec: ClusterSpec,
    cost: CostModel,
    slo_ttft_s: float,
    slo_tpot_s: float,
    target: float,
    lo: float,
    hi: float,
    steps: int = 8,
) -> float:
    """Highest rate in [lo, hi] whose attainment is >= target (0.0 when even `lo` fails;
    `hi` when `hi` passes); geometric bisection, `steps` simulations after the two ends."""

    def ok(rate: float) -> bool:
        return attainment(simulate(make(rate), spec, cost), slo_ttft_s, slo_tpot_s)[2] >= target

    if not ok(lo):
        return 0.0
    if ok(hi):
        return hi
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def plan(
    reqs: Sequence[SimRequest],
    cost: CostModel,
    workers: int,
    slo_ttft_s: float,
    slo_tpot_s: float,
    base: ClusterSpec,
    chunk_options: Sequence[int] = (),
    seq_options: Sequence[int] = (),
    rate_search: Callable[[float], list[SimRequest]] | None = None,
    target: float = 0.9,
    rate_bounds: tuple[float, float] = (0.05, 50.0),
) -> list[PlanRow]:
    """Every (p:d with p + d = `workers`, chunk, seqs) point, ranked (`rank`).
    `base` gives the settings not searched (KV blocks, cores, ...)."""
    if workers < 2:
        raise ValueError(f"workers must be >= 2 (one prefill and one decode), got {workers}")
    chunks = list(chunk_options) or [base.chunk_tokens]
    seqs = list(seq_options) or [base.max_num_seqs]
    rows = []
    for p, chunk, seq in itertools.product(range(1, workers), chunks, seqs):
        spec = replace(base, prefill=p, decode=workers - p, chunk_tokens=chunk, max_num_seqs=seq)
        outs = simulate(reqs, spec, cost)
        ttft, tpot, both = attainment(outs, slo_ttft_s, slo_tpot_s)
        rate = None
        if rate_search is not None:
            rate = max_rate(rate_search, spec, cost, slo_ttft_s, slo_tpot_s, target, *rate_bounds)
        good = goodput_rps(reqs, outs, slo_ttft_s, slo_tpot_s)
        rows.append(PlanRow(p, workers - p, chunk, seq, ttft, tpot, both, good, rate))
    return rank(rows)


def rank(rows: Sequence[PlanRow]) -> list[PlanRow]:
    """Best first (module docstring)."""
    return sorted(
        rows,
        key=lambda r: (
            -(r.max_rate or 0.0),
            -round(r.attainment, 9),
            -r.goodput_rps,
            r.prefill,
            r.chunk_tokens,
            r.max_num_seqs,
        ),
    )


def table(rows: Sequence[PlanRow], slo_ttft_ms: float, slo_tpot_ms: float) -> str:
    """A Markdown table of `rows` (best first) for the CLI and reports."""
    searched = any(r.max_rate is not None for r in rows)
    head = "| ratio P:D | chunk | max seqs | TTFT att. | TPOT att. | both | goodput req/s |"
    line = "|---|---|---|---|---|---|---|"
    if searched:
        head += " max rate req/s |"
        line += "---|"
    out = [f"SLOs: TTFT {slo_ttft_ms:g} ms, TPOT {slo_tpot_ms:g} ms", "", head, line]
    for r in rows:
        row = (
            f"| {r.ratio} | {r.chunk_tokens} | {r.max_num_seqs} | {r.ttft_attainment:.1%} | "
            f"{r.tpot_attainment:.1%} | {r.attainment:.1%} | {r.goodput_rps:.2f} |"
        )
        if searched:
            row += f" {r.max_rate or 0.0:.2f} |"
        out.append(row)
    return "\n".join(out)
