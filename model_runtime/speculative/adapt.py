"""Each request's proposal length k, adapted to its recent acceptance. Pure: no torch, no I/O.
Runs in the engine thread (`speculator.Speculator` keeps one `AdaptiveK` per request).

Why: every proposal is one more row of the step that verifies it. A request whose proposals are
accepted should propose as many as it may; one whose proposals are all rejected should stop
paying for rows that never turn into tokens, yet look again now and then, since text changes
character (a summary starts quoting). The rule, after each verified step (m proposed,
a accepted):

- a == m == k (all accepted): k grows by one, up to `k_max`;
- 0 < a < m: k shrinks to a + 1 (what this request's guesses last held, plus one);
- a == 0: k halves; the second such step in a row stops proposing (k = 0) for `idle` steps,
  `idle` doubling after each probe that fails again (from `FIRST_IDLE` up to `MAX_IDLE`); then
  one probe with k = 1. Any accepted token resets `idle` to `FIRST_IDLE`.

A request that never accepts anything thus pays, in the long run, one extra row every
`MAX_IDLE` steps (plus the proposer's own lookup). Steps that proposed nothing (an n-gram
proposer with no match) change nothing but the idle count.
"""

from __future__ import annotations

from dataclasses import dataclass

FIRST_IDLE = 4
MAX_IDLE = 64


@dataclass
class AdaptiveK:
    """One request's proposal length (module docstring)."""

    k_max: int
    k: int = -1  # -1: start at k_max
    misses: int = 0  # steps in a row that accepted nothing
    idle: int = 0  # steps left without proposals (k == 0)
    next_idle: int = FIRST_IDLE

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")
        if self.k < 0:
            self.k = self.k_max

    def observe(self, proposed: int, accepted: int) -> None:
        """One decode step of the request: `proposed` tokens verified, `accepted` kept."""
        assert 0 <= accepted <= proposed <= self.k_max, (accepted, proposed, self.k_max)
        if proposed == 0:
            if self.k == 0:
                self.idle -= 1
                if self.idle <= 0:
                    self.k = 1  # probe
            return
        if accepted == 0:
            self.misses += 1
            if self.misses >= 2:
                self.k, self.idle = 0, self.next_idle
                self.next_idle = min(2 * self.next_idle, MAX_IDLE)
            else:
                self.k = max(1, self.k // 2)
            return
        self.misses = 0
        self.next_idle = FIRST_IDLE
        if accepted == proposed == self.k:
            self.k = min(self.k_max, self.k + 1)
        elif accepted < proposed:
            self.k = max(1, min(self.k, accepted + 1))
