"""Prefix-index configuration (frozen pydantic sub-models chosen by `kind`) and the factory
that builds the guarded index from it. Runs in the router process and in the CLI.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from router.prefix_index.breaker import CircuitBreaker
from router.prefix_index.guard import GuardedPrefixIndex


class _IndexCommon(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    ttl_s: float = Field(
        default=10.0,
        gt=0,
        description="A worker's entries vanish this long after its last event, snapshot or "
        "heartbeat (a dead worker's blocks are never routed to for longer).",
    )
    heartbeat_s: float = Field(
        default=1.0,
        gt=0,
        description="Idle heartbeat period the router asks each worker's KV event stream for; "
        "a stream silent for 3 periods is reconnected.",
    )
    lookup_timeout_s: float = Field(
        default=0.05,
        gt=0,
        description="Longest wait for a routing lookup; past it the request is routed by load "
        "(a lookup takes ~0.2 ms on loopback; 50 ms leaves room for event-loop stalls on a "
        "busy host, where a false timeout costs `breaker_open_s` of load-only routing).",
    )
    write_timeout_s: float = Field(
        default=0.5, gt=0, description="Longest wait for one event / snapshot / refresh write."
    )
    breaker_failures: int = Field(
        default=3, ge=1, description="Failures in a row that open the circuit breaker."
    )
    breaker_open_s: float = Field(
        default=1.0, gt=0, description="How long an open breaker refuses calls before a probe."
    )


class MemoryIndexConfig(_IndexCommon):
    """The embedded in-memory index (one router; the default)."""

    kind: Literal["memory"] = "memory"


class RedisIndexConfig(_IndexCommon):
    """A Redis index shared by every router replica (`redis.asyncio`, standalone Redis)."""

    kind: Literal["redis"] = "redis"
    url: str = Field(description="redis:// or unix:// URL of the Redis server.")
    key_prefix: str = Field(
        default="pdserve:pfx:", min_length=1, description="Prefix of every key this index uses."
    )
    block_ttl_s: float = Field(
        default=3600.0,
        gt=0,
        description="A block key nobody stores or hits for this long expires (garbage bound).",
    )
    socket_timeout_s: float = Field(
        default=1.0, gt=0, description="Socket connect/read timeout of the Redis client."
    )

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url must start with redis://, rediss:// or unix://, got {value!r}")
        return value


PrefixIndexConfig = Annotated[MemoryIndexConfig | RedisIndexConfig, Field(discriminator="kind")]
"""One of the index configurations, chosen by `kind`."""


def make_index(config: MemoryIndexConfig | RedisIndexConfig) -> GuardedPrefixIndex:
    """Build the configured index behind its timeouts and circuit breaker (no I/O yet)."""
    from router.prefix_index.memory import InMemoryPrefixIndex
    from router.prefix_index.redis_index import RedisPrefixIndex

    if isinstance(config, RedisIndexConfig):
        index: InMemoryPrefixIndex | RedisPrefixIndex = RedisPrefixIndex(
            config.url,
            key_prefix=config.key_prefix,
            ttl_s=config.ttl_s,
            block_ttl_s=config.block_ttl_s,
            socket_timeout_s=config.socket_timeout_s,
        )
    else:
        index = InMemoryPrefixIndex(ttl_s=config.ttl_s)
    breaker = CircuitBreaker(config.breaker_failures, config.breaker_open_s, name=config.kind)
    return GuardedPrefixIndex(index, breaker, config.lookup_timeout_s, config.write_timeout_s)
