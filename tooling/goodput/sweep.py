"""Max goodput from tested rates, and the rate search that picks the rates. Pure.

Runs in the orchestrator and in `pdserve report`. The one place that decides a configuration's
max goodput for `pdserve bench`, `pdserve demo`, `pdserve report`, `benchmarks/bench_modes.py`
and `benchmarks/bench_llamacpp.py`; `repeats` aggregates the answers over trace seeds.

**The answer** (`max_goodput`). A configuration's max goodput on one trace is the highest
*tested* offered rate whose attainment (both SLOs) meets the target: never a rate that was not
measured, and never the lower of two passing rates because a failure lies between them. When a
failing rate lies below a passing one (non-monotone attainment: a burst, a noisy point), the
answer stays the higher passing rate and every such failure is kept as a `Dip` that names both
points, for the report to print. `first_fail` is the lowest failing rate above the answer (its
bracket); none means the answer is a lower bound; when no rate passed, the max is below the
lowest failing one (`rate` 0).

**The grid** (`Grid`). The listed rates, extended geometrically by `step` beyond both ends: at
most `below` steps under the lowest and `above` steps over the highest (the floor and ceiling
of the search). A demo lists one start rate and a small step (a geometric walk); a matrix
lists its rates and extends by none (a fixed sweep).

**The search** (`RateSearch`), one configuration on one trace: ask `next_rate()`, measure
that rate, `record(rate, attainment)`, until `next_rate()` is None. Each call takes the first
of these that applies:

1. start at `start` (default: the lowest listed rate);
2. climb: the grid rate above the highest tested one, while that one passed or, from one
   listed rate to the next, while its attainment is at least `give_up` (a sweep through the
   listed rates goes on past a marginal failure and stops at a collapse);
3. descend: while no tested rate has passed, the grid rate below the lowest tested one;
4. neighbour below: the grid rate just under the answer, unless a rate at or above it (and
   under the answer) was tested. With step 2's failing rate above, the answer then has tested
   rates on both sides; when the one below fails, that is a dip;
5. bisect: up to `bisect_steps` midpoints between the answer and `first_fail`, while the gap
   is more than `min_gap` x `first_fail`. A midpoint is one more tested rate and the answer is
   again the highest passing one, so bisection refines the answer and cannot contradict a
   tested point.

**Repeats** (`run_repeats`): each configuration's search runs on every trace seed, repeat by
repeat; within a repeat the configurations take turns, one run each per round in an order
rotated by one each round (`run_interleaved`), so slow drift of the machine (thermal, other
load) hits every configuration alike, and the paired per-seed ratios compare runs made side
by side. With `warm_start`, repeat k + 1 of a configuration starts at repeat k's answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from tooling.goodput.analysis import DEFAULT_TARGET

_REL = 1e-9  # two rates closer than this (relative) are the same rate


@dataclass(frozen=True)
class Dip:
    """A failing rate below a passing one: attainment is not monotone in the rate there.
    `passed_rate` is the lowest passing rate above `failed_rate`."""

    failed_rate: float
    failed: float
    passed_rate: float
    passed: float

    def text(self, requests: Callable[[float], int] | None = None) -> str:
        """'0.5 req/s missed (83 %) below 0.99 req/s, which met the target (90 %)', with
        the number of requests of each point when `requests(rate)` gives them."""

        def point(rate: float, att: float) -> str:
            n = f" of {requests(rate)} requests" if requests is not None else ""
            return f"{rate:.3g} req/s ({att:.1%}{n})"

        return (
            f"{point(self.failed_rate, self.failed)} missed the target below "
            f"{point(self.passed_rate, self.passed)}, which met it"
        )


@dataclass(frozen=True)
class MaxGoodput:
    """The answer of one search (see the module docstring). `rate` = the highest passing tested
    rate (0 when none passed); `first_fail` = the lowest failing tested rate above it;
    `lower_bound` = rates were tested and none above `rate` failed; `dips` = failing rates
    below `rate`, each with the passing rate above it."""

    rate: float
    first_fail: float | None
    lower_bound: bool
    dips: tuple[Dip, ...] = ()

    @property
    def non_monotone(self) -> bool:
        return bool(self.dips)


def max_goodput(
    points: Iterable[tuple[float, float]], target: float = DEFAULT_TARGET
) -> MaxGoodput:
    """Max goodput from (rate, attainment-both) points (see the module docstring)."""
    pts = sorted(points)
    best = max((r for r, a in pts if a >= target), default=0.0)
    first_fail = min((r for r, a in pts if a < target and r > best), default=None)
    dips = []
    for rate, att in pts:
        if att < target and rate < best:
            up, up_att = next((r, a) for r, a in pts if r > rate and a >= target)
            dips.append(Dip(rate, att, up, up_att))
    return MaxGoodput(best, first_fail, bool(pts) and first_fail is None, tuple(dips))


@dataclass(frozen=True)
class Grid:
    """The rates a search may test: `rates` (listed, any order), extended by factors of `step`
    at most `below` times under the lowest and `above` times over the highest."""

    rates: tuple[float, ...]
    step: float = 2.0
    below: int = 2
    above: int = 2

    def __post_init__(self) -> None:
        if not self.rates or any(not r > 0 for r in self.rates):
            raise ValueError(f"rates must be non-empty and positive, got {self.rates}")
        if not self.step > 1:
            raise ValueError(f"grid step must be > 1, got {self.step}")
        if self.below < 0 or self.above < 0:
            raise ValueError(f"grid steps below/above must be >= 0, got {self.below}/{self.above}")

    @cached_property
    def points(self) -> tuple[float, ...]:
        """Every grid rate, ascending, rounded to 6 decimals."""
        lo, hi = min(self.rates), max(self.rates)
        ext = [lo / self.step**k for k in range(1, self.below + 1)]
        ext += [hi * self.step**k for k in range(1, self.above + 1)]
        return tuple(sorted({round(r, 6) for r in (*self.rates, *ext)}))

    def listed(self, rate: float) -> bool:
        """Whether `rate` lies within the listed rates' span (not in an extension)."""
        return min(self.rates) * (1 - _REL) <= rate <= max(self.rates) * (1 + _REL)

    def next_above(self, rate: float) -> float | None:
        """The lowest grid rate above `rate` (None above the ceiling)."""
        return next((r for r in self.points if r > rate * (1 + _REL)), None)

    def next_below(self, rate: float) -> float | None:
        """The highest grid rate below `rate` (None under the floor)."""
        return next((r for r in reversed(self.points) if r < rate * (1 - _REL)), None)

    def on_grid(self, rate: float) -> bool:
        return any(math.isclose(rate, r, rel_tol=_REL) for r in self.points)


class RateSearch:
    """One configuration's search on one trace (see the module docstring)."""

    def __init__(
        self,
        grid: Grid,
        target: float = DEFAULT_TARGET,
        bisect_steps: int = 0,
        give_up: float = 0.5,
        min_gap: float = 0.05,
        start: float | None = None,
    ) -> None:
        if not 0 < target <= 1:
            raise ValueError(f"target attainment must be in (0, 1], got {target}")
        if bisect_steps < 0:
            raise ValueError(f"bisect_steps must be >= 0, got {bisect_steps}")
        if start is not None and not start > 0:
            raise ValueError(f"start rate must be > 0, got {start}")
        self.grid = grid
        self.target = target
        self.bisect_steps = bisect_steps
        self.give_up = give_up
        self.min_gap = min_gap
        self.start = round(min(grid.rates) if start is None else start, 6)
        self.points: dict[float, float] = {}
        self.bisected = 0

    def record(self, rate: float, attained: float) -> None:
        """Store the attainment (both SLOs, in [0, 1]) measured at `rate` (idempotent: the
        same point recorded twice counts once)."""
        if rate not in self.points and not self.grid.on_grid(rate) and rate != self.start:
            self.bisected += 1
        self.points[rate] = attained

    def result(self) -> MaxGoodput:
        return max_goodput(self.points.items(), self.target)

    def next_rate(self) -> float | None:
        """The next rate to measure, or None when the search is over (module docstring)."""
        if not self.points:
            return self.start
        top = max(self.points)
        up = self.grid.next_above(top)
        if up is not None:
            att = self.points[top]
            sweeping = self.grid.listed(top) and self.grid.listed(up)
            if att >= self.target or (att >= self.give_up and sweeping):
                return up
        res = self.result()
        if res.rate == 0:
            return self.grid.next_below(min(self.points))
        below = self._missing_neighbour(res.rate)
        if below is not None:
            return below
        if res.first_fail is not None and self.bisected < self.bisect_steps:
            lo, hi = res.rate, res.first_fail
            if hi - lo > self.min_gap * hi:
                mid = round((lo + hi) / 2, 6)
                if mid not in self.points:
                    return mid
        return None

    def _missing_neighbour(self, answer: float) -> float | None:
        """The grid rate just under `answer` when no rate from it up to `answer` was tested."""
        below = self.grid.next_below(answer)
        if below is None or any(below * (1 - _REL) <= r < answer for r in self.points):
            return None
        return below

    def points_left(self) -> int:
        """About how many more runs this search takes (for time estimates only): three for a
        fresh search (the start and a tested rate on each side of the answer); else the
        failing rate above a passing top, the neighbour below and the bisection steps it
        still lacks."""
        if not self.points:
            return 3
        res = self.result()
        if res.rate == 0:
            return 2 if self.grid.next_below(min(self.points)) is not None else 0
        climbing = res.first_fail is None and self.grid.next_above(max(self.points)) is not None
        left = int(climbing) + int(self._missing_neighbour(res.rate) is not None)
        if res.first_fail is not None or climbing:
            left += self.bisect_steps - self.bisected
        return left

    def next_start(self) -> float:
        """Where a search of the same configuration on the next trace starts (`warm_start`):
        this one's answer, or its lowest tested rate when none passed."""
        res = self.result()
        if res.rate > 0:
            return res.rate
        return min(self.points) if self.points else self.start


def run_interleaved(
    searches: dict[str, RateSearch], run_point: Callable[[str, float], float]
) -> list[tuple[str, float]]:
    """Drive every search to its end, in rounds: each round runs the next rate of every search
    that has one, in an order rotated by one each round. `run_point(name, rate)` measures one
    run and returns its attainment. Returns the (name, rate) runs in the order they ran."""
    names = list(searches)
    done: list[tuple[str, float]] = []
    round_no = 0
    while True:
        shift = round_no % len(names)
        ran = False
        for name in names[shift:] + names[:shift]:
            rate = searches[name].next_rate()
            if rate is None:
                continue
            searches[name].record(rate, run_point(name, rate))
            done.append((name, rate))
            ran = True
        if not ran:
            return done
        round_no += 1


def run_repeats(
    names: Sequence[str],
    repeats: int,
    new_search: Callable[[str, int, RateSearch | None], RateSearch],
    run_point: Callable[[str, int, float], float],
    on_repeat: Callable[[int, dict[str, RateSearch]], None] | None = None,
) -> dict[str, list[RateSearch]]:
    """Every configuration's search on `repeats` traces, repeat by repeat (module docstring).
    `new_search(name, k, previous)` makes repeat k's search (`previous`: the same
    configuration's search of repeat k - 1, None for k = 0); `run_point(name, k, rate)`
    measures one run of repeat k; `on_repeat(k, searches)` is told when repeat k is over.
    Returns each configuration's searches in repeat order."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    out: dict[str, list[RateSearch]] = {n: [] for n in names}
    for k in range(repeats):
        searches = {n: new_search(n, k, out[n][-1] if out[n] else None) for n in names}

        def run(name: str, rate: float, k: int = k) -> float:
            return run_point(name, k, rate)

        run_interleaved(searches, run)
        for n, s in searches.items():
            out[n].append(s)
        if on_repeat is not None:
            on_repeat(k, searches)
    return out
