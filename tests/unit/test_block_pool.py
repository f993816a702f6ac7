"""BlockPool lifecycles: allocation, ref counts, prefix hits, LRU eviction, events, integrity.

Each test is a numbered script that ends with every block free again.
"""

from __future__ import annotations

import pytest

from model_runtime.block_pool import BlockPool, KVCacheEvent
from model_runtime.hashing import block_hash_chain


def _pool(n: int = 4, caching: bool = True) -> tuple[BlockPool, list[KVCacheEvent]]:
    events: list[KVCacheEvent] = []
    return BlockPool(n, enable_prefix_caching=caching, listener=events.append), events


def _all_free(pool: BlockPool) -> None:
    pool.check_integrity()
    assert pool.num_free == pool.num_blocks
    assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))


def test_allocate_free_and_exhaustion() -> None:
    pool, events = _pool(4)
    # 1. two allocations take distinct blocks
    a = pool.allocate(3)
    b = pool.allocate(1)
    assert a is not None and b is not None
    assert sorted(a + b) == [0, 1, 2, 3]
    assert pool.num_free == 0 and pool.usage == 1.0
    # 2. out of capacity is None, and changes nothing
    assert pool.allocate(1) is None
    assert pool.allocate(0) == []
    pool.check_integrity()
    # 3. free everything; blocks without hashes go back to the free list
    pool.free(a)
    pool.free(b)
    assert pool.allocate(5) is None
    assert events == []
    _all_free(pool)


def test_refcounts_shared_block() -> None:
    pool, _ = _pool(2)
    h = block_hash_chain(list(range(4)), 4)[0]
    # 1. request A computes a block and registers it
    (blk,) = pool.allocate(1) or []
    assert pool.cache_block(blk, h)
    # 2. request B finds it and shares it
    assert pool.lookup([h]) == [blk]
    pool.acquire([blk])
    assert pool.ref_count(blk) == 2
    # 3. A finishes: block still in use by B, not evictable
    pool.free([blk])
    assert pool.ref_count(blk) == 1 and pool.num_free == 1
    # 4. B finishes: block becomes evictable, still counted free and still a hit
    pool.free([blk])
    assert pool.num_free == 2 and pool.lookup([h]) == [blk]
    # 5. freeing again is a broken invariant
    with pytest.raises(AssertionError, match="ref count 0"):
        pool.free([blk])
    _all_free(pool)


def test_prefix_lookup_longest_leading_run() -> None:
    pool, events = _pool(4)
    hashes = block_hash_chain(list(range(12)), 4)  # 3 full blocks
    # 1. cache blocks 0 and 2 of the chain only
    blocks = pool.allocate(3) or []
    assert pool.cache_blocks([blocks[0], blocks[2]], [hashes[0], hashes[2]]) == 2
    assert events == [KVCacheEvent("stored", (hashes[0], hashes[2]))]
    # 2. the run stops at the first miss
    assert pool.lookup(hashes) == [blocks[0]]
    assert pool.lookup(hashes[1:]) == []
    # 3. registering the same block again is a no-op; a second copy of a hash stays private
    assert not pool.cache_block(blocks[0], hashes[0])
    assert not pool.cache_block(blocks[1], hashes[0])
    assert pool.block_hash(blocks[1]) is None
    assert len(events) == 1
    pool.free(list(reversed(blocks)))
    assert pool.num_cached == 2
    _all_free(pool)


def test_lru_eviction_order_and_revival() -> None:
    pool, events = _pool(3)
    hs = block_hash_chain(list(range(12)), 4)
    # 1. three cached blocks, freed in the order 2, 0, 1 (LRU = 2 oldest)
    blocks = pool.allocate(3) or []
    pool.cache_blocks(blocks, hs)
    for i in (2, 0, 1):
        pool.free([blocks[i]])
    events.clear()
    # 2. reviving block 2 takes it out of the LRU: the next victim is block 0
    pool.acquire([blocks[2]])
    assert pool.num_free == 2
    (victim,) = pool.allocate(1) or []
    assert victim == blocks[0]
    assert events == [KVCacheEvent("removed", (hs[0],))]
    assert pool.lookup(hs) == []  # chain broken at block 0
    assert pool.lookup(hs[1:]) == [blocks[1], blocks[2]]
    # 3. free blocks are used before evictable ones
    pool.free([victim])  # no hash any more -> free list
    (again,) = pool.allocate(1) or []
    assert again == victim and pool.block_hash(blocks[1]) == hs[1]
    # 4. acquiring a free, unhashed block is a broken invariant
    pool.free([again])
    with pytest.raises(AssertionError, match="no cached hash"):
        pool.acquire([again])
    pool.free([blocks[2]])
    _all_free(pool)


def test_reset_prefix_cache_and_caching_off() -> None:
    pool, events = _pool(3)
    hs = block_hash_chain(list(range(8)), 4)
    # 1. one evictable cached block, one in-use cached block
    blocks = pool.allocate(2) or []
    pool.cache_blocks(blocks, hs)
    pool.free([blocks[0]])
    # 2. reset drops both hashes; the in-use block keeps its holder
    assert pool.reset_prefix_cache() == 2
    assert events[-1] == KVCacheEvent("cleared")
    assert pool.lookup(hs) == [] and pool.ref_count(blocks[1]) == 1
    pool.check_integrity()
    pool.free([blocks[1]])
    _all_free(pool)
    # 3. with caching off, nothing is ever registered
    off, off_events = _pool(2, caching=False)
    (b,) = off.allocate(1) or []
    assert not off.cache_block(b, hs[0])
    assert off.lookup(hs) == [] and off_events == []
    off.free([b])
    _all_free(off)


def test_allocate_evicts_only_when_needed_and_reports_in_one_event() -> None:
    pool, events = _pool(4)
    hs = block_hash_chain(list(range(8)), 4)
    # 1. two cached, two plain blocks, all released
    blocks = pool.allocate(4) or []
    pool.cache_blocks(blocks[:2], hs)
    pool.free(list(reversed(blocks)))
    events.clear()
    # 2. allocating 3 takes both free blocks and evicts the LRU cached one (block 1: freed first)
    got = pool.allocate(3) or []
    assert set(got) == {blocks[2], blocks[3], blocks[1]}
    assert events == [KVCacheEvent("removed", (hs[1],))]
    assert pool.lookup(hs) == [blocks[0]]
    pool.free(got)
    _all_free(pool)


def test_check_integrity_catches_corruption() -> None:
    pool, _ = _pool(2)
    pool._ref[0] = 1  # in use and on the free list at once
    with pytest.raises(AssertionError, match="block 0 in 2 states"):
        pool.check_integrity()


def test_bad_size_is_value_error() -> None:
    with pytest.raises(ValueError, match="num_blocks must be positive, got 0"):
        BlockPool(0)
