"""Prefix index: block hash -> workers holding that KV block. Runs in the router process.

- `base`        the `PrefixIndex` seam, its event/snapshot/match types and its contract
- `memory`      `InMemoryPrefixIndex` (embedded default for one router)
- `redis_index` `RedisPrefixIndex` (shared by router replicas; one Lua script per call)
- `breaker`     `CircuitBreaker` (pure)
- `guard`       `GuardedPrefixIndex`: timeouts + breaker + `PrefixIndexStats`
- `config`      `MemoryIndexConfig` / `RedisIndexConfig` and `make_index`
"""

from router.prefix_index.base import (
    ApplyResult,
    IndexUnavailable,
    KVEvent,
    KVSnapshot,
    PrefixIndex,
    PrefixMatch,
)

__all__ = [
    "ApplyResult",
    "IndexUnavailable",
    "KVEvent",
    "KVSnapshot",
    "PrefixIndex",
    "PrefixMatch",
]
