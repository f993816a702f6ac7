"""Arrival processes of the load generator: Poisson and gamma-bursty, seeded. Pure numpy.

Both draw independent inter-arrival gaps with mean `1 / rate` seconds; the first request
arrives at t = 0. Poisson = exponential gaps (coefficient of variation 1). Gamma gaps have
shape `k = 1 / cv**2` and scale `1 / (rate * k)`: the same mean, and `cv > 1` makes bursts
(many short gaps, a few long ones), `cv < 1` makes arrivals more regular. The same
(kind, n, rate, cv, seed) always gives the same times.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

ArrivalKind = Literal["poisson", "gamma"]
ARRIVAL_KINDS: tuple[ArrivalKind, ...] = ("poisson", "gamma")


def inter_arrival_gaps(
    n: int, rate: float, kind: ArrivalKind = "poisson", cv: float = 1.0, seed: int = 0
) -> np.ndarray:
    """`n` gaps in seconds (float64) with mean `1 / rate`. ValueError names a bad argument."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if not cv > 0:
        raise ValueError(f"cv (burstiness) must be > 0, got {cv}")
    rng = np.random.default_rng(seed)
    if kind == "poisson":
        return rng.exponential(1.0 / rate, size=n)
    if kind == "gamma":
        shape = 1.0 / cv**2
        return rng.gamma(shape, 1.0 / (rate * shape), size=n)
    raise ValueError(f"arrival kind must be one of {ARRIVAL_KINDS}, got {kind!r}")


def arrival_times(
    n: int, rate: float, kind: ArrivalKind = "poisson", cv: float = 1.0, seed: int = 0
) -> list[float]:
    """Send times (seconds after the run starts) of `n` requests: 0, then cumulative gaps."""
    if n == 0:
        return []
    gaps = inter_arrival_gaps(n - 1, rate, kind, cv, seed)
    return [0.0, *np.cumsum(gaps).tolist()]


def empirical_rate(times: list[float]) -> float:
    """Requests per second of an arrival sequence: (n - 1) / span (0 for fewer than two)."""
    if len(times) < 2 or times[-1] <= times[0]:
        return 0.0
    return (len(times) - 1) / (times[-1] - times[0])
