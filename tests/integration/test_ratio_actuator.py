"""The real `PoolActuator` over gRPC against model-free fake workers (127.0.0.1): SetRole then
the pool reports the new role; failures become `ActuationError` naming the cause; the
controller's driver acts through it end to end. Runs in the pytest process, on one event loop,
in well under a second of work."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import pytest

from router.policy import Role
from router.pool import WorkerPool
from router.ratio.actuator import ActuationError, PoolActuator
from router.ratio.config import RatioConfig
from router.ratio.driver import RatioController
from router.registry import InMemoryWorkerRegistry
from tests.fakes.fake_worker import FakeWorker, FakeWorkerConfig

Scenario = Callable[[dict[str, FakeWorker], WorkerPool], Awaitable[None]]


def run(scenario: Scenario) -> None:
    async def go() -> None:
        workers = {
            r: FakeWorker(FakeWorkerConfig(role=r[:-1], worker_id=r))
            for r in ("prefill0", "decode0", "decode1")
        }
        pool = WorkerPool(InMemoryWorkerRegistry(), poll_interval_s=10.0, poll_timeout_s=2.0)
        try:
            for w in workers.values():
                addr = await w.start()
                await pool.add(addr, w.config.role)  # type: ignore[arg-type]
            await pool.poll_once()
            await scenario(workers, pool)
        finally:
            await pool.stop()
            for w in workers.values():
                await w.stop()

    asyncio.run(go())


def test_switch_updates_the_pool_and_calls_back() -> None:
    async def scenario(workers: dict[str, FakeWorker], pool: WorkerPool) -> None:
        seen: list[tuple[str, Role]] = []

        async def on_change(address: str, role: Role) -> None:
            seen.append((address, role))

        act = PoolActuator(pool, on_role_change=on_change)
        d1 = workers["decode1"].address
        await act.switch_role(d1, "prefill", 5.0)
        assert workers["decode1"].calls["SetRole"] == 1
        assert {v.address for v in pool.views("prefill")} == {workers["prefill0"].address, d1}
        assert seen == [(d1, "prefill")]

    run(scenario)


def test_failures_name_their_cause() -> None:
    async def scenario(workers: dict[str, FakeWorker], pool: WorkerPool) -> None:
        act = PoolActuator(pool)
        with pytest.raises(ActuationError, match="not in the pool"):
            await act.switch_role("127.0.0.1:1", "prefill", 1.0)
        workers["decode0"].fail["SetRole"] = grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(ActuationError, match="FAILED_PRECONDITION"):
            await act.switch_role(workers["decode0"].address, "prefill", 1.0)
        assert pool.views("decode")[0].role == "decode"

    run(scenario)


def test_controller_acts_through_the_real_actuator() -> None:
    async def scenario(workers: dict[str, FakeWorker], pool: WorkerPool) -> None:
        cfg = RatioConfig(
            mode="adaptive", slo_ttft_ms=100, slo_tpot_ms=50, min_requests=3, cooldown_s=0
        )
        c = RatioController(cfg, pool, PoolActuator(pool))
        for _ in range(5):
            c.observe(0.5, 0.01, True)  # TTFT misses: prefill is short
        c.sample()
        rec = await c.evaluate()
        assert rec is not None and (rec.action, rec.to_role) == ("switch", "prefill")
        await c.wait_idle()
        assert c.records[-1].event == "done"
        assert [v.role for v in pool.views()].count("prefill") == 2
        assert [w.config.role for w in workers.values()].count("prefill") == 2

    run(scenario)
