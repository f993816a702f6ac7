"""Prefix-index seam: which workers hold which KV blocks, keyed by the block-hash chain.

Runs in the router process, on its event loop. The index is a *hint*: routing reads it to send a
request where its prompt prefix is already cached, but a wrong or missing answer only costs a
cache miss, never a failed request. Writers are the router's `Indexer` tasks, one per prefill
(or colocated) worker, which feed it the worker's KV cache events; with several router replicas
sharing one Redis, every replica writes the same events, so `apply` must be idempotent.

Vocabulary:

- a worker's *epoch* changes on every process start; a worker's events carry a *seq* that is 1
  for the first event of an epoch and grows by exactly 1 per event;
- a *snapshot* is a worker's whole set of cached hashes at one seq (0 = no event yet);
- entries of a worker expire `ttl_s` after its last `apply` / `resync` / `refresh`, so the
  blocks of a dead worker vanish even when nobody tells the index it died.

Contract of every implementation (tests/integration/test_prefix_index_contract.py runs it
against each one):

- `apply(event)`: worker unknown or `event.epoch` differs from the stored one -> RESYNC;
  `event.seq` <= last applied seq -> DUPLICATE; `event.seq` > last + 1 (a gap) -> RESYNC; in
  those cases nothing changes. Otherwise APPLIED: `stored` adds the hashes, `removed` drops them
  (unknown ones are ignored), `cleared` drops every hash of the worker; last seq = `event.seq`;
  the worker's TTL restarts.
- `resync(snapshot)`: replaces everything the index holds for the worker with the snapshot
  (epoch, seq, hashes) and restarts its TTL, unless the index already holds the *same* epoch at a
  seq >= the snapshot's (another replica got there first): then it only restarts the TTL and
  answers False.
- `refresh(worker_id, epoch)`: restarts the TTL if the index holds the worker at `epoch`; False
  (nothing changed) otherwise — the caller then resyncs.
- `match(block_hashes)`: one round trip; for each live worker holding `block_hashes[0]`, how many
  *leading* hashes of the chain it holds (a worker holding blocks 0, 1 and 3 counts 2). Workers
  with zero leading blocks are left out; results are sorted by worker id.
- `state(worker_id)`: (epoch, last seq) of a live worker, or None.
- `drop_worker(worker_id)`: forget the worker at once; True if it was known.
- `close()`: release connections; the index is unusable afterwards.

Backend failures (connection refused, timeout, protocol errors) surface as `IndexUnavailable`;
`guard.GuardedPrefixIndex` adds timeouts, a circuit breaker and counters on top.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from model_runtime.hashing import BlockHash

KVEventKind = Literal["stored", "removed", "cleared"]
KV_EVENT_KINDS: tuple[KVEventKind, ...] = ("stored", "removed", "cleared")


@dataclass(frozen=True)
class KVEvent:
    """One change of a worker's set of cached block hashes (`block_pool.KVCacheEvent` + who,
    which process start and which position in that worker's event stream)."""

    worker_id: str
    epoch: int
    seq: int
    kind: KVEventKind
    block_hashes: tuple[BlockHash, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KV_EVENT_KINDS:
            raise ValueError(f"kind must be one of {list(KV_EVENT_KINDS)}, got {self.kind!r}")
        if self.seq < 1:
            raise ValueError(f"event seq must be >= 1, got {self.seq}")
        if self.kind == "cleared" and self.block_hashes:
            raise ValueError("a 'cleared' event carries no block hashes")


@dataclass(frozen=True)
class KVSnapshot:
    """Every block hash a worker can serve now, as of its event `seq` (0: no event yet)."""

    worker_id: str
    epoch: int
    seq: int
    block_hashes: tuple[BlockHash, ...] = ()


@dataclass(frozen=True)
class PrefixMatch:
    """`worker_id` (at `epoch`) holds the first `num_blocks` blocks of the looked-up chain."""

    worker_id: str
    epoch: int
    num_blocks: int


class ApplyResult(enum.Enum):
    """What `PrefixIndex.apply` did with an event."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"  # already applied (by this or another router replica)
    RESYNC = "resync"  # unknown worker, other epoch or a seq gap: resync from a snapshot


class IndexUnavailable(Exception):
    """The index backend could not answer (down, slow, or the circuit breaker is open)."""


class PrefixIndex(Protocol):
    """Block hash -> workers holding it. See the module docstring for the exact contract."""

    async def apply(self, event: KVEvent) -> ApplyResult: ...

    async def resync(self, snapshot: KVSnapshot) -> bool: ...

    async def refresh(self, worker_id: str, epoch: int) -> bool: ...

    async def match(self, block_hashes: Sequence[BlockHash]) -> list[PrefixMatch]: ...

    async def state(self, worker_id: str) -> tuple[int, int] | None: ...

    async def drop_worker(self, worker_id: str) -> bool: ...

    async def close(self) -> None: ...
