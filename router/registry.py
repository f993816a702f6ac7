"""Worker registry seam: which workers exist, their role, last status and health.

Runs in the router process. The registry stores membership and the last `WorkerStatus`; it does
no network I/O itself (the `pool.WorkerPool` polls workers and reports here). Methods are
`async` because the shared implementation planned for a later issue lives in Redis; the
in-memory one here is what a single router uses and what tests use.

Health rule: a worker is healthy after a successful heartbeat and unhealthy after a failed one
(a failed poll or a failed call); it is also unhealthy once `ttl_s` passes without a successful
heartbeat, so a registry whose poller stopped does not keep advertising dead workers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from proto.pdserve.v1 import worker_pb2
from router.policy import ROLE_NAMES, Role


@dataclass(frozen=True)
class WorkerRecord:
    """One registered worker. `status` is the last successful `GetStatus` answer (or None)."""

    address: str
    role: Role
    status: worker_pb2.WorkerStatus | None = None
    healthy: bool = False
    consecutive_failures: int = 0
    last_ok: float | None = None  # monotonic time of the last successful heartbeat
    last_error: str = ""


class WorkerRegistry(Protocol):
    """Membership and liveness of workers (register / heartbeat / list / deregister).

    Contract: `register` is idempotent (re-registering keeps status, updates the role);
    `heartbeat` on an unknown address raises KeyError (never a silent no-op); `list` returns
    records sorted by address with TTL expiry applied; `deregister` answers whether it existed.
    """

    async def register(self, address: str, role: Role) -> None: ...

    async def heartbeat(
        self, address: str, status: worker_pb2.WorkerStatus | None, error: str = ""
    ) -> None: ...

    async def list(self) -> list[WorkerRecord]: ...

    async def deregister(self, address: str) -> bool: ...


class InMemoryWorkerRegistry:
    """`WorkerRegistry` in a dict; for one router process and for tests."""

    def __init__(self, ttl_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self._ttl_s = ttl_s
        self._clock = clock
        self._records: dict[str, WorkerRecord] = {}

    async def register(self, address: str, role: Role) -> None:
        """Add `address` with `role` (unhealthy until its first heartbeat)."""
        if role not in ROLE_NAMES:
            raise ValueError(f"role must be one of {list(ROLE_NAMES)}, got {role!r}")
        old = self._records.get(address)
        self._records[address] = (
            WorkerRecord(address, role) if old is None else replace(old, role=role)
        )

    async def heartbeat(
        self, address: str, status: worker_pb2.WorkerStatus | None, error: str = ""
    ) -> None:
        """Record a poll/call result: a status means healthy, None means a failure (`error`).

        A status whose `role` is a known role updates the record's role (workers can switch).
        """
        old = self._records[address]
        if status is None:
            self._records[address] = replace(
                old,
                healthy=False,
                consecutive_failures=old.consecutive_failures + 1,
                last_error=error,
            )
            return
        role: Role = old.role
        for known in ROLE_NAMES:
            if status.role == known:
                role = known
        self._records[address] = replace(
            old,
            role=role,
            status=status,
            healthy=True,
            consecutive_failures=0,
            last_ok=self._clock(),
            last_error="",
        )

    async def list(self) -> list[WorkerRecord]:
        """All records by address; a record past its TTL is reported unhealthy."""
        now = self._clock()
        out = []
        for addr in sorted(self._records):
            rec = self._records[addr]
            if rec.healthy and rec.last_ok is not None and now - rec.last_ok > self._ttl_s:
                rec = replace(rec, healthy=False, last_error="heartbeat expired")
            out.append(rec)
        return out

    async def deregister(self, address: str) -> bool:
        """Forget `address`; True if it was registered."""
        return self._records.pop(address, None) is not None
