"""The goodput demo's search on simulated attainment curves: its time and its headline's spread.

    python -m benchmarks.demo_search_sim [--trials 150] [--seed 3]

Runs in its own process; pure (no cluster). For each case (b = the prefill-bound rate, each
configuration's true max goodput c as a fraction of b), it drives the real search
(`tooling.goodput.sweep.run_repeats` with `DEMO`'s grid, repeats and warm starts) against the
attainment curve 1 - 0.1 (r / c)^4 (90 % at r = c), each run drawing `DEMO`'s requests as
Bernoulli trials; optionally colocated's curve is capped at a plateau (`--plateau`) from 0.35 b
up, as issue 42's quiet AMD EPYC run showed. A run costs requests / min(r, 1.4 c) seconds
plus `--overhead`; a demo adds `--fixed` seconds (start-up, chat, calibration). Between demo
runs b varies by 8 % (calibration noise). Prints per case the median (p90) time, the median
number of runs, and of consecutive triples of demo runs how many have medians of
disagg/colocated within 25 % of a centre (max / min <= 1.25 / 0.75) and of each other
(max / min <= 1.25). An estimate of the budget, not a measurement (docs/performance.md).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from collections.abc import Callable, Sequence

from tooling.goodput.demo import DEMO
from tooling.goodput.repeats import Bounded, ratio_spread
from tooling.goodput.sweep import Grid, RateSearch, run_repeats

# (b, colocated c / b, disagg c / b, colocated plateau attainment or None)
CASES: tuple[tuple[float, float, float, float | None], ...] = (
    (2.0, 0.4, 1.0, None),
    (2.5, 0.4, 1.0, None),
    (2.0, 0.5, 1.2, None),
    (2.0, 0.2, 1.6, None),
    (1.74, 0.3, 1.8, None),
    (1.26, 0.8, 0.8, None),
    (1.74, 1.0, 1.8, 0.86),
)


def curve(c: float, plateau: tuple[float, float] | None) -> Callable[[float], float]:
    """Attainment at rate r: 1 - 0.1 (r / c)^4, capped at plateau[1] from plateau[0] up."""

    def att(r: float) -> float:
        p = max(0.0, 1 - 0.1 * (r / c) ** 4)
        return min(p, plateau[1]) if plateau is not None and r >= plateau[0] else p

    return att


def one_demo(
    b: float,
    caps: dict[str, float],
    plateau: tuple[float, float] | None,
    rng: random.Random,
    overhead: float,
    fixed: float,
) -> tuple[float, int, Bounded]:
    """(seconds, runs, median disagg/colocated) of one simulated demo."""
    grid = Grid((DEMO["rel_rates"][0] * b,), DEMO["grid_step"], DEMO["grid_below"],
                DEMO["grid_above"])  # fmt: skip
    seconds = fixed

    def new_search(name: str, k: int, previous: RateSearch | None) -> RateSearch:
        start = previous.next_start() if previous is not None else None
        return RateSearch(grid, 0.9, DEMO["bisect_steps"], start=start)

    def run_point(name: str, k: int, rate: float) -> float:
        nonlocal seconds
        n = max(int(DEMO["min_requests"]), math.ceil(rate * float(DEMO["duration_s"])))
        seconds += n / min(rate, 1.4 * caps[name]) + overhead
        p = curve(caps[name], plateau if name == "colocated" else None)(rate)
        return sum(rng.random() < p for _ in range(n)) / n

    out = run_repeats(list(caps), DEMO["repeats"], new_search, run_point)
    runs = sum(len(s.points) for searches in out.values() for s in searches)
    answers = {name: [s.result() for s in searches] for name, searches in out.items()}
    return seconds, runs, ratio_spread(answers["disagg"], answers["colocated"]).median


def within(medians: Sequence[float], ratio: float) -> bool:
    return min(medians) > 0 and max(medians) / min(medians) <= ratio + 1e-9


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=150, help="simulated demo runs per case")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--overhead", type=float, default=3.0, help="seconds per run beyond arrivals")
    p.add_argument("--fixed", type=float, default=80.0, help="seconds of start-up per demo")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    print("| b (req/s) | colocated c | disagg c | runs | time, median (p90) | "
          "3 runs in a row: medians within +-25 % of a centre / of each other |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for b, col, dis, plateau_att in CASES:
        plateau = None if plateau_att is None else (0.35 * b, plateau_att)
        times, runs, medians = [], [], []
        for _ in range(args.trials):
            bb = b * math.exp(rng.gauss(0, 0.08))
            t, n, m = one_demo(bb, {"colocated": col * b, "disagg": dis * b}, plateau, rng,
                               args.overhead, args.fixed)  # fmt: skip
            times.append(t)
            runs.append(n)
            medians.append(m.lo)
        triples = [medians[i : i + 3] for i in range(0, len(medians) - 2, 3)]
        centre = sum(within(t, 1.25 / 0.75) for t in triples)
        each = sum(within(t, 1.25) for t in triples)
        p90 = sorted(times)[int(0.9 * len(times))]
        col_text = f"plateau at {plateau_att:.0%} from 0.35 b" if plateau_att else f"{col:g} b"
        print(f"| {b:g} | {col_text} | {dis:g} b | {statistics.median(runs):.0f} | "
              f"{statistics.median(times):.0f} s ({p90:.0f}) | {centre} / {each} of "
              f"{len(triples)} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
