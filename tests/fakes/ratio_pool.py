"""In-memory pool and actuator for ratio-controller tests (no network; test-only, not shipped).

Runs wherever the controller's driver runs in a test. `FakePool` holds `WorkerView`s by
address (tests set their load with `set_load`); `FakeActuator` implements the `Actuator`
contract on it: a switch marks the worker draining, waits `switch_delay_s`, then changes its
role in the pool — the same order a real `SetRole` + pool poll produces. `fail` makes the
next calls raise `ActuationError`.
`calls` lists every call, for assertions.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from router.policy import Role, WorkerView
from router.ratio.actuator import ActuationError


class FakePool:
    """`views()` over a dict of `WorkerView`s (a `driver.ViewSource`)."""

    def __init__(self, roles: dict[str, Role], total_blocks: int = 100) -> None:
        self.workers: dict[str, WorkerView] = {
            a: WorkerView(a, a, r, True, False, total_blocks=total_blocks, free_blocks=total_blocks)
            for a, r in roles.items()
        }

    def views(self) -> list[WorkerView]:
        """Every worker, by address."""
        return [self.workers[a] for a in sorted(self.workers)]

    def set_load(
        self,
        address: str,
        *,
        num_running: int = 0,
        num_waiting: int = 0,
        waiting_tokens: int = 0,
        kv_utilisation: float = 0.0,
    ) -> None:
        """Set one worker's load counters (as its next GetStatus would report them)."""
        v = self.workers[address]
        free = round(v.total_blocks * (1.0 - kv_utilisation))
        self.workers[address] = replace(
            v,
            num_running=num_running,
            num_waiting=num_waiting,
            waiting_tokens=waiting_tokens,
            free_blocks=free,
        )

    def roles(self) -> dict[str, Role]:
        """address -> role."""
        return {a: v.role for a, v in self.workers.items()}


class FakeActuator:
    """`Actuator` over a `FakePool` (module docstring)."""

    def __init__(self, pool: FakePool, switch_delay_s: float = 0.0) -> None:
        self.pool = pool
        self.switch_delay_s = switch_delay_s
        self.fail = False
        self.calls: list[tuple[str, ...]] = []

    def _check(self, what: str) -> None:
        if self.fail:
            raise ActuationError(f"{what}: injected failure")

    async def switch_role(self, address: str, role: Role, drain_timeout_s: float) -> None:
        self.calls.append(("switch", address, role))
        self._check(f"switch {address} -> {role}")
        if address not in self.pool.workers:
            raise ActuationError(f"switch {address} -> {role}: not in the pool")
        self.pool.workers[address] = replace(self.pool.workers[address], draining=True)
        await asyncio.sleep(self.switch_delay_s)
        self.pool.workers[address] = replace(self.pool.workers[address], role=role, draining=False)
