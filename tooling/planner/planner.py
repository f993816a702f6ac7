"""The offline planner: simulate colocated and every prefill:decode split of N workers (and a few
batch/chunk settings) on a workload and rank them. Pure; runs in `pdserve plan`.

In the spirit of DistServe's placement search, but for one machine's worth of workers: the
search space is small (N - 1 ratios x chunk budgets x batch limits), so it is enumerated and
each point is simulated (`sim.simulate`) on the very requests a real run would send:

- at the given rate, each point gets its TTFT / TPOT / both-SLO attainment and its goodput
  (requests meeting both SLOs per second of the run);
- with `rate_search`, each point also gets its *max rate*: the highest offered rate whose
  attainment is >= `target` (bisection between `lo` and `hi`, assuming attainment falls as
  the rate rises — DistServe's per-GPU goodput, here per cluster). `plan_alternatives` takes
  one request maker per trace seed and keeps the median of their max rates, as a bench's
  repeats on different seeds are summarized: one seed's arrivals can be much gentler (or
  burstier) than another's at the same rate.

`alternatives` lists the configurations a user can choose between for a budget of N workers of
t threads: colocated (its workers share the same threads; each chunk budget, and whole prompts),
every split, and every split in hybrid mode with each threshold of a small grid
(`threshold_grid`: the workload's prompt-length quartiles and longest prompt, unless given);
`plan_alternatives` simulates them (each with the costs of its thread count). `rank` orders
the rows best first: max rate (when searched), then attainment, then goodput, then
disaggregated before colocated, fixed before hybrid, fewer prefill workers (deterministic on
ties); `best_by_mode` keeps the best row of each mode (colocated, disagg, hybrid).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from tooling.goodput.analysis import LongPromptSLO
from tooling.planner.costs import CostModel
from tooling.planner.sim import ClusterSpec, SimOutcome, SimRequest, attainment, simulate


@dataclass(frozen=True)
class PlanRow:
    """One simulated configuration: disaggregated `prefill`:`decode`, or `colocated` workers
    (then prefill = decode = 0); `chunked` False: whole prompts per step."""

    prefill: int
    decode: int
    chunk_tokens: int
    max_num_seqs: int
    ttft_attainment: float
    tpot_attainment: float
    attainment: float
    goodput_rps: float
    max_rate: float | None = None
    colocated: int = 0
    chunked: bool = True
    threads: int = 1
    hybrid_threshold: int | None = None

    @property
    def ratio(self) -> str:
        return f"colocated x{self.colocated}" if self.colocated else f"{self.prefill}:{self.decode}"

    @property
    def mode(self) -> str:
        if self.colocated:
            return "colocated"
        return "disagg" if self.hybrid_threshold is None else "hybrid"

    @property
    def threshold_label(self) -> str:
        return "-" if self.hybrid_threshold is None else str(self.hybrid_threshold)

    @property
    def chunk_label(self) -> str:
        return str(self.chunk_tokens) if self.chunked else "whole prompts"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def goodput_rps(
    reqs: Sequence[SimRequest],
    outs: Sequence[SimOutcome],
    slo_ttft_s: float,
    slo_tpot_s: float,
    long_prompt: LongPromptSLO | None = None,
) -> float:
    """Requests meeting both SLOs (`long_prompt`: see `attainment`) per second, over t = 0 ..
    the last request's end."""
    if not reqs:
        return 0.0
    span = max([o.end_s or 0.0 for o in outs] + [r.arrival_s for r in reqs])
    _, _, both = attainment(outs, slo_ttft_s, slo_tpot_s, long_prompt)
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
    policy: str = "least_load",
    long_prompt: LongPromptSLO | None = None,
) -> float:
    """Highest rate in [lo, hi] whose attainment is >= target (0.0 when even `lo` fails;
    `hi` when `hi` passes); geometric bisection, `steps` simulations after the two ends.
    `policy`: the router's policy by name; `long_prompt`: see `attainment`."""

    def ok(rate: float) -> bool:
        outs = simulate(make(rate), spec, cost, policy=policy)
        return attainment(outs, slo_ttft_s, slo_tpot_s, long_prompt)[2] >= target

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


@dataclass(frozen=True)
class Alternative:
    """One configuration `plan_alternatives` compares: a cluster and the thread count whose
    costs its workers run with."""

    spec: ClusterSpec
    threads: int


def threshold_grid(reqs: Sequence[SimRequest], block_size: int = 16) -> list[int]:
    """Hybrid thresholds worth trying on `reqs`: the quartiles of their prompt lengths and the
    longest (every prompt local), rounded up to whole KV blocks (distinct, ascending; empty for
    no requests)."""
    lens = sorted(r.input_len for r in reqs)
    if not lens:
        return []
    picks = {lens[min(len(lens) - 1, (len(lens) * q) // 4)] for q in (1, 2, 3, 4)}
    return sorted({-(-n // block_size) * block_size for n in picks})


def alternatives(
    base: ClusterSpec,
    workers: int,
    threads: int,
    colocated_workers: int,
    chunk_options: Sequence[int],
    context: int,
    hybrid_thresholds: Sequence[int] = (),
) -> list[Alternative]:
    """Colocated (`colocated_workers` workers sharing the disaggregated cluster's threads, each
    chunk budget and whole prompts), every prefill:decode split of `workers` workers of
    `threads` threads (each chunk budget), and each split in hybrid mode with each of
    `hybrid_thresholds` (each chunk budget)."""
    if workers < 2 or colocated_workers < 1:
        raise ValueError(
            f"need >= 2 workers and >= 1 colocated worker, got {workers}, {colocated_workers}"
        )
    total = workers * threads
    if total % colocated_workers:
        raise ValueError(
            f"{workers} workers x {threads} threads cannot be shared by {colocated_workers} "
            "colocated workers evenly"
        )
    co_threads = total // colocated_workers
    out = []
    for chunk in chunk_options:
        out.append(
            Alternative(
                replace(
                    base,
                    prefill=0,
                    decode=0,
                    colocated=colocated_workers,
                    chunk_tokens=chunk,
                    threads=float(co_threads),
                ),
                co_threads,
            )
        )
    whole = context + base.max_num_seqs  # the bench's budget for whole prompts
    out.append(
        Alternative(
            replace(
                base,
                prefill=0,
                decode=0,
                colocated=colocated_workers,
                chunk_tokens=whole,
                chunked=False,
                threads=float(co_threads),
            ),
            co_threads,
        )
    )
    for p, chunk in itertools.product(range(1, workers), chunk_options):
        spec = replace(
            base,
            prefill=p,
            decode=workers - p,
            colocated=0,
            chunk_tokens=chunk,
            threads=float(threads),
        )
        out.append(Alternative(spec, threads))
        for threshold in hybrid_thresholds:
            out.append(Alternative(replace(spec, hybrid_threshold=threshold), threads))
    return out


def plan_alternatives(
    reqs: Sequence[SimRequest],
    costs: Callable[[int], CostModel],
    alts: Sequence[Alternative],
    slo_ttft_s: float,
    slo_tpot_s: float,
    rate_search: Sequence[Callable[[float], list[SimRequest]]] = (),
    target: float = 0.9,
    rate_bounds: tuple[float, float] = (0.05, 50.0),
    policy: str = "least_load",
    long_prompt: LongPromptSLO | None = None,
) -> list[PlanRow]:
    """Simulate every alternative (at the workload's rate; with `rate_search`, one request
    maker per trace seed, also its max rate = predicted max goodput, the median over the
    seeds) and rank them (`rank`). `costs(threads)`: the cost model; `policy`: the router's
    policy by name; `long_prompt`: the SLOs of long prompts (see `attainment`)."""
    rows = []
    slo = (slo_ttft_s, slo_tpot_s)
    for alt in alts:
        spec, cost = alt.spec, costs(alt.threads)
        outs = simulate(reqs, spec, cost, policy=policy)
        ttft, tpot, both = attainment(outs, *slo, long_prompt)
        rate = None
        if rate_search:
            lo, hi = rate_bounds
            rate = statistics.median(
                max_rate(
                    make, spec, cost, *slo, target, lo, hi, policy=policy, long_prompt=long_prompt
                )
                for make in rate_search
            )
        good = goodput_rps(reqs, outs, *slo, long_prompt)
        rows.append(
            PlanRow(
                spec.prefill,
                spec.decode,
                spec.chunk_tokens,
                spec.max_num_seqs,
                ttft,
                tpot,
                both,
                good,
                rate,
                colocated=spec.colocated,
                chunked=spec.chunked,
                threads=alt.threads,
                hybrid_threshold=spec.hybrid_threshold,
            )
        )
    return rank(rows)


def rank(rows: Sequence[PlanRow]) -> list[PlanRow]:
    """Best first (module docstring)."""
    return sorted(
        rows,
        key=lambda r: (
            -(r.max_rate or 0.0),
            -round(r.attainment, 9),
            -r.goodput_rps,
            r.colocated,
            r.hybrid_threshold is not None,
            r.hybrid_threshold or 0,
            r.prefill,
            r.chunk_tokens,
            r.max_num_seqs,
        ),
    )


def best_by_mode(rows: Sequence[PlanRow]) -> dict[str, PlanRow]:
    """The best row (`rank`) of each mode present: colocated, disagg, hybrid."""
    best: dict[str, PlanRow] = {}
    for r in rank(rows):
        best.setdefault(r.mode, r)
    return best


def table(
    rows: Sequence[PlanRow],
    slo_ttft_ms: float,
    slo_tpot_ms: float,
    long_prompt: LongPromptSLO | None = None,
) -> str:
    """A Markdown table of `rows` (best first) for the CLI and reports."""
    searched = any(r.max_rate is not None for r in rows)
    head = (
        "| mode | ratio P:D | hybrid threshold | threads/worker | chunk | max seqs | TTFT att. | "
        "TPOT att. | both | goodput req/s |"
    )
    line = "|---|---|---|---|---|---|---|---|---|---|"
    if searched:
        head += " max rate req/s (predicted max goodput) |"
        line += "---|"
    slos = f"SLOs: TTFT {slo_ttft_ms:g} ms, TPOT {slo_tpot_ms:g} ms"
    if long_prompt is not None:
        slos += (
            f"; prompts >= {long_prompt.min_prompt_tokens} tokens: TTFT "
            f"{long_prompt.ttft_ms:g} ms, TPOT {long_prompt.tpot_ms:g} ms"
        )
    out = [slos, "", head, line]
    for r in rows:
        row = (
            f"| {r.mode} | {r.ratio} | {r.threshold_label} | {r.threads} | {r.chunk_label} | "
            f"{r.max_num_seqs} | "
            f"{r.ttft_attainment:.1%} | {r.tpot_attainment:.1%} | {r.attainment:.1%} | "
            f"{r.goodput_rps:.2f} |"
        )
        if searched:
            row += f" {r.max_rate or 0.0:.2f} |"
        out.append(row)
    return "\n".join(out)
