"""In-memory `PrefixIndex`: the embedded default for a single router (and the contract's
reference). Runs in the router process, on its event loop; not shared between processes.

Layout::

    _workers:  worker_id -> _Entry(epoch, seq, hashes, expires_at)
    _holders:  block hash -> {worker_id, ...}      (the inverse of every entry's `hashes`)

A worker past `expires_at` is purged lazily, on the next call that touches the index, so a dead
worker's blocks vanish `ttl_s` after the last event, snapshot or refresh that named it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from model_runtime.hashing import BlockHash
from router.prefix_index.base import ApplyResult, KVEvent, KVSnapshot, PrefixMatch


@dataclass
class _Entry:
    epoch: int
    seq: int
    expires_at: float
    hashes: set[BlockHash] = field(default_factory=set)


class InMemoryPrefixIndex:
    """`PrefixIndex` in two dicts. `clock` (monotonic seconds) is injectable for tests."""

    def __init__(self, ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self._ttl_s = ttl_s
        self._clock = clock
        self._workers: dict[str, _Entry] = {}
        self._holders: dict[BlockHash, set[str]] = {}

    # -- PrefixIndex -----------------------------------------------------------------------

    async def apply(self, event: KVEvent) -> ApplyResult:
        """Apply one event (see `base` for the epoch/seq rules)."""
        entry = self._live(event.worker_id)
        if entry is None or entry.epoch != event.epoch or event.seq > entry.seq + 1:
            return ApplyResult.RESYNC
        if event.seq <= entry.seq:
            return ApplyResult.DUPLICATE
        if event.kind == "stored":
            for h in event.block_hashes:
                entry.hashes.add(h)
                self._holders.setdefault(h, set()).add(event.worker_id)
        elif event.kind == "removed":
            for h in event.block_hashes:
                if h in entry.hashes:
                    entry.hashes.discard(h)
                    self._unhold(h, event.worker_id)
        else:
            self._forget_hashes(event.worker_id, entry)
        entry.seq = event.seq
        entry.expires_at = self._clock() + self._ttl_s
        return ApplyResult.APPLIED

    async def resync(self, snapshot: KVSnapshot) -> bool:
        """Replace the worker's entries with `snapshot` unless the index is already as new."""
        entry = self._live(snapshot.worker_id)
        expires = self._clock() + self._ttl_s
        if entry is not None and entry.epoch == snapshot.epoch and entry.seq >= snapshot.seq:
            entry.expires_at = expires
            return False
        if entry is not None:
            self._forget_hashes(snapshot.worker_id, entry)
        new = _Entry(snapshot.epoch, snapshot.seq, expires, set(snapshot.block_hashes))
        self._workers[snapshot.worker_id] = new
        for h in new.hashes:
            self._holders.setdefault(h, set()).add(snapshot.worker_id)
        return True

    async def refresh(self, worker_id: str, epoch: int) -> bool:
        """Restart the worker's TTL if it is held at `epoch`."""
        entry = self._live(worker_id)
        if entry is None or entry.epoch != epoch:
            return False
        entry.expires_at = self._clock() + self._ttl_s
        return True

    async def match(self, block_hashes: Sequence[BlockHash]) -> list[PrefixMatch]:
        """Leading blocks of `block_hashes` held by each live worker (zero-block ones left out)."""
        counts: dict[str, int] = {}
        active: set[str] | None = None
        for i, h in enumerate(block_hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            # list(): `_live` may purge an expired worker, which edits `holders`
            now_active = {w for w in list(holders) if self._live(w) is not None}
            if active is not None:
                now_active &= active
            if not now_active:
                break
            for w in now_active:
                counts[w] = i + 1
            active = now_active
        return [PrefixMatch(w, self._workers[w].epoch, n) for w, n in sorted(counts.items())]

    async def state(self, worker_id: str) -> tuple[int, int] | None:
        """(epoch, last seq) of a live worker, or None."""
        entry = self._live(worker_id)
        return None if entry is None else (entry.epoch, entry.seq)

    async def drop_worker(self, worker_id: str) -> bool:
        """Forget `worker_id` now; True if it was known (and live)."""
        entry = self._live(worker_id)
        if entry is None:
            return False
        self._forget_hashes(worker_id, entry)
        del self._workers[worker_id]
        return True

    async def close(self) -> None:
        """Drop everything (nothing to release)."""
        self._workers.clear()
        self._holders.clear()

    def hashes_of(self, worker_id: str) -> frozenset[BlockHash]:
        """Every hash held for a live worker (empty if unknown): for tests and debugging."""
        entry = self._live(worker_id)
        return frozenset() if entry is None else frozenset(entry.hashes)

    # -- internals -------------------------------------------------------------------------

    def _live(self, worker_id: str) -> _Entry | None:
        """The worker's entry, purging it first if its TTL passed."""
        entry = self._workers.get(worker_id)
        if entry is not None and entry.expires_at <= self._clock():
            self._forget_hashes(worker_id, entry)
            del self._workers[worker_id]
            return None
        return entry

    def _forget_hashes(self, worker_id: str, entry: _Entry) -> None:
        for h in entry.hashes:
            self._unhold(h, worker_id)
        entry.hashes = set()

    def _unhold(self, block_hash: BlockHash, worker_id: str) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[block_hash]

    def check_integrity(self) -> None:
        """Assert that `_holders` is exactly the inverse of the entries' hash sets."""
        inverse: dict[BlockHash, set[str]] = {}
        for w, entry in self._workers.items():
            for h in entry.hashes:
                inverse.setdefault(h, set()).add(w)
        assert inverse == self._holders, (
            f"holders map out of sync: {len(inverse)} hashes from entries vs "
            f"{len(self._holders)} in the map"
        )
