"""The actuator seam: how the ratio controller changes the cluster.

Runs in the router process, on its event loop (called by the controller's driver, one change
at a time). Contract of an `Actuator`:

- `switch_role(address, role, drain_timeout_s)`: the worker stops taking new work of its old
  role, finishes (or, at the timeout, aborts) what it holds, then switches role in place —
  same process, same weights. Returns once the switch is done *and* the router's pool reports
  the worker under its new role (so the next window sees it); raises `ActuationError`.

The controller never adds or removes workers (the launcher's business), so switching roles is
the whole seam. `PoolActuator` is the real one: `Worker.SetRole` over the pool's channel, then
a pool poll (the registry takes a worker's role from its status), then `on_role_change` (e.g.
start or stop the worker's prefix indexer). The in-memory fake for tests is
`tests.fakes.ratio_pool.FakeActuator`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc

from proto.pdserve.v1 import worker_pb2
from router.policy import Role
from router.pool import WorkerPool

log = logging.getLogger(__name__)

RPC_MARGIN_S = 10.0
"""SetRole's deadline is the drain timeout plus this (the switch itself, after the drain)."""


class ActuationError(Exception):
    """A change could not be made; the message says which and why."""


class Actuator(Protocol):
    """Changes worker roles (see the module docstring for the contract)."""

    async def switch_role(self, address: str, role: Role, drain_timeout_s: float) -> None: ...


RoleChange = Callable[[str, Role], Awaitable[None]]
"""`await on_role_change(address, new_role)` after a switch."""


class PoolActuator:
    """`Actuator` over a `WorkerPool` (SetRole RPC)."""

    def __init__(self, pool: WorkerPool, on_role_change: RoleChange | None = None) -> None:
        self._pool = pool
        self._on_role_change = on_role_change

    async def switch_role(self, address: str, role: Role, drain_timeout_s: float) -> None:
        """SetRole(role, drain_timeout_s) on `address`, then refresh the pool (contract above)."""
        try:
            stub = self._pool.stub(address)
        except KeyError:
            raise ActuationError(f"switch {address} -> {role}: not in the pool") from None
        request = worker_pb2.SetRoleRequest(role=role, drain_timeout_s=drain_timeout_s)
        try:
            status = await stub.SetRole(request, timeout=drain_timeout_s + RPC_MARGIN_S)
        except grpc.aio.AioRpcError as exc:
            raise ActuationError(
                f"switch {address} -> {role}: SetRole failed: {exc.code().name}: {exc.details()}"
            ) from exc
        if status.role != role:
            raise ActuationError(f"switch {address} -> {role}: worker reports {status.role!r}")
        await self._pool.poll_once()
        now = {v.address: v.role for v in self._pool.views()}
        if now.get(address) != role:
            raise ActuationError(
                f"switch {address} -> {role}: the pool still lists it as {now.get(address)!r}"
            )
        log.info("worker %s is now %s", address, role)
        if self._on_role_change is not None:
            await self._on_role_change(address, role)
