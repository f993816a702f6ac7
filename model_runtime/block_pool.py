"""Block pool: which KV block ids are free, in use, or cached for prefix reuse. Torch-free.

Runs in every worker process, owned by the engine thread (not thread-safe). It only hands out
block *ids*; the K/V data lives in `KVCache`. Every block is in exactly one state::

    FREE       ref 0, no hash           in the free list
    EVICTABLE  ref 0, hash registered   in the LRU (oldest first), reusable by `acquire`
    IN_USE     ref >= 1, hash optional  held by one or more requests

    allocate ──> IN_USE ──free (last ref)──> FREE       (no hash, or prefix caching off)
                   │  └──────free (last ref)──> EVICTABLE (has a hash)
                   └─ cache_block(hash)        EVICTABLE ──acquire──> IN_USE
                                               EVICTABLE ──evicted by allocate──> IN_USE

Prefix caching is keyed by the block-hash chain of `model_runtime.hashing`: a full block whose
K/V has been computed is registered with `cache_block(block_id, hash)`; `lookup(hashes)` finds
the longest leading run of registered hashes, and `acquire(block_ids)` takes a reference on each
(reviving EVICTABLE ones). `allocate` prefers FREE blocks and then evicts the least recently
freed EVICTABLE block, dropping its hash.

Out of capacity is not an error: `allocate` returns None. Misuse (freeing a free block,
acquiring an unregistered one) is a broken invariant and fails an `assert` naming the values.

An optional listener receives a `KVCacheEvent` for every change of the set of registered hashes
(`stored`, `removed`, `cleared`) — a later issue publishes them to the Redis prefix index.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from model_runtime.hashing import BlockHash

KVCacheEventKind = Literal["stored", "removed", "cleared"]


@dataclass(frozen=True)
class KVCacheEvent:
    """A change in the set of block hashes this pool can serve.

    `stored`: the hashes became available; `removed`: they were evicted; `cleared`: every hash
    was dropped at once (`block_hashes` is empty).
    """

    kind: KVCacheEventKind
    block_hashes: tuple[BlockHash, ...] = ()


KVCacheEventListener = Callable[[KVCacheEvent], None]


class BlockPool:
    """A fixed set of `num_blocks` KV block ids (0 .. num_blocks-1) with ref counts.

    `enable_prefix_caching=False` makes `cache_block` a no-op and `lookup` always empty, so
    freed blocks go straight back to the free list.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        listener: KVCacheEventListener | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.listener = listener
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # ref-0 blocks with a hash; insertion order = least recently freed first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}

    # ------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out now: FREE plus EVICTABLE."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks with a registered hash (in use or evictable)."""
        return len(self._hash_of)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0.0 .. 1.0)."""
        return 1.0 - self.num_free / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        """Number of holders of `block_id` (0 for FREE and EVICTABLE blocks)."""
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash registered for `block_id`, or None."""
        return self._hash_of.get(block_id)

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest leading run of `block_hashes` that are registered.

        Takes no references: call `acquire` on (a prefix of) the result before the next
        `allocate`, which may evict them.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in block_hashes:
            block_id = self._block_of.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # ------------------------------------------------------------------ mutations

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` blocks with ref count 1, or return None (and change nothing) if fewer than
        `n` are free. FREE blocks go first, then EVICTABLE ones in LRU order (their hashes are
        dropped and reported in one `removed` event)."""
        assert n >= 0, f"allocate({n})"
        free = self._free
        if n > len(free) + len(self._evictable):
            return None
        # (loops with local names: the simulator allocates hundreds of thousands of blocks)
        pop = free.popleft
        out = [pop() for _ in range(min(n, len(free)))]
        evicted: list[BlockHash] = []
        if len(out) < n:
            evict = self._evictable.popitem
            hash_of, block_of = self._hash_of, self._block_of
            for _ in range(n - len(out)):
                block_id = evict(last=False)[0]
                block_hash = hash_of.pop(block_id)
                del block_of[block_hash]
                evicted.append(block_hash)
                out.append(block_id)
        out.sort()  # ascending: a run of consecutive ids is sent zero-copy by the KV transfer
        ref = self._ref
        for block_id in out:
            assert ref[block_id] == 0, (block_id, ref[block_id])
            ref[block_id] = 1
        if evicted:
            self._emit(KVCacheEvent("removed", tuple(evicted)))
        return out

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each block (a prefix-cache hit from `lookup`).

        Each block must be IN_USE or EVICTABLE; EVICTABLE blocks leave the LRU.
        """
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                assert block_id in self._evictable, (
                    f"acquire: block {block_id} is free and has no cached hash"
                )
                del self._evictable[block_id]
            self._ref[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block, in the given order.

        A block whose last reference goes becomes EVICTABLE (appended as most recently used) if
        it has a hash, else FREE. Callers free a sequence's blocks tail first, so that its tail
        is evicted before its more shareable head.
        """
        ref, hash_of, evictable, free = self._ref, self._hash_of, self._evictable, self._free
        for block_id in block_ids:
            left = ref[block_id] - 1
            assert left >= 0, f"free: block {block_id} has ref count 0"
            ref[block_id] = left
            if left == 0:
                if block_id in hash_of:
                    evictable[block_id] = None
                else:
                    free.append(block_id)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register the computed, full, IN_USE block `block_id` under `block_hash`.

        Returns True if newly registered (a `stored` event is emitted). Returns False when
        prefix caching is off, when the block already carries this hash, or when another block
        already holds `block_hash` (two requests computed the same prefix at once: the first
        stays the cached copy, this block stays private and is FREE when released).
        """
        return self.cache_blocks([block_id], [block_hash]) == 1

    def cache_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> int:
        """`cache_block` for each pair; one `stored` event lists every newly registered hash.

        Returns how many were newly registered.
        """
        assert len(block_ids) == len(block_hashes), (len(block_ids), len(block_hashes))
        ref, hash_of, block_of = self._ref, self._hash_of, self._block_of
        stored: list[BlockHash] = []
        for block_id, block_hash in zip(block_ids, block_hashes, strict=True):
            assert ref[block_id] > 0, f"cache_block: block {block_id} is not in use"
            if not self.enable_prefix_caching:
                continue
            old = hash_of.get(block_id)
            if old is not None:
                assert old == block_hash, (
                    f"cache_block: block {block_id} already has hash {old:x}, got {block_hash:x}"
                )
                continue
            if block_hash in block_of:
                continue
            hash_of[block_id] = block_hash
            block_of[block_hash] = block_id
            stored.append(block_hash)
        if stored:
            self._emit(KVCacheEvent("stored", tuple(stored)))
        return len(stored)

    def reset_prefix_cache(self) -> int:
        """Forget every registered hash; return how many were dropped.

        EVICTABLE blocks become FREE; IN_USE blocks keep their holders but lose their hash (so
        they are FREE once released). Emits one `cleared` event.
        """
        dropped = len(self._hash_of)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._hash_of.clear()
        self._block_of.clear()
        self._emit(KVCacheEvent("cleared"))
        return dropped

    # ------------------------------------------------------------------ internals

    def _emit(self, event: KVCacheEvent) -> None:
        if self.listener is not None:
            self.listener(event)

    def check_integrity(self) -> None:
        """Assert (with the offending values) that the pool's bookkeeping is consistent:
        ref counts >= 0, every block in exactly one state, hash maps mutual inverses."""
        free = set(self._free)
        assert len(free) == len(self._free), f"duplicate ids in free list: {list(self._free)}"
        evictable = set(self._evictable)
        assert not free & evictable, f"blocks both free and evictable: {free & evictable}"
        for block_id, ref in enumerate(self._ref):
            assert ref >= 0, f"block {block_id} has ref count {ref}"
            states = (ref > 0) + (block_id in free) + (block_id in evictable)
            assert states == 1, (
                f"block {block_id} in {states} states (ref={ref}, free={block_id in free}, "
                f"evictable={block_id in evictable})"
            )
            if block_id in free:
                assert block_id not in self._hash_of, f"free block {block_id} has a hash"
            if block_id in evictable:
                assert block_id in self._hash_of, f"evictable block {block_id} has no hash"
        assert len(self._hash_of) == len(self._block_of), (
            f"{len(self._hash_of)} block->hash entries vs {len(self._block_of)} hash->block"
        )
        for block_id, block_hash in self._hash_of.items():
            assert self._block_of.get(block_hash) == block_id, (
                f"hash {block_hash:x}: block {block_id} vs {self._block_of.get(block_hash)}"
            )
        if not self.enable_prefix_caching:
            assert not self._hash_of, f"prefix caching off but {len(self._hash_of)} hashes"
