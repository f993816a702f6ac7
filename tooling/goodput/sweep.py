"""Rate search for max goodput: a sweep over given rates, refined by bisection. Pure.

Runs in the orchestrator. `RateSearch` is a small state machine for one configuration: ask
`next_rate()`, measure the attainment at that rate, `record(rate, attainment)`, repeat until
`next_rate()` is None. The plan:

1. **sweep** the given rates from low to high; a rate whose attainment falls below `give_up`
   (default 0.5) ends the sweep early (higher rates would only be slower failures);
2. **bisect** between the highest passing rate `lo` and the lowest failing rate `hi` (see
   `analysis.max_goodput`): the next rate is `(lo + hi) / 2`, or `hi / 2` when nothing passed;
   when every rate passed, the next is twice the highest (the sweep was too low);
3. stop after `bisect_steps` such rates, once `hi - lo <= min_gap * hi`, or when the next
   rate would fall below `min_rate` (default: a quarter of the lowest sweep rate; runs at
   very low rates take long and say little).

`run_interleaved` drives several searches in rounds: each round runs the next rate of every
configuration that has one, in an order rotated by one each round, so slow drift of the
machine (thermal, other load) hits every configuration alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tooling.goodput.analysis import DEFAULT_TARGET, MaxGoodput, max_goodput


class RateSearch:
    """Sweep-then-bisect search of one configuration's max goodput (see module docstring)."""

    def __init__(
        self,
        rates: Sequence[float],
        target: float = DEFAULT_TARGET,
        bisect_steps: int = 3,
        min_gap: float = 0.05,
        give_up: float = 0.5,
        min_rate: float | None = None,
    ) -> None:
        if not rates or any(r <= 0 for r in rates):
            raise ValueError(f"rates must be a non-empty list of positive numbers, got {rates}")
        if not 0 < target <= 1:
            raise ValueError(f"target attainment must be in (0, 1], got {target}")
        if bisect_steps < 0:
            raise ValueError(f"bisect_steps must be >= 0, got {bisect_steps}")
        self.sweep = sorted(set(rates))
        self.target = target
        self.bisect_steps = bisect_steps
        self.min_gap = min_gap
        self.give_up = give_up
        self.min_rate = self.sweep[0] / 4 if min_rate is None else min_rate
        self.points: dict[float, float] = {}
        self.bisected = 0
        self._sweep_over = False

    def record(self, rate: float, attained: float) -> None:
        """Store the attainment (both SLOs, in [0, 1]) measured at `rate`."""
        if rate in self.sweep and not self._sweep_over:
            if attained < self.give_up:
                self._sweep_over = True
        elif rate not in self.sweep:
            self.bisected += 1
        self.points[rate] = attained

    def result(self) -> MaxGoodput:
        return max_goodput(self.points.items(), self.target)

    def next_rate(self) -> float | None:
        """The next rate to measure, or None when the search is over."""
        if not self._sweep_over:
            todo = [r for r in self.sweep if r not in self.points]
            if todo:
                return todo[0]
            self._sweep_over = True
        if self.bisected >= self.bisect_steps:
            return None
        res = self.result()
        if res.first_fail is None:
            return 2 * max(self.points)
        lo, hi = res.rate, res.first_fail
        if hi - lo <= self.min_gap * hi:
            return None
        mid = round((lo + hi) / 2 if lo > 0 else hi / 2, 6)
        return mid if mid not in self.points and mid >= self.min_rate else None


def run_interleaved(
    searches: dict[str, RateSearch],
    run_point: Callable[[str, float, int], float],
) -> list[tuple[str, float, int]]:
    """Drive every search to its end. `run_point(config, rate, k)` measures one run (k = how
    many runs this configuration had before, which callers use to pick a fresh token seed)
    and returns its attainment. Returns the (config, rate, k) runs in the order they ran."""
    names = list(searches)
    done: list[tuple[str, float, int]] = []
    counts = dict.fromkeys(names, 0)
    round_no = 0
    while True:
        shift = round_no % len(names)
        order = names[shift:] + names[:shift]
        ran = False
        for name in order:
            rate = searches[name].next_rate()
            if rate is None:
                continue
            k = counts[name]
            searches[name].record(rate, run_point(name, rate, k))
            counts[name] += 1
            done.append((name, rate, k))
            ran = True
        if not ran:
            return done
        round_no += 1
