"""The controller's evidence and step size at cluster scale: queues say which role requests wait
for, failures before a first token are not decode misses, KV held by requests queued for prefill
is not a decode shortage, consecutive switches the same way double the step (capped), a
multi-worker switch reverts whole, and the driver drains several workers side by side.
Pure (fake pool and clock); runs in the pytest process."""

from __future__ import annotations

import asyncio
from typing import Any

from router.ratio.config import RatioConfig
from router.ratio.controller import ControllerState, Decision, decide
from router.ratio.driver import RatioController
from router.ratio.metrics import MetricsAggregator, MetricsWindow, WorkerLoad
from tests.fakes.ratio_pool import FakeActuator, FakePool

CFG = RatioConfig(
    mode="adaptive",
    slo_ttft_ms=1000,
    slo_tpot_ms=50,
    max_prefill=15,
    max_decode=15,
    window_s=10,
    interval_s=2,
    cooldown_s=5,
    min_requests=10,
)


def window(p: int, d: int, ttft: float = 1.0, tpot: float = 1.0, **extra: Any) -> MetricsWindow:
    workers = [WorkerLoad(f"p{i}", "prefill", True, False, 0, 0, 1.0, 0.0) for i in range(p)]
    workers += [WorkerLoad(f"d{i}", "decode", True, False, 0, 0, 1.0, 0.2) for i in range(d)]
    fields: dict[str, Any] = dict(
        start=0.0,
        end=10.0,
        requests=200,
        ok=200,
        ttft_attainment=ttft,
        tpot_attainment=tpot,
        attainment=min(ttft, tpot),
        ttft_p90_ms=None,
        tpot_p90_ms=None,
        prefill_workers=p,
        decode_workers=d,
        prefill_waiting_tokens=0.0,
        prefill_requests=1.0,
        decode_kv_utilisation=0.2,
        decode_batch=1.0,
        decode_requests=1.0,
        workers=tuple(workers),
    )
    fields.update(extra)
    return MetricsWindow(**fields)


def test_ttft_misses_with_a_decode_queue_and_no_prefill_queue_mean_decode() -> None:
    # requests wait at admission for decode capacity: TTFT misses, the decode queue is long
    w = window(8, 8, ttft=0.2, tpot=1.0, decode_batch=256.0, decode_requests=400.0)
    d = decide(w, ControllerState(), 100.0, CFG)
    assert (d.action, d.to_role) == ("switch", "decode"), d.reason
    assert "requests wait for decode" in d.reason
    # the same misses with the longer queue (requests per worker) at prefill: prefill
    w = window(8, 8, ttft=0.2, tpot=1.0, prefill_waiting=300.0, decode_batch=256.0,
               decode_requests=400.0)  # fmt: skip
    assert decide(w, ControllerState(), 100.0, CFG).to_role == "prefill"
    # a short prefill queue beside a long decode one: still decode
    w = window(8, 8, ttft=0.2, tpot=1.0, prefill_waiting=3.0, decode_batch=256.0,
               decode_requests=400.0)  # fmt: skip
    assert decide(w, ControllerState(), 100.0, CFG).to_role == "decode"


def test_decode_kv_held_by_a_prefill_backlog_is_not_a_decode_shortage() -> None:
    w = window(8, 8, ttft=0.2, tpot=1.0, decode_kv_utilisation=0.99, prefill_waiting=40.0)
    assert decide(w, ControllerState(), 100.0, CFG).to_role == "prefill"
    w = window(8, 8, ttft=0.2, tpot=1.0, decode_kv_utilisation=0.99, prefill_waiting=0.0)
    assert decide(w, ControllerState(), 100.0, CFG).to_role == "decode"


def test_failures_before_a_first_token_are_not_decode_misses() -> None:
    agg = MetricsAggregator(window_s=10, slo_ttft_s=1.0, slo_tpot_s=0.05)
    for i in range(10):
        agg.observe(1.0 + i * 0.1, None, None, False)  # shed before any token
        agg.observe(1.0 + i * 0.1, 0.5, 0.01, True)
    w = agg.window(3.0)
    assert w.tpot_attainment == 0.5 and w.decode_attainment == 1.0 and w.ttft_attainment == 0.5


def test_steps_double_while_the_shortfall_lasts_within_the_caps() -> None:
    st = ControllerState()
    t, p, d = 100.0, 12, 4
    sizes = []
    for _ in range(4):
        dec = decide(window(p, d, ttft=1.0, tpot=0.3), st, t, CFG)
        assert dec.action == "switch" and dec.to_role == "decode", dec.reason
        moved = len(dec.addresses)
        sizes.append(moved)
        st.begin(dec, t)
        st.end(t + 3.0)
        p, d, t = p - moved, d + moved, t + 3.0 + CFG.cooldown_s
    # 1, 2, 4, then max_step (4) and half the donor role (6 // 2 = 3) cap it
    assert sizes == [1, 2, 4, 2], sizes
    # a pause longer than the cooldown allows resets the step
    dec = decide(window(p, d, ttft=1.0, tpot=0.3), st, t + 60.0, CFG)
    assert len(dec.addresses) == 1


def test_a_switch_is_judged_only_once_the_backlog_it_was_for_is_gone() -> None:
    move = Decision("switch", "x", address="d7", from_role="prefill", to_role="decode")
    st = ControllerState()
    st.begin(move, 100.0, window(9, 7, tpot=0.95))
    st.end(101.0)
    # requests still wait for decode (the queue built before): TTFT misses are not a reason
    # to give the worker back, and the switch is not judged yet
    backlog = window(8, 8, ttft=0.0, tpot=0.6, decode_batch=256.0, decode_requests=341.0)
    d = decide(backlog, st, 101.0 + CFG.window_s, CFG)
    assert not d.revert and st.last is move
    assert d.to_role == "decode" or d.action == "hold", d.reason


def test_a_multi_worker_switch_that_hurt_is_reverted_whole() -> None:
    move = Decision(
        "switch", "x", address="d6", from_role="prefill", to_role="decode", also=("d7",)
    )
    st = ControllerState()
    st.begin(move, 100.0, window(10, 6, tpot=0.7))
    st.end(101.0)
    after = window(8, 8, tpot=0.4)  # d6, d7 are decode workers now
    d = decide(after, st, 101.0 + CFG.window_s, CFG)
    assert d.revert and d.addresses == ("d6", "d7") and d.to_role == "prefill"


def test_driver_drains_every_worker_of_a_decision_side_by_side() -> None:
    asyncio.run(_drain_together())


async def _drain_together() -> None:
    clock = [1000.0]
    roles: dict[str, Any] = {f"p{i}": "prefill" for i in range(6)}
    roles |= {f"d{i}": "decode" for i in range(2)}
    pool = FakePool(roles)
    act = FakeActuator(pool, switch_delay_s=0.05)
    ctrl = RatioController(CFG, pool, act, clock=lambda: clock[0], wall_clock=lambda: clock[0])
    ctrl.state.streak = ("decode", 1)  # the last switch fed decode, just now
    ctrl.state.last_change_end = 996.0  # the cooldown (5 s) has just passed
    for _ in range(40):
        clock[0] += 0.05
        ctrl.observe(0.1, 0.2, True, e2e_s=0.05)  # TPOT misses
    ctrl.sample()
    rec = await ctrl.evaluate()
    assert rec is not None and rec.action == "switch" and len((rec.address, *rec.also)) == 2
    await ctrl.wait_idle()
    assert sum(r == "decode" for r in pool.roles().values()) == 4
    done = [r for r in ctrl.records if r.event == "done"]
    assert len(done) == 1 and done[0].decode_workers == 4
