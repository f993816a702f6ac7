"""Metric windows and the controller's driver with an in-memory pool and actuator: attainment
arithmetic, windows that forget what came before a change, adaptive vs advisory, the JSONL
decision log, failed changes. Pure asyncio, fake clock; runs in the pytest process."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from router.hybrid import HybridConfig, LiveThreshold
from router.ratio.config import RatioConfig
from router.ratio.driver import RatioController
from router.ratio.metrics import MetricsAggregator, samples_from_views
from tests.fakes.ratio_pool import FakeActuator, FakePool


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def cfg(tmp_path: Path | None = None, **kw: object) -> RatioConfig:
    base: dict[str, object] = dict(
        mode="adaptive",
        slo_ttft_ms=1000,
        slo_tpot_ms=50,
        max_prefill=3,
        max_decode=3,
        window_s=10,
        interval_s=1,
        cooldown_s=5,
        min_requests=5,
        sample_interval_s=0.5,
    )
    if tmp_path is not None:
        base["decisions_path"] = tmp_path / "decisions.jsonl"
    return RatioConfig(**{**base, **kw})


def test_attainment_follows_the_goodput_definition() -> None:
    agg = MetricsAggregator(window_s=10, slo_ttft_s=1.0, slo_tpot_s=0.05)
    agg.observe(1.0, 0.5, 0.01, True)  # meets both
    agg.observe(2.0, 2.0, 0.01, True)  # TTFT miss
    agg.observe(3.0, 0.5, 0.10, True)  # TPOT miss
    agg.observe(4.0, 0.5, None, True)  # one token: no TPOT, meets it
    agg.observe(5.0, 0.1, 0.01, False)  # failed: misses both
    w = agg.window(5.0)
    assert (w.requests, w.ok) == (5, 4)
    assert (w.ttft_attainment, w.tpot_attainment, w.attainment) == (0.6, 0.6, 0.4)
    assert w.ttft_p90_ms == 2000.0
    later = agg.window(13.5)  # the window keeps the last 10 s: t >= 3.5
    assert later.requests == 2 and later.attainment == 0.5
    assert agg.window(13.5, since=4.5).requests == 0  # no start times: "before any change"
    agg.observe(6.0, 0.5, 0.01, True, e2e_s=1.0)  # started at 5.0
    agg.observe(7.0, 0.5, 0.01, True, e2e_s=3.0)  # started at 4.0: before the change
    assert agg.window(13.5, since=4.5).requests == 1
    assert agg.window(100.0).attainment == 1.0  # nothing observed: nothing missed


def test_worker_loads_are_window_means_per_current_role() -> None:
    pool = FakePool({"a:1": "prefill", "b:1": "decode"})
    agg = MetricsAggregator(window_s=10, slo_ttft_s=1.0, slo_tpot_s=0.05)
    pool.set_load("b:1", num_running=2, kv_utilisation=0.5)
    agg.add_samples(1.0, samples_from_views(pool.views(), 1.0))
    pool.set_load("b:1", num_running=4, kv_utilisation=0.7)
    pool.set_load("a:1", waiting_tokens=300, num_waiting=2)
    agg.add_samples(2.0, samples_from_views(pool.views(), 2.0))
    w = agg.window(2.0)
    assert (w.prefill_workers, w.decode_workers) == (1, 1)
    assert w.decode_batch == 3.0 and w.decode_kv_utilisation == pytest.approx(0.6)
    assert w.prefill_waiting_tokens == 150.0 and w.prefill_requests == 1.0
    pool.workers["a:1"] = pool.workers["a:1"].__class__(
        "a:1", "a:1", "decode", True, False, total_blocks=100, free_blocks=100
    )
    agg.add_samples(3.0, samples_from_views(pool.views(), 3.0))
    w = agg.window(3.0)
    assert (w.prefill_workers, w.decode_workers) == (0, 2)
    a = next(x for x in w.workers if x.address == "a:1")
    assert a.role == "decode" and a.waiting_tokens == 0.0  # prefill-era samples not averaged


def ttft_storm(c: RatioController, clock: Clock, n: int = 10) -> None:
    for _ in range(n):
        clock.t += 0.1
        c.observe(3.0, 0.01, True)  # TTFT misses, TPOT fine
    c.sample()


def test_adaptive_switch_then_cooldown_then_log(tmp_path: Path) -> None:
    asyncio.run(_test_adaptive_switch_then_cooldown_then_log(tmp_path))


async def _test_adaptive_switch_then_cooldown_then_log(tmp_path: Path) -> None:
    clock = Clock()
    pool = FakePool({"p:1": "prefill", "d:1": "decode", "d:2": "decode"})
    act = FakeActuator(pool)
    pool.set_load("d:1", num_running=3)
    c = RatioController(cfg(tmp_path), pool, act, clock=clock, wall_clock=clock)
    ttft_storm(c, clock)
    rec = await c.evaluate()
    assert rec is not None and rec.action == "switch" and rec.applied
    assert (rec.address, rec.to_role) == ("d:2", "prefill")
    await c.wait_idle()
    assert pool.roles() == {"p:1": "prefill", "d:1": "decode", "d:2": "prefill"}
    assert act.calls == [("switch", "d:2", "prefill")]
    # the window forgets what came before the change: too few requests now
    clock.t += 1
    c.sample()
    hold = await c.evaluate()
    assert hold is not None and hold.action == "hold"
    ttft_storm(c, clock)
    hold = await c.evaluate()
    assert hold is not None and hold.action == "hold" and "cooldown" in hold.reason
    lines = [json.loads(x) for x in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert [x["event"] for x in lines] == ["decision", "done", "decision", "decision"]
    done = lines[1]
    assert done["decision_seq"] == lines[0]["seq"] and done["applied"]
    assert (done["prefill_workers"], done["decode_workers"]) == (2, 1)
    assert lines[0]["inputs"]["ttft_attainment"] == 0.0 and lines[0]["inputs"]["requests"] == 10
    assert {w["address"] for w in lines[0]["inputs"]["workers"]} == {"p:1", "d:1", "d:2"}


def test_advisory_changes_nothing_but_logs_and_cools_down(tmp_path: Path) -> None:
    asyncio.run(_test_advisory_changes_nothing_but_logs_and_cools_down(tmp_path))


async def _test_advisory_changes_nothing_but_logs_and_cools_down(tmp_path: Path) -> None:
    clock = Clock()
    pool = FakePool({"p:1": "prefill", "d:1": "decode", "d:2": "decode"})
    act = FakeActuator(pool)
    c = RatioController(cfg(tmp_path, mode="advisory"), pool, act, clock=clock, wall_clock=clock)
    ttft_storm(c, clock)
    rec = await c.evaluate()
    assert rec is not None and rec.action == "switch" and not rec.applied
    assert act.calls == [] and pool.roles()["d:2"] == "decode"
    clock.t += 1.5
    ttft_storm(c, clock)
    again = await c.evaluate()
    assert again is not None and again.action == "hold" and "cooldown" in again.reason
    assert RatioController(cfg(mode="advisory"), pool, None, clock=clock).state.changes == 0


def test_failed_change_is_recorded_and_cools_down(tmp_path: Path) -> None:
    asyncio.run(_test_failed_change_is_recorded_and_cools_down(tmp_path))


async def _test_failed_change_is_recorded_and_cools_down(tmp_path: Path) -> None:
    clock = Clock()
    pool = FakePool({"p:1": "prefill", "d:1": "decode", "d:2": "decode"})
    act = FakeActuator(pool)
    act.fail = True
    c = RatioController(cfg(tmp_path), pool, act, clock=clock, wall_clock=clock)
    ttft_storm(c, clock)
    await c.evaluate()
    await c.wait_idle()
    failed = c.records[-1]
    assert failed.event == "failed" and not failed.applied and "injected failure" in failed.error
    assert pool.roles()["d:2"] == "decode" and c.state.pending is None
    assert c.state.last_change_end == clock.t


def test_run_loop_samples_evaluates_and_stops() -> None:
    asyncio.run(_test_run_loop_samples_evaluates_and_stops())


async def _test_run_loop_samples_evaluates_and_stops() -> None:
    pool = FakePool({"p:1": "prefill", "d:1": "decode", "d:2": "decode"})
    act = FakeActuator(pool, switch_delay_s=0.05)
    config = cfg(interval_s=0.05, sample_interval_s=0.01, window_s=5, cooldown_s=60)
    c = RatioController(config, pool, act)
    for _ in range(10):
        c.observe(3.0, 0.01, True)
    c.start()
    for _ in range(200):
        await asyncio.sleep(0.01)
        if any(r.event == "done" for r in c.records):
            break
    await c.stop()
    assert pool.roles()["d:2"] == "prefill" or pool.roles()["d:1"] == "prefill"
    assert [r.event for r in c.records if r.action != "hold"] == ["decision", "done"]


def test_fixed_mode_and_missing_actuator_are_refused() -> None:
    pool = FakePool({"p:1": "prefill"})
    with pytest.raises(ValueError, match="fixed"):
        RatioController(RatioConfig(), pool)
    with pytest.raises(ValueError, match="actuator"):
        RatioController(cfg(), pool, None)


def test_a_threshold_move_is_applied_logged_and_reverted_when_worse(tmp_path: Path) -> None:
    asyncio.run(_test_a_threshold_move_is_applied_logged_and_reverted_when_worse(tmp_path))


async def _test_a_threshold_move_is_applied_logged_and_reverted_when_worse(
    tmp_path: Path,
) -> None:
    clock = Clock()
    pool = FakePool({"p:1": "prefill", "d:1": "decode"})
    act = FakeActuator(pool)
    live = LiveThreshold(
        HybridConfig(local_prefill_max_tokens=64, max_local_prefill_max_tokens=256)
    )
    c = RatioController(
        cfg(tmp_path, min_requests=10), pool, act, clock=clock, wall_clock=clock, threshold=live
    )
    seen: list[str] = []
    c.on_decision = seen.append
    pool.set_load("p:1", num_running=1, num_waiting=4, waiting_tokens=400)  # a prefill queue
    c.sample()
    for _ in range(10):  # TTFT misses, TPOT met: prefill is the bottleneck, decode has slack
        c.observe(ttft_s=2.0, tpot_s=0.01, ok=True, e2e_s=2.1, path="remote")
    rec = await c.evaluate()
    assert rec is not None and (rec.action, rec.applied) == ("threshold", True)
    assert (rec.threshold_from, rec.threshold_to, live.value) == (64, 128, 128)
    assert act.calls == [] and seen == ["threshold"]  # no role moved
    done = c.records[-1]
    assert (done.event, done.decision_seq, done.local_prefill_max_tokens) == ("done", rec.seq, 128)
    logged = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert [(r["event"], r["threshold_to"]) for r in logged] == [("decision", 128), ("done", 128)]
    # a full window later, local prefills cost decode its TPOT: the raise is undone
    pool.set_load("p:1")
    clock.t += 11.0
    c.sample()
    for _ in range(10):
        c.observe(ttft_s=0.1, tpot_s=0.2, ok=True, e2e_s=1.0, path="local")
    back = await c.evaluate()
    assert back is not None and back.action == "threshold" and "revert" in back.reason
    assert (back.threshold_from, back.threshold_to, live.value) == (128, 64, 64)
