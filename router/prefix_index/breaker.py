"""Circuit breaker for the prefix index backend. Pure (clock injected), no I/O; runs in the
router process on its event loop.

States::

    CLOSED ──`failure_threshold` failures in a row──> OPEN ──`open_s` passed──> HALF_OPEN
      ^                                                 ^                          │
      └──────────────── probe succeeded ────────────────┼──────── probe failed ────┘

CLOSED lets every call through. OPEN refuses every call (the caller falls back at once, no
backend traffic). HALF_OPEN lets exactly one call through at a time — the probe — whose result
closes or re-opens the breaker. Callers pair each allowed call with one `record_success()` or
`record_failure()`.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """See the module docstring. `opened` counts CLOSED/HALF_OPEN -> OPEN transitions."""

    def __init__(
        self,
        failure_threshold: int = 3,
        open_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        name: str = "prefix-index",
    ) -> None:
        if failure_threshold < 1 or open_s <= 0:
            raise ValueError(
                f"failure_threshold must be >= 1 and open_s > 0, got {failure_threshold}, {open_s}"
            )
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.name = name
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_out = False
        self.opened = 0

    @property
    def state(self) -> BreakerState:
        """The state now (OPEN turns HALF_OPEN once `open_s` has passed)."""
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.open_s:
            self._state = BreakerState.HALF_OPEN
            self._probe_out = False
        return self._state

    def allow(self) -> bool:
        """True if a call may go to the backend now (in HALF_OPEN: only the one probe)."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN and not self._probe_out:
            self._probe_out = True
            return True
        return False

    def would_allow(self) -> bool:
        """Like `allow` but takes nothing (no probe slot): for "is it worth preparing a call"."""
        state = self.state
        return state is BreakerState.CLOSED or (
            state is BreakerState.HALF_OPEN and not self._probe_out
        )

    def record_success(self) -> None:
        """An allowed call succeeded: CLOSED, failure count reset."""
        if self._state is not BreakerState.CLOSED:
            log.info("%s circuit breaker closed (backend answers again)", self.name)
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._probe_out = False

    def record_failure(self) -> None:
        """An allowed call failed: count it; open at the threshold or when the probe failed."""
        self._failures += 1
        if self._state is BreakerState.HALF_OPEN or (
            self._state is BreakerState.CLOSED and self._failures >= self.failure_threshold
        ):
            if self._state is BreakerState.CLOSED:
                log.warning(
                    "%s circuit breaker open after %d failures: routing uses load only for %.1f s",
                    self.name,
                    self._failures,
                    self.open_s,
                )
            self._state = BreakerState.OPEN
            self._opened_at = self._clock()
            self._probe_out = False
            self.opened += 1
