"""The hybrid threshold's online control (`router.ratio.threshold`), driven by scripted metric
windows: raise, lower, hold inside the dead band, bounds, hysteresis between the two miss rates,
revert when worse, one change per interval shared with role switches; the `LiveThreshold`
holder and the config bounds. Pure, milliseconds; runs in the pytest process."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from router.config import RouterConfig
from router.hybrid import HybridConfig, LiveThreshold
from router.ratio.config import RatioConfig
from router.ratio.controller import ControllerState, Decision, decide
from router.ratio.metrics import MetricsAggregator, MetricsWindow, WorkerLoad, samples_from_views
from router.ratio.threshold import decide_with_threshold, step, tabu_key
from router.views import WorkerView

CFG = RatioConfig(
    mode="adaptive",
    slo_ttft_ms=1000,
    slo_tpot_ms=50,
    max_prefill=3,
    max_decode=3,
    window_s=10,
    interval_s=2,
    cooldown_s=10,
    hysteresis=0.05,
    min_requests=10,
    evidence_z=0.0,
    tabu_s=60,
)
HYB = HybridConfig(
    local_prefill_max_tokens=64,
    min_local_prefill_max_tokens=16,
    max_local_prefill_max_tokens=256,
    threshold_step=2.0,
)


def window(
    ttft: float = 1.0,
    tpot: float = 1.0,
    requests: int = 50,
    prefill_waiting: float = 0.0,
    local: int = 0,
    p: int = 2,
    d: int = 2,
    **extra: Any,
) -> MetricsWindow:
    """A scripted window of workers p0.. and d0.. (one running request each)."""
    workers = [
        WorkerLoad(f"{role[0]}{i}", role, True, False, 0.0, 0.0, 1.0, 0.2)
        for role, n in (("prefill", p), ("decode", d))
        for i in range(n)
    ]
    fields: dict[str, Any] = dict(
        start=0.0,
        end=10.0,
        requests=requests,
        ok=requests,
        ttft_attainment=ttft,
        tpot_attainment=tpot,
        attainment=min(ttft, tpot),
        ttft_p90_ms=None,
        tpot_p90_ms=None,
        prefill_workers=p,
        decode_workers=d,
        prefill_waiting_tokens=100.0 * prefill_waiting,
        prefill_requests=1.0 + prefill_waiting,
        decode_kv_utilisation=0.2,
        decode_batch=1.0,
        decode_requests=1.0,
        workers=tuple(workers),
        prefill_waiting=prefill_waiting,
        local_requests=local,
    )
    fields.update(extra)
    return MetricsWindow(**fields)


TTFT_MISS: dict[str, Any] = dict(
    ttft=0.5, tpot=1.0, prefill_waiting=3.0
)  # prefill queued, decode has slack
TPOT_MISS: dict[str, Any] = dict(
    ttft=1.0, tpot=0.5, local=20
)  # decode misses; 20 requests went local


def ask(w: MetricsWindow, state: ControllerState, now: float, current: int = 64) -> Decision:
    return decide_with_threshold(w, state, now, CFG, HYB, current)


def done(state: ControllerState, d: Decision, now: float, before: MetricsWindow) -> None:
    """The driver's bookkeeping for an applied change."""
    state.begin(d, now, before)
    state.end(now)


def test_prefill_queue_with_decode_slack_raises_the_threshold_before_a_role_switch() -> None:
    w = window(**TTFT_MISS)
    assert decide(w, ControllerState(), 100.0, CFG).action == "switch"  # roles alone would
    d = ask(w, ControllerState(), 100.0)
    assert (d.action, d.threshold_from, d.threshold_to) == ("threshold", 64, 128)
    assert "raise local_prefill_max_tokens 64 -> 128" in d.reason
    assert "TTFT miss 50%" in d.reason and "decode has slack (100% TPOT attainment)" in d.reason


def test_local_prefill_stealing_decode_time_lowers_the_threshold() -> None:
    d = ask(window(**TPOT_MISS), ControllerState(), 100.0)
    assert (d.action, d.threshold_from, d.threshold_to) == ("threshold", 64, 32)
    assert "20 of 50 requests prefilled on their decode worker" in d.reason


def test_tpot_misses_without_local_requests_leave_the_threshold_to_the_roles() -> None:
    d = ask(window(ttft=1.0, tpot=0.5, local=0), ControllerState(), 100.0)
    assert (d.action, d.from_role, d.to_role) == ("switch", "prefill", "decode")
    assert "threshold 64: decode is the bottleneck but no request took the local path" in d.reason


def test_ttft_misses_without_decode_slack_do_not_raise() -> None:
    d = ask(window(ttft=0.5, tpot=0.8, prefill_waiting=3.0), ControllerState(), 100.0)
    assert d.action == "hold"
    assert "decode has no TPOT slack (80% TPOT attainment" in d.reason


def test_ttft_misses_without_a_prefill_queue_do_not_raise() -> None:
    d = ask(window(ttft=0.5, tpot=1.0, prefill_waiting=0.0), ControllerState(), 100.0)
    assert d.action != "threshold"
    assert "TTFT misses but no prefill queue" in d.reason


@pytest.mark.parametrize(
    ("ttft", "tpot", "expect"),
    [
        (0.93, 1.0, "meets target 90%"),
        (0.87, 1.0, "inside the dead band 85%..90%"),
        (0.60, 0.62, "within hysteresis 5% of each other"),  # no bottleneck
    ],
)
def test_holds_inside_the_band_and_without_a_clear_bottleneck(
    ttft: float, tpot: float, expect: str
) -> None:
    d = ask(window(ttft=ttft, tpot=tpot, prefill_waiting=3.0, local=20), ControllerState(), 100.0)
    assert d.action == "hold" and expect in d.reason and "threshold 64" in d.reason


def test_too_few_requests_hold() -> None:
    d = ask(window(requests=5, **TTFT_MISS), ControllerState(), 100.0)
    assert d.action == "hold" and "fewer than min_requests=10" in d.reason


def test_moves_are_clamped_to_the_bounds_then_stop() -> None:
    assert step(200, "raise", HYB) == 256 and step(256, "raise", HYB) == 256
    assert step(20, "lower", HYB) == 16 and step(16, "lower", HYB) == 16
    assert step(1, "raise", HYB.model_copy(update={"threshold_step": 1.01})) == 2  # >= 1 token
    d = ask(window(**TTFT_MISS), ControllerState(), 100.0, current=200)
    assert (d.threshold_from, d.threshold_to) == (200, 256)
    at_max = ask(window(**TTFT_MISS), ControllerState(), 100.0, current=256)
    assert at_max.action == "switch" and at_max.to_role == "prefill"  # the role switch stands
    assert "at max_local_prefill_max_tokens=256" in at_max.reason
    at_min = ask(window(**TPOT_MISS), ControllerState(), 100.0, current=16)
    assert at_min.action == "switch" and at_min.to_role == "decode"
    assert "at min_local_prefill_max_tokens=16" in at_min.reason


def test_one_change_per_interval_and_cooldown_across_both_knobs() -> None:
    state = ControllerState()
    w = window(**TTFT_MISS)
    moved = ask(w, state, 100.0)
    assert moved.action == "threshold"
    state.begin(moved, 100.0, w)
    pending = ask(w, state, 101.0, current=128)
    assert pending.action == "hold" and "change in progress: threshold 64 -> 128" in pending.reason
    state.end(100.5)
    assert "started 1.5s ago" in ask(w, state, 101.5, current=128).reason
    cooling = ask(window(**TPOT_MISS), state, 105.0, current=128)  # a role switch waits too
    assert cooling.action == "hold" and "cooldown: 5.5s left" in cooling.reason
    # after a role switch, the threshold waits for the same cooldown
    state2 = ControllerState()
    switch = decide(window(ttft=1.0, tpot=0.5), state2, 100.0, CFG)
    done(state2, switch, 100.0, window(ttft=1.0, tpot=0.5))
    assert "cooldown" in ask(window(**TPOT_MISS), state2, 105.0).reason


def test_a_raise_that_made_tpot_worse_is_reverted_and_barred() -> None:
    state = ControllerState()
    before = window(**TTFT_MISS)
    raised = ask(before, state, 100.0)
    done(state, raised, 100.0, before)
    assert state.last is raised
    # a full window later decode misses TPOT: 100% of 50 -> 70% of 50
    worse = window(ttft=0.9, tpot=0.7, local=30)
    early = ask(worse, state, 109.0, current=128)
    assert not early.revert and state.last is raised  # judged on a full window only
    back = ask(worse, state, 111.0, current=128)
    assert back.revert and (back.action, back.threshold_from, back.threshold_to) == (
        "threshold",
        128,
        64,
    )
    assert "TPOT attainment fell (100% of 50 -> 70% of 50)" in back.reason
    assert state.tabu[tabu_key("raise")] == 111.0 + CFG.tabu_s and state.last is None
    done(state, back, 111.0, worse)
    assert state.last is None  # a revert is not judged again
    barred = ask(window(**TTFT_MISS), state, 130.0)
    assert barred.action != "threshold" and "made it worse lately (41s more)" in barred.reason
    again = ask(window(**TTFT_MISS), state, 172.0)
    assert again.action == "threshold" and again.threshold_to == 128  # the bar ran out


def test_a_lower_that_made_ttft_worse_is_reverted() -> None:
    state = ControllerState()
    before = window(**TPOT_MISS)
    lowered = ask(before, state, 100.0)
    done(state, lowered, 100.0, before)
    back = ask(window(ttft=0.6, tpot=0.95, local=5), state, 111.0, current=32)
    assert back.revert and (back.threshold_from, back.threshold_to) == (32, 64)
    assert "TTFT attainment fell (100% of 50 -> 60% of 50)" in back.reason


def test_a_move_that_did_not_hurt_is_judged_and_kept() -> None:
    state = ControllerState()
    before = window(**TTFT_MISS)
    raised = ask(before, state, 100.0)
    done(state, raised, 100.0, before)
    d = ask(window(ttft=0.95, tpot=0.98), state, 111.0, current=128)
    assert d.action == "hold" and not d.revert
    assert state.last is None and not state.tabu


def test_no_revert_when_revert_worse_is_off() -> None:
    cfg = CFG.model_copy(update={"revert_worse": False})
    state = ControllerState()
    before = window(**TTFT_MISS)
    raised = decide_with_threshold(before, state, 100.0, cfg, HYB, 64)
    done(state, raised, 100.0, before)
    d = decide_with_threshold(window(ttft=0.9, tpot=0.7), state, 111.0, cfg, HYB, 128)
    assert not d.revert and d.action != "threshold" and state.last is None


def test_role_rule_two_ignores_a_threshold_move() -> None:
    """`controller.decide` alone never judges (or reverts) a threshold move."""
    state = ControllerState()
    before = window(**TTFT_MISS)
    raised = ask(before, state, 100.0)
    done(state, raised, 100.0, before)
    decide(window(ttft=0.9, tpot=0.7), state, 111.0, CFG)
    assert state.last is raised


def test_bounds_are_validated_and_the_holder_keeps_them() -> None:
    with pytest.raises(ValidationError, match="min_local_prefill_max_tokens <="):
        HybridConfig(local_prefill_max_tokens=512, max_local_prefill_max_tokens=256)
    with pytest.raises(ValidationError, match="min_local_prefill_max_tokens <="):
        HybridConfig(local_prefill_max_tokens=0, max_local_prefill_max_tokens=256)
    with pytest.raises(ValidationError, match="threshold_step"):
        HybridConfig(local_prefill_max_tokens=8, threshold_step=1.0)
    assert not HybridConfig(local_prefill_max_tokens=8).adaptive and HYB.adaptive
    live = LiveThreshold(HYB)
    assert live.value == 64 and live.config() is HYB
    live.set(128)
    assert live.value == 128 and live.config().local_prefill_max_tokens == 128
    assert live.config().max_local_prefill_max_tokens == 256 and live.changes == 1
    with pytest.raises(AssertionError):
        live.set(512)


def test_threshold_bounds_need_a_ratio_controller(tmp_path: Path) -> None:
    addrs: dict[str, Any] = dict(model_dir=tmp_path, prefill_addrs=("a:1",), decode_addrs=("b:2",))
    with pytest.raises(ValidationError, match=r"needs ratio\.mode 'adaptive' or 'advisory'"):
        RouterConfig(**addrs, hybrid=HYB)
    ok = RouterConfig(**addrs, hybrid=HYB, ratio=CFG)
    assert ok.hybrid.adaptive and ok.ratio.enabled


def test_reservations_receiving_kv_are_prefill_backlog_not_a_decode_queue() -> None:
    """1P:1D hybrid, prefill the bottleneck: the decode worker's only waiting requests are
    reservations receiving KV from the prefill worker (the prompts queued there). From the
    workers' status through the metric window to the decision, they are not a decode queue:
    decode has TPOT slack, so the threshold rises (counted as decode's queue, they made decode
    look queued and longer-queued than prefill, and the threshold never rose)."""
    agg = MetricsAggregator(window_s=10, slo_ttft_s=1.0, slo_tpot_s=0.05)
    for i in range(20):  # half miss TTFT (queued on P), every one meets TPOT
        agg.observe(90.0 + 0.1 * i, 0.5 if i % 2 else 3.0, 0.02, ok=True, e2e_s=1.0)
    p = WorkerView("p0", "p0", "prefill", True, False, num_running=1, num_waiting=4)
    p = replace(p, waiting_tokens=4000, total_blocks=100, free_blocks=60)
    d = WorkerView("d0", "d0", "decode", True, False, num_running=2, num_waiting=5)
    d = replace(d, num_receiving=5, total_blocks=100, free_blocks=60)
    agg.add_samples(99.0, samples_from_views([p, d], 99.0))
    w = agg.window(100.0)
    assert (w.decode_waiting, w.decode_receiving, w.prefill_waiting) == (0.0, 5.0, 4.0)
    got = ask(w, ControllerState(), 100.0)
    assert (got.action, got.threshold_from, got.threshold_to) == ("threshold", 64, 128), got
    assert "5.0 receiving KV" in got.reason
