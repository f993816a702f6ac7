"""The ratio controller wired into a running router, over model-free fake workers.

Everything (router, fake workers, client) runs on one event loop per test, on 127.0.0.1, with
sub-second controller intervals, so each test takes a couple of seconds:

- advisory: real requests through the router feed the controller (the `Generate` hook); it
  records a switch it would make, in memory and in the JSONL log, and never calls SetRole;
- adaptive: scripted TPOT misses make it switch a prefill worker to decode through the real
  `PoolActuator`, and the prefix indexers follow (the switched worker loses its indexer; a
  later switch back to prefill gives one again);
- a failing outcome hook never fails a request; `RouterHandle.stop()` stops the controller.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from proto.pdserve.v1 import inference_pb2 as ipb
from router.ratio.config import RatioConfig
from router.ratio.driver import DecisionRecord, RatioController
from tests.fakes.cluster import FakeCluster, fake_cluster, wait_until
from tests.fakes.fake_worker import FakeWorkerConfig

FAST: dict[str, Any] = dict(
    min_requests=3,
    window_s=5,
    interval_s=0.2,
    sample_interval_s=0.05,
    cooldown_s=0,
    drain_timeout_s=2,
)


def ratio_of(c: FakeCluster) -> RatioController:
    assert c.router.ratio is not None, "the router runs no ratio controller"
    return c.router.ratio


def changes(c: FakeCluster, event: str = "decision") -> list[DecisionRecord]:
    return [r for r in ratio_of(c).records if r.event == event and r.action != "hold"]


def controller_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("ratio-")]


def request(i: int) -> ipb.GenerateRequest:
    """Four tokens after a short prompt (the fake workers make them up)."""
    return ipb.GenerateRequest(
        request_id=f"r{i}",
        token_ids=ipb.TokenIds(ids=[1, 2, 3, i]),
        sampling=ipb.SamplingParams(max_tokens=4),
    )


def test_fixed_mode_runs_no_controller(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir) as c:
            assert c.router.ratio is None
            assert not controller_tasks()

    asyncio.run(scenario())


def test_advisory_records_decisions_and_never_sets_roles(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    log_path = tmp_path / "decisions.jsonl"
    ratio = RatioConfig(
        mode="advisory", slo_ttft_ms=20, slo_tpot_ms=1000, decisions_path=log_path, **FAST
    )
    slow_prefill = FakeWorkerConfig(prefill_delay_s=0.05)  # every TTFT misses its 20 ms SLO

    async def scenario() -> None:
        async with fake_cluster(
            tiny_model_dir, n_prefill=1, n_decode=2, worker=slow_prefill, ratio=ratio
        ) as c:
            roles = {v.address: v.role for v in c.router.pool.views()}
            for i in range(4):
                responses = await c.generate(request(i))
                assert responses[-1].HasField("final")
            await wait_until(lambda: bool(changes(c)), 5.0, "an advisory switch decision")
            rec = changes(c)[0]
            assert (rec.mode, rec.action, rec.to_role, rec.applied) == (
                "advisory",
                "switch",
                "prefill",
                False,
            )
            assert rec.inputs["requests"] >= 3 and rec.inputs["ttft_attainment"] == 0.0
            await asyncio.sleep(0.3)  # a few more evaluations: still nothing applied
            assert all(w.calls["SetRole"] == 0 for w in c.workers)
            assert {v.address: v.role for v in c.router.pool.views()} == roles
            assert not changes(c, "done") and not changes(c, "failed")
            logged = [json.loads(line) for line in log_path.read_text().splitlines()]
            assert [r["seq"] for r in logged] == [r.seq for r in ratio_of(c).records]
            assert any(r["action"] == "switch" and not r["applied"] for r in logged)
            assert controller_tasks()
        assert not controller_tasks(), "RouterHandle.stop() left the controller running"

    asyncio.run(scenario())


def test_adaptive_switch_moves_the_indexers(tiny_model_dir: Path) -> None:
    ratio = RatioConfig(
        mode="adaptive", slo_ttft_ms=100, slo_tpot_ms=50, revert_worse=False, **FAST
    )

    async def scenario() -> None:
        async with fake_cluster(
            tiny_model_dir, n_prefill=2, n_decode=1, kv_blocks=16, ratio=ratio
        ) as c:
            ctl, idx, pool = ratio_of(c), c.router.indexers, c.router.pool
            prefill = {w.address for w in c.prefill}
            assert set(idx.by_address) == prefill
            await wait_until(
                lambda: all(i.synced.is_set() for i in idx.by_address.values()),
                5.0,
                "both prefill indexers to sync",
            )
            for _ in range(5):  # decode is the bottleneck: every TPOT misses, TTFT is fine
                ctl.observe(ttft_s=0.01, tpot_s=0.5, ok=True, e2e_s=1.0)
            await wait_until(lambda: bool(changes(c, "done")), 5.0, "prefill -> decode done")
            done = changes(c, "done")[0]
            assert (done.action, done.from_role, done.to_role) == ("switch", "prefill", "decode")
            moved = done.address
            assert moved in prefill
            worker = next(w for w in c.workers if w.address == moved)
            assert worker.calls["SetRole"] == 1 and worker.config.role == "decode"
            assert {v.address for v in pool.views("prefill")} == prefill - {moved}
            assert set(idx.by_address) == prefill - {moved}, "the switched worker kept its indexer"

            # Now prefill is short: TTFT misses from requests that started after the change.
            await asyncio.sleep(0.6)
            for _ in range(5):
                ctl.observe(ttft_s=0.5, tpot_s=0.01, ok=True, e2e_s=0.52)
            await wait_until(lambda: len(changes(c, "done")) == 2, 5.0, "decode -> prefill done")
            back = changes(c, "done")[1]
            assert (back.from_role, back.to_role) == ("decode", "prefill")
            now_prefill = {v.address for v in pool.views("prefill")}
            assert back.address in now_prefill and len(now_prefill) == 2
            assert set(idx.by_address) == now_prefill, "indexers do not match the prefill workers"
            assert sum(w.calls["SetRole"] for w in c.workers) == 2

    asyncio.run(scenario())


def test_a_failing_outcome_hook_never_fails_a_request(tiny_model_dir: Path) -> None:
    ratio = RatioConfig(mode="advisory", slo_ttft_ms=1000, slo_tpot_ms=1000, **FAST)

    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir, n_decode=2, ratio=ratio) as c:
            seen: list[tuple[Any, ...]] = []

            def boom(*args: Any, **kw: Any) -> None:
                seen.append((*args, kw))
                raise RuntimeError("observer bug")

            ratio_of(c).observe = boom  # type: ignore[method-assign]
            responses = await c.generate(request(0))
            assert responses[-1].final.usage.completion_tokens == 4
            assert len(seen) == 1
            ttft_s, tpot_s, ok, e2e_s, kw = seen[0]
            assert kw == {"path": "remote"}  # hybrid off: every request through a prefill worker
            assert ok and 0 < ttft_s <= e2e_s and tpot_s is not None and tpot_s >= 0

    asyncio.run(scenario())
