"""Circuit breaker (`router.prefix_index.breaker`) and the guarded index's fallbacks
(`router.prefix_index.guard`): pure, fake clock, in-memory index with injected faults."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from model_runtime.hashing import BlockHash, block_hash_chain
from router.prefix_index.base import IndexUnavailable, KVSnapshot, PrefixMatch
from router.prefix_index.breaker import BreakerState, CircuitBreaker
from router.prefix_index.guard import GuardedPrefixIndex, reusable_chain
from router.prefix_index.memory import InMemoryPrefixIndex


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# (case, steps, expected state after each step). Steps: "ok", "fail", "allow", "deny", "+N"
# (advance the clock N seconds). threshold 2, open 1 s.
SCRIPTS = [
    ("one failure stays closed", ["fail", "allow", "ok"], ["closed", "closed", "closed"]),
    ("success resets the count", ["fail", "ok", "fail"], ["closed", "closed", "closed"]),
    ("threshold opens", ["fail", "fail", "deny"], ["closed", "open", "open"]),
    (
        "half-open after open_s lets one probe",
        ["fail", "fail", "+1", "allow", "deny", "ok", "allow"],
        ["closed", "open", "half_open", "half_open", "half_open", "closed", "closed"],
    ),
    (
        "failed probe re-opens",
        ["fail", "fail", "+1.5", "allow", "fail", "deny", "+0.5", "deny", "+0.5", "allow"],
        [
            "closed",
            "open",
            "half_open",
            "half_open",
            "open",
            "open",
            "open",
            "open",
            "half_open",
            "half_open",
        ],
    ),
]


@pytest.mark.parametrize("case,steps,states", SCRIPTS, ids=[s[0] for s in SCRIPTS])
def test_breaker_script(case: str, steps: list[str], states: list[str]) -> None:
    clock = Clock()
    b = CircuitBreaker(failure_threshold=2, open_s=1.0, clock=clock)
    for i, (step, want) in enumerate(zip(steps, states, strict=True)):
        if step == "ok":
            b.record_success()
        elif step == "fail":
            b.record_failure()
        elif step == "allow":
            assert b.allow(), f"{case}: step {i} should be allowed"
        elif step == "deny":
            assert not b.allow(), f"{case}: step {i} should be refused"
        else:
            clock.t += float(step)
        assert b.state is BreakerState(want), f"{case}: after step {i} ({step})"


def test_breaker_counts_openings_and_validates() -> None:
    b = CircuitBreaker(failure_threshold=1, open_s=1.0, clock=Clock())
    b.record_failure()
    assert b.opened == 1 and not b.would_allow()
    with pytest.raises(ValueError, match="failure_threshold"):
        CircuitBreaker(failure_threshold=0)


class FaultyIndex(InMemoryPrefixIndex):
    """In-memory index whose `match` can fail or stall like a sick backend."""

    mode = "ok"

    async def match(self, block_hashes: Sequence[BlockHash]) -> list[PrefixMatch]:
        if self.mode == "fail":
            raise IndexUnavailable("connection refused")
        if self.mode == "slow":
            await asyncio.sleep(1.0)
        return await super().match(block_hashes)


def test_guard_falls_back_and_recovers() -> None:
    async def go() -> None:
        clock = Clock()
        index = FaultyIndex()
        guard = GuardedPrefixIndex(
            index, CircuitBreaker(2, 1.0, clock=clock), lookup_timeout_s=0.01
        )
        chain = block_hash_chain(list(range(32)), 4)
        await index.resync(KVSnapshot("w", 1, 0, tuple(chain)))
        assert await guard.lookup(chain) == [PrefixMatch("w", 1, 8)]
        index.mode = "fail"
        assert await guard.lookup(chain) is None
        index.mode = "slow"
        assert await guard.lookup(chain) is None  # timed out: the breaker opens
        assert guard.breaker.state is BreakerState.OPEN and not guard.available
        index.mode = "ok"
        assert await guard.lookup(chain) is None  # skipped: no backend call while open
        with pytest.raises(IndexUnavailable, match="breaker"):
            await guard.refresh("w", 1)
        clock.t += 1.0
        assert await guard.lookup(chain) == [PrefixMatch("w", 1, 8)]  # the probe closes it
        s = guard.stats
        assert (s.lookups, s.lookup_hits, s.lookup_errors, s.lookup_timeouts) == (5, 2, 1, 1)
        assert s.lookup_skipped == 1 and len(s.lookup_latency_ms) == 2

    asyncio.run(go())


@pytest.mark.parametrize(
    "n_tokens,block_size,n_hashes",
    [(0, 4, 0), (1, 4, 0), (4, 4, 0), (5, 4, 1), (8, 4, 1), (9, 4, 2), (577, 16, 36)],
)
def test_reusable_chain_leaves_the_last_token_block(
    n_tokens: int, block_size: int, n_hashes: int
) -> None:
    tokens = list(range(n_tokens))
    chain = reusable_chain(tokens, block_size)
    assert len(chain) == n_hashes
    assert chain == block_hash_chain(tokens, block_size)[:n_hashes]
