"""Max goodput over repeats: median and range of each configuration's answers over trace
seeds, and of the paired ratios between configurations. Pure. Orchestrator and `pdserve report`.

A repeat's answer (`sweep.MaxGoodput`) is a value known within bounds (`Bounded.of`): exactly
`rate` when a failing rate above brackets it; at least `rate` when nothing above it failed;
below `first_fail` when no tested rate passed. A ratio of two such values is bounded as well
(`Bounded.over`). Over repeats (`Spread`): the median's bounds are the median of the lower and
the median of the upper bounds (each an order statistic, so the exact median lies between
them); the range runs from the smallest lower bound to the largest upper bound.

The headline ratio pairs repeats by trace seed (`ratio_spread`): repeat k's disagg over repeat
k's colocated, two searches run side by side on the same arrivals, then the median and range
of those per-seed ratios: `disagg/colocated = 2.00x (1.59-2.52x over 3 repeats)`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tooling.goodput.sweep import MaxGoodput

Fmt = Callable[[float], str]


def rate_fmt(x: float) -> str:
    return f"{x:.3g}"


def ratio_fmt(x: float) -> str:
    return f"{x:.2f}x"


@dataclass(frozen=True)
class Bounded:
    """A value known to lie in [lo, hi]; `hi` is math.inf when unbounded above."""

    lo: float
    hi: float

    def __post_init__(self) -> None:
        assert 0 <= self.lo <= self.hi, (self.lo, self.hi)

    @classmethod
    def of(cls, mg: MaxGoodput) -> Bounded:
        """One search's answer as bounds (module docstring); unknown when nothing was tested."""
        if mg.rate > 0:
            return cls(mg.rate, math.inf if mg.lower_bound else mg.rate)
        return cls(0.0, math.inf if mg.first_fail is None else mg.first_fail)

    def over(self, other: Bounded) -> Bounded:
        """self / other, as bounds."""
        lo = 0.0 if math.isinf(other.hi) else self.lo / other.hi
        hi = math.inf if other.lo == 0 or math.isinf(self.hi) else self.hi / other.lo
        return Bounded(lo, max(lo, hi))

    @property
    def exact(self) -> bool:
        return self.lo == self.hi

    def text(self, fmt: Fmt = rate_fmt) -> str:
        """'2.00x', '>= 2.00x', '< 0.5', 'between 1.00x and 2.00x', or 'unknown'."""
        if self.exact:
            return fmt(self.lo)
        if math.isinf(self.hi):
            return f">= {fmt(self.lo)}" if self.lo > 0 else "unknown"
        if self.lo == 0:
            return f"< {fmt(self.hi)}"
        return f"between {fmt(self.lo)} and {fmt(self.hi)}"

    def to_json(self) -> dict[str, float | None]:
        return {"lo": self.lo, "hi": None if math.isinf(self.hi) else self.hi}


@dataclass(frozen=True)
class Spread:
    """One quantity over repeats: each repeat's bounds, their median and their range."""

    values: tuple[Bounded, ...]

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError("a spread needs at least one repeat")

    @property
    def median(self) -> Bounded:
        lo = float(statistics.median(v.lo for v in self.values))
        hi = float(statistics.median(v.hi for v in self.values))
        return Bounded(lo, max(lo, hi))

    @property
    def low(self) -> float:
        return min(v.lo for v in self.values)

    @property
    def high(self) -> float:
        return max(v.hi for v in self.values)

    def range_text(self, fmt: Fmt = rate_fmt) -> str:
        """'1.59x-2.52x' when every repeat is exact, else each repeat's value: '>= 2.38x,
        2.52x, unknown'."""
        if all(v.exact for v in self.values):
            return f"{fmt(self.low)}-{fmt(self.high)}"
        return ", ".join(v.text(fmt) for v in self.values)

    def text(self, fmt: Fmt = rate_fmt, unit: str = "", equals: bool = True) -> str:
        """The median (with `unit`) and, over several repeats, the range: '= 2.00x (1.59x-2.52x
        over 3 repeats)', or each repeat's value when some are bounds: '>= 2.38x (repeats:
        >= 2.38x, 2.52x, unknown)'. A bound leads with its relation ('>= ', '< ', 'between'),
        an exact median with '= ' unless not `equals`."""
        med = self.median.text(fmt) + unit
        med = f"= {med}" if self.median.exact and equals else med
        n = len(self.values)
        if n == 1:
            return f"{med} (1 repeat)"
        if all(v.exact for v in self.values):
            return f"{med} ({self.range_text(fmt)} over {n} repeats)"
        return f"{med} (repeats: {self.range_text(fmt)})"

    def to_json(self) -> dict[str, Any]:
        return {
            "median": self.median.to_json(),
            "range": Bounded(self.low, self.high).to_json(),
            "repeats": [v.to_json() for v in self.values],
        }


def spread(answers: Sequence[MaxGoodput]) -> Spread:
    """A configuration's answers over repeats."""
    return Spread(tuple(Bounded.of(m) for m in answers))


def ratio_spread(top: Sequence[MaxGoodput], base: Sequence[MaxGoodput]) -> Spread:
    """top / base per repeat (paired by position: the same trace seed), over repeats."""
    if len(top) != len(base):
        raise ValueError(f"ratio of {len(top)} repeats over {len(base)}: pair them by seed")
    return Spread(tuple(Bounded.of(t).over(Bounded.of(b)) for t, b in zip(top, base, strict=True)))
