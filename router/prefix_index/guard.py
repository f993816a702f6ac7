"""Timeouts, circuit breaker and counters around a `PrefixIndex`: Redis is a hint, not a
dependency. Runs in the router process, on its event loop.

- request path: `lookup(hashes)` never raises for a backend problem; it answers None (meaning
  "unknown: route by load only") when the breaker is open, or when the call failed or took
  longer than `lookup_timeout_s`;
- indexer path: `apply` / `resync` / `refresh` are bounded by `write_timeout_s` and raise
  `IndexUnavailable` on failure, timeout or an open breaker (the indexer then resyncs later);
- one breaker for both paths: they share the backend's health.

Every outcome is counted in `PrefixIndexStats` (exposed on the router handle and logged when
the breaker changes state).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from model_runtime.hashing import BlockHash, block_hash_chain
from router.prefix_index.base import (
    ApplyResult,
    IndexUnavailable,
    KVEvent,
    KVSnapshot,
    PrefixIndex,
    PrefixMatch,
)
from router.prefix_index.breaker import CircuitBreaker

log = logging.getLogger(__name__)

T = TypeVar("T")

_LATENCY_WINDOW = 10_000

LookupObserver = Callable[[str, float | None, int], None]
"""(outcome, latency_s of an answered lookup, prompt tokens the best match covers)."""


@dataclass
class PrefixIndexStats:
    """Counters of one router's use of its prefix index (monotonic, since start)."""

    lookups: int = 0
    lookup_hits: int = 0  # lookups that found at least one worker holding block 0
    lookup_errors: int = 0
    lookup_timeouts: int = 0
    lookup_skipped: int = 0  # breaker open: no backend call, load-only routing
    writes: int = 0
    write_errors: int = 0
    events_applied: int = 0
    events_duplicate: int = 0
    resyncs: int = 0
    lookup_latency_ms: list[float] = field(default_factory=list)  # last successful lookups

    def record_latency(self, ms: float) -> None:
        """Keep the latest `_LATENCY_WINDOW` successful lookup latencies."""
        self.lookup_latency_ms.append(ms)
        if len(self.lookup_latency_ms) > 2 * _LATENCY_WINDOW:
            del self.lookup_latency_ms[:-_LATENCY_WINDOW]


@dataclass(frozen=True)
class PromptPrefix:
    """A prompt's reusable-block hash chain and the index's matches for it (None: unknown)."""

    block_hashes: tuple[BlockHash, ...] = ()
    matches: tuple[PrefixMatch, ...] | None = None


def reusable_chain(prompt_token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Hashes of the blocks a worker can reuse: every full block except one holding the last
    prompt token (which must run to produce logits; the scheduler's rule)."""
    reusable = (len(prompt_token_ids) - 1) // block_size
    return block_hash_chain(prompt_token_ids[: reusable * block_size], block_size)


class GuardedPrefixIndex:
    """Wraps `index` with the timeouts and the breaker; owns it (`close` closes it)."""

    def __init__(
        self,
        index: PrefixIndex,
        breaker: CircuitBreaker | None = None,
        lookup_timeout_s: float = 0.05,
        write_timeout_s: float = 0.5,
    ) -> None:
        self.index = index
        self.breaker = breaker or CircuitBreaker()
        self.lookup_timeout_s = lookup_timeout_s
        self.write_timeout_s = write_timeout_s
        self.stats = PrefixIndexStats()
        self.observer: LookupObserver | None = None
        """Told about each `lookup_prompt` (the router's metrics); must be cheap, not raise."""

    @property
    def available(self) -> bool:
        """False while the breaker refuses calls (worth checking before an expensive snapshot)."""
        return self.breaker.would_allow()

    async def lookup(self, block_hashes: Sequence[BlockHash]) -> list[PrefixMatch] | None:
        """`match` for the request path: the matches, or None when the index cannot answer
        quickly (breaker open, failure, timeout). Never raises for backend problems."""
        matches, _, _ = await self._lookup(block_hashes)
        return matches

    async def _lookup(
        self, block_hashes: Sequence[BlockHash]
    ) -> tuple[list[PrefixMatch] | None, str, float | None]:
        """(`lookup`'s answer, outcome, latency in seconds of an answered lookup); outcome is
        'hit', 'miss', 'skipped' (breaker open), 'timeout' or 'error'."""
        self.stats.lookups += 1
        if not self.breaker.allow():
            self.stats.lookup_skipped += 1
            return None, "skipped", None
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.lookup_timeout_s):
                matches = await self.index.match(block_hashes)
        except TimeoutError:
            self.stats.lookup_timeouts += 1
            self.breaker.record_failure()
            return None, "timeout", None
        except IndexUnavailable as exc:
            self.stats.lookup_errors += 1
            self.breaker.record_failure()
            log.debug("prefix lookup failed: %s", exc)
            return None, "error", None
        self.breaker.record_success()
        latency = time.perf_counter() - t0
        self.stats.record_latency(latency * 1e3)
        if matches:
            self.stats.lookup_hits += 1
        return matches, "hit" if matches else "miss", latency

    async def lookup_prompt(self, prompt_token_ids: Sequence[int], block_size: int) -> PromptPrefix:
        """Hash the prompt's reusable blocks and `lookup` them (a prompt without a reusable
        block needs no lookup: known to match nothing). Tells `observer` (if set) the outcome,
        the latency and the prompt tokens the best match covers."""
        hashes = tuple(reusable_chain(prompt_token_ids, block_size))
        if not hashes:
            return PromptPrefix((), ())
        matches, outcome, latency = await self._lookup(hashes)
        if self.observer is not None:
            best = max((m.num_blocks for m in matches or ()), default=0)
            self.observer(outcome, latency, best * block_size)
        return PromptPrefix(hashes, None if matches is None else tuple(matches))

    async def apply(self, event: KVEvent) -> ApplyResult:
        """`index.apply` bounded by `write_timeout_s`; IndexUnavailable on any failure."""
        result = await self._write(lambda: self.index.apply(event))
        if result is ApplyResult.APPLIED:
            self.stats.events_applied += 1
        elif result is ApplyResult.DUPLICATE:
            self.stats.events_duplicate += 1
        return result

    async def resync(self, snapshot: KVSnapshot) -> bool:
        """`index.resync`, bounded; IndexUnavailable on any failure."""
        self.stats.resyncs += 1
        return await self._write(lambda: self.index.resync(snapshot))

    async def refresh(self, worker_id: str, epoch: int) -> bool:
        """`index.refresh`, bounded; IndexUnavailable on any failure."""
        return await self._write(lambda: self.index.refresh(worker_id, epoch))

    async def close(self) -> None:
        """Close the wrapped index."""
        await self.index.close()

    async def _write(self, call: Callable[[], Awaitable[T]]) -> T:
        if not self.breaker.allow():
            raise IndexUnavailable("prefix index circuit breaker is open")
        self.stats.writes += 1
        try:
            async with asyncio.timeout(self.write_timeout_s):
                result = await call()
        except TimeoutError as exc:
            self.stats.write_errors += 1
            self.breaker.record_failure()
            raise IndexUnavailable(
                f"prefix index write took over {self.write_timeout_s} s"
            ) from exc
        except IndexUnavailable:
            self.stats.write_errors += 1
            self.breaker.record_failure()
            raise
        self.breaker.record_success()
        return result
