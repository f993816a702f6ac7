"""Redis `PrefixIndex` (`redis.asyncio`), shared by every router replica. Runs in the router
process, on its event loop; every method is one round trip (one Lua script, EVALSHA).

Keys (`P` = key prefix; `H` = a block hash as 16 raw big-endian bytes, `hash_to_bytes`)::

    P w:<worker_id>   HASH  {epoch, seq}        TTL ttl_s, restarted by apply/resync/refresh
    P s:<worker_id>   SET   {H, ...}            the worker's hashes (for clear / resync / drop),
                                                TTL block_ttl_s, restarted with the worker key
    P b:<H>           HASH  {worker_id: epoch}  TTL block_ttl_s, restarted by store and by hits

Epochs travel and compare as decimal strings (they exceed 2^53, Lua's exact-integer range);
seqs are compared as Lua numbers (exact up to 2^53 events per epoch).

A worker's block fields are valid only while `P w:<worker_id>` exists with the same epoch:
`match` checks that for every worker it meets and deletes the field of a dead or restarted
worker on the spot (lazy clean-up); a block key nobody stores or hits for `block_ttl_s` expires.
The hash set outlives the worker key, so a worker that comes back with a new epoch after its
TTL ran out still clears every field of its old epoch at its resync.
Scripts build key names from their arguments, so this needs a standalone Redis (not Cluster).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, RedisError

from model_runtime.hashing import BlockHash, hash_to_bytes
from router.prefix_index.base import (
    ApplyResult,
    IndexUnavailable,
    KVEvent,
    KVSnapshot,
    PrefixMatch,
)

log = logging.getLogger(__name__)

# Shared Lua: drop every block field of worker `w` listed in its set `skey`, then the set.
_CLEAR = """
local function clear(p, w, skey)
  for _, h in ipairs(redis.call('SMEMBERS', skey)) do
    redis.call('HDEL', p .. 'b:' .. h, w)
  end
  redis.call('DEL', skey)
end
"""

# ARGV: prefix, worker_id, epoch, seq, kind, ttl_ms, block_ttl_ms, hash...
_APPLY = (
    _CLEAR
    + """
local p, w, epoch, seq, kind = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local ttl, bttl = tonumber(ARGV[6]), tonumber(ARGV[7])
local wkey, skey = p .. 'w:' .. w, p .. 's:' .. w
local cur = redis.call('HMGET', wkey, 'epoch', 'seq')
if not cur[1] or cur[1] ~= epoch then return 'resync' end
local last = tonumber(cur[2])
if seq <= last then return 'duplicate' end
if seq > last + 1 then return 'resync' end
if kind == 'stored' then
  for i = 8, #ARGV do
    local bkey = p .. 'b:' .. ARGV[i]
    redis.call('HSET', bkey, w, epoch)
    redis.call('PEXPIRE', bkey, bttl)
    redis.call('SADD', skey, ARGV[i])
  end
elseif kind == 'removed' then
  for i = 8, #ARGV do
    if redis.call('SREM', skey, ARGV[i]) == 1 then
      redis.call('HDEL', p .. 'b:' .. ARGV[i], w)
    end
  end
else
  clear(p, w, skey)
end
redis.call('HSET', wkey, 'seq', ARGV[4])
redis.call('PEXPIRE', wkey, ttl)
redis.call('PEXPIRE', skey, bttl)
return 'applied'
"""
)

# ARGV: prefix, worker_id, epoch, seq, ttl_ms, block_ttl_ms, hash...
_RESYNC = (
    _CLEAR
    + """
local p, w, epoch, seq = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local ttl, bttl = tonumber(ARGV[5]), tonumber(ARGV[6])
local wkey, skey = p .. 'w:' .. w, p .. 's:' .. w
local cur = redis.call('HMGET', wkey, 'epoch', 'seq')
if cur[1] == epoch and tonumber(cur[2]) >= seq then
  redis.call('PEXPIRE', wkey, ttl)
  redis.call('PEXPIRE', skey, bttl)
  return 0
end
clear(p, w, skey)
redis.call('DEL', wkey)
redis.call('HSET', wkey, 'epoch', epoch, 'seq', ARGV[4])
redis.call('PEXPIRE', wkey, ttl)
for i = 7, #ARGV do
  local bkey = p .. 'b:' .. ARGV[i]
  redis.call('HSET', bkey, w, epoch)
  redis.call('PEXPIRE', bkey, bttl)
  redis.call('SADD', skey, ARGV[i])
end
redis.call('PEXPIRE', skey, bttl)
return 1
"""
)

# ARGV: prefix, worker_id, epoch, ttl_ms, block_ttl_ms
_REFRESH = """
local wkey, skey = ARGV[1] .. 'w:' .. ARGV[2], ARGV[1] .. 's:' .. ARGV[2]
if redis.call('HGET', wkey, 'epoch') ~= ARGV[3] then return 0 end
redis.call('PEXPIRE', wkey, ARGV[4])
redis.call('PEXPIRE', skey, ARGV[5])
return 1
"""

# ARGV: prefix, block_ttl_ms, hash... -> {worker_id, epoch, num_blocks, ...}
_MATCH = """
local p, bttl = ARGV[1], tonumber(ARGV[2])
local live, counts, active = {}, {}, nil
for i = 3, #ARGV do
  local bkey = p .. 'b:' .. ARGV[i]
  local f = redis.call('HGETALL', bkey)
  if #f == 0 then break end
  local nxt, any = {}, false
  for j = 1, #f, 2 do
    local w, ep = f[j], f[j + 1]
    if active == nil or active[w] then
      local le = live[w]
      if le == nil then
        le = redis.call('HGET', p .. 'w:' .. w, 'epoch')
        live[w] = le
      end
      if le == ep then
        nxt[w] = true
        counts[w] = i - 2
        any = true
      else
        redis.call('HDEL', bkey, w)
      end
    end
  end
  if not any then break end
  redis.call('PEXPIRE', bkey, bttl)
  active = nxt
end
local out = {}
for w, c in pairs(counts) do
  out[#out + 1] = w
  out[#out + 1] = live[w]
  out[#out + 1] = c
end
return out
"""

# ARGV: prefix, worker_id
_DROP = (
    _CLEAR
    + """
local wkey, skey = ARGV[1] .. 'w:' .. ARGV[2], ARGV[1] .. 's:' .. ARGV[2]
clear(ARGV[1], ARGV[2], skey)
return redis.call('DEL', wkey)
"""
)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


class RedisPrefixIndex:
    """`PrefixIndex` in a Redis server at `url`; several routers may share it.

    `socket_timeout_s` bounds every command at the socket level (callers add tighter
    `asyncio.timeout`s on the request path). Commands are never retried here: a failure is an
    `IndexUnavailable` at once, and the caller decides (the breaker, the indexer's resync).

    Credentials: `username` / `password` (AUTH; a password in `url` works too); TLS with a
    ``rediss://`` url and `tls_ca_file` (+ `tls_cert_file` / `tls_key_file`). Credentials Redis
    rejects are logged once, as an error (then counted in `auth_failures`): every call fails
    like an unreachable Redis, so routing falls back to load only and no request fails.
    """

    def __init__(
        self,
        url: str,
        key_prefix: str = "pdserve:pfx:",
        ttl_s: float = 10.0,
        block_ttl_s: float = 3600.0,
        socket_timeout_s: float = 1.0,
        username: str | None = None,
        password: str | None = None,
        tls_ca_file: Path | None = None,
        tls_cert_file: Path | None = None,
        tls_key_file: Path | None = None,
    ) -> None:
        if ttl_s <= 0 or block_ttl_s <= 0:
            raise ValueError(f"ttl_s and block_ttl_s must be > 0, got {ttl_s}, {block_ttl_s}")
        self._prefix = key_prefix.encode()
        self._ttl_ms = _ms(ttl_s)
        self._block_ttl_ms = _ms(block_ttl_s)
        self.auth_failures = 0
        options: dict[str, Any] = {}
        if username is not None:
            options["username"] = username
        if password is not None:
            options["password"] = password
        if url.startswith("rediss://"):
            options["ssl_ca_certs"] = None if tls_ca_file is None else str(tls_ca_file)
            options["ssl_certfile"] = None if tls_cert_file is None else str(tls_cert_file)
            options["ssl_keyfile"] = None if tls_key_file is None else str(tls_key_file)
        self._redis: aioredis.Redis = aioredis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            **options,
        )
        self._apply = self._redis.register_script(_APPLY)
        self._resync = self._redis.register_script(_RESYNC)
        self._refresh = self._redis.register_script(_REFRESH)
        self._match = self._redis.register_script(_MATCH)
        self._drop = self._redis.register_script(_DROP)

    def _auth_failed(self, exc: AuthenticationError) -> IndexUnavailable:
        """Report rejected credentials once (an error in the log), count every time."""
        self.auth_failures += 1
        if self.auth_failures == 1:
            log.error(
                "redis rejected this router's credentials (%s); the prefix index is off and "
                "requests are routed by load only until the credentials are fixed",
                exc,
            )
        return IndexUnavailable(f"redis: authentication failed: {exc}")

    async def _run(self, script: Any, args: list[bytes | str | int]) -> Any:
        try:
            return await script(args=args)
        except AuthenticationError as exc:
            raise self._auth_failed(exc) from exc
        except RedisError as exc:
            raise IndexUnavailable(f"redis: {type(exc).__name__}: {exc}") from exc
        except OSError as exc:  # a socket error redis-py did not wrap
            raise IndexUnavailable(f"redis: {exc!r}") from exc

    async def apply(self, event: KVEvent) -> ApplyResult:
        """Apply one event atomically (see `base` for the epoch/seq rules)."""
        args: list[bytes | str | int] = [
            self._prefix,
            event.worker_id,
            str(event.epoch),
            event.seq,
            event.kind,
            self._ttl_ms,
            self._block_ttl_ms,
        ]
        args += [hash_to_bytes(h) for h in event.block_hashes]
        answer = await self._run(self._apply, args)
        return ApplyResult(answer.decode() if isinstance(answer, bytes) else answer)

    async def resync(self, snapshot: KVSnapshot) -> bool:
        """Replace the worker's entries with `snapshot` atomically, unless already as new."""
        args: list[bytes | str | int] = [
            self._prefix,
            snapshot.worker_id,
            str(snapshot.epoch),
            snapshot.seq,
            self._ttl_ms,
            self._block_ttl_ms,
        ]
        args += [hash_to_bytes(h) for h in snapshot.block_hashes]
        return bool(await self._run(self._resync, args))

    async def refresh(self, worker_id: str, epoch: int) -> bool:
        """Restart the worker's TTL if Redis holds it at `epoch`."""
        args: list[bytes | str | int] = [self._prefix, worker_id, str(epoch), self._ttl_ms]
        args.append(self._block_ttl_ms)
        return bool(await self._run(self._refresh, args))

    async def match(self, block_hashes: Sequence[BlockHash]) -> list[PrefixMatch]:
        """Leading blocks per live worker, in one EVALSHA."""
        if not block_hashes:
            return []
        args: list[bytes | str | int] = [self._prefix, self._block_ttl_ms]
        args += [hash_to_bytes(h) for h in block_hashes]
        flat = await self._run(self._match, args)
        out = [
            PrefixMatch(flat[i].decode(), int(flat[i + 1]), int(flat[i + 2]))
            for i in range(0, len(flat), 3)
        ]
        return sorted(out, key=lambda m: m.worker_id)

    async def state(self, worker_id: str) -> tuple[int, int] | None:
        """(epoch, last seq) of a live worker, or None."""
        key = self._prefix + b"w:" + worker_id.encode()
        try:
            epoch, seq = await self._redis.hmget(key, ["epoch", "seq"])
        except AuthenticationError as exc:
            raise self._auth_failed(exc) from exc
        except RedisError as exc:
            raise IndexUnavailable(f"redis: {type(exc).__name__}: {exc}") from exc
        if epoch is None or seq is None:
            return None
        return int(epoch), int(seq)

    async def drop_worker(self, worker_id: str) -> bool:
        """Forget `worker_id` and its block fields now."""
        return bool(await self._run(self._drop, [self._prefix, worker_id]))

    async def close(self) -> None:
        """Close the connection pool."""
        await self._redis.aclose()
