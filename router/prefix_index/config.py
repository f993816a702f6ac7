"""Prefix-index configuration (frozen pydantic sub-models chosen by `kind`) and the factory
that builds the guarded index from it. Runs in the router process and in the CLI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_serializer,
    field_validator,
    model_validator,
)

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


REDIS_PASSWORD_ENV = "PDSERVE_REDIS_PASSWORD"
"""Environment variable through which a launcher hands a router child its Redis password."""


def url_password(url: str) -> str | None:
    """The password in a redis URL's user info (``redis://user:pw@host``), or None."""
    return urlsplit(url).password


def mask_url(url: str) -> str:
    """`url` with the password of its user info replaced by ``***`` (for logs and dumps)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def strip_password(url: str) -> str:
    """`url` without the password of its user info (the user name stays)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username
    return urlunsplit(parts._replace(netloc=f"{user}@{host}" if user else host))


class RedisIndexConfig(_IndexCommon):
    """A Redis index shared by every router replica (`redis.asyncio`, standalone Redis).

    Credentials: an ACL user (`username`) and a password — `password`, `password_file`, or
    the URL's user info (``redis://user:pw@host``), one of them. TLS: a ``rediss://`` URL,
    with `tls_ca_file` (and `tls_cert_file` / `tls_key_file` for a client certificate).
    Passwords never appear in a JSON dump or a log: `password` is a `SecretStr` and the URL's
    password is masked in JSON (so pass a password to another process through `password` /
    `password_file` / the environment, never a JSON dump)."""

    kind: Literal["redis"] = "redis"
    url: str = Field(description="redis://, rediss:// (TLS) or unix:// URL of the Redis server.")
    username: str | None = Field(
        default=None, description="Redis ACL user (default: the URL's, else 'default')."
    )
    password: SecretStr | None = Field(default=None, description="Redis password (AUTH).")
    password_file: Path | None = Field(
        default=None, description="File whose first line is the Redis password."
    )
    tls_ca_file: Path | None = Field(
        default=None, description="CA (PEM) that signed the server's certificate (rediss://)."
    )
    tls_cert_file: Path | None = Field(
        default=None, description="Client certificate (PEM) for Redis's tls-auth-clients."
    )
    tls_key_file: Path | None = Field(default=None, description="Its private key (PEM).")
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
            raise ValueError(
                f"url must start with redis://, rediss:// or unix://, got {mask_url(value)!r}"
            )
        return value

    @field_serializer("url", when_used="json")
    def _dump_url(self, value: str) -> str:
        return mask_url(value)

    @model_validator(mode="after")
    def _credentials(self) -> RedisIndexConfig:
        given = [
            name
            for name, v in (
                ("password", self.password),
                ("password_file", self.password_file),
                ("url (user:password@)", url_password(self.url)),
            )
            if v is not None
        ]
        if len(given) > 1:
            raise ValueError(f"prefix_index: give one Redis password, got {' and '.join(given)}")
        names = ("tls_ca_file", "tls_cert_file", "tls_key_file")
        tls_files = [n for n in names if getattr(self, n) is not None]
        if tls_files and not self.url.startswith("rediss://"):
            raise ValueError(f"prefix_index.{tls_files[0]} needs a rediss:// url (TLS)")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("prefix_index.tls_cert_file and tls_key_file go together")
        return self

    def resolved_password(self) -> str | None:
        """The password to AUTH with: `password`, the first line of `password_file` (read
        now; ValueError naming the field when it cannot be), or the URL's."""
        if self.password is not None:
            return self.password.get_secret_value()
        if self.password_file is not None:
            try:
                lines = self.password_file.read_text().splitlines()
            except OSError as exc:
                raise ValueError(
                    f"prefix_index.password_file: cannot read {str(self.password_file)!r}: "
                    f"{exc.strerror}"
                ) from None
            return lines[0].strip() if lines else ""
        return url_password(self.url)


PrefixIndexConfig = Annotated[MemoryIndexConfig | RedisIndexConfig, Field(discriminator="kind")]
"""One of the index configurations, chosen by `kind`."""


def make_index(config: MemoryIndexConfig | RedisIndexConfig) -> GuardedPrefixIndex:
    """Build the configured index behind its timeouts and circuit breaker (no I/O yet)."""
    from router.prefix_index.memory import InMemoryPrefixIndex
    from router.prefix_index.redis_index import RedisPrefixIndex

    if isinstance(config, RedisIndexConfig):
        index: InMemoryPrefixIndex | RedisPrefixIndex = RedisPrefixIndex(
            strip_password(config.url),
            key_prefix=config.key_prefix,
            ttl_s=config.ttl_s,
            block_ttl_s=config.block_ttl_s,
            socket_timeout_s=config.socket_timeout_s,
            username=config.username,
            password=config.resolved_password(),
            tls_ca_file=config.tls_ca_file,
            tls_cert_file=config.tls_cert_file,
            tls_key_file=config.tls_key_file,
        )
    else:
        index = InMemoryPrefixIndex(ttl_s=config.ttl_s)
    breaker = CircuitBreaker(config.breaker_failures, config.breaker_open_s, name=config.kind)
    return GuardedPrefixIndex(index, breaker, config.lookup_timeout_s, config.write_timeout_s)
