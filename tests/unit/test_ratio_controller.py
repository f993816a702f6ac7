"""The ratio controller's pure core driven by scripted metric windows: which phase is the
bottleneck, switch vs add vs hold, bounds, hysteresis, cooldown, one change per interval,
scale-in. Pure, milliseconds; runs in the pytest process."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from router.ratio.config import RatioConfig
from router.ratio.controller import ControllerState, Decision, decide
from router.ratio.metrics import MetricsWindow, WorkerLoad

CFG = RatioConfig(
    mode="adaptive",
    slo_ttft_ms=1000,
    slo_tpot_ms=50,
    min_prefill=1,
    max_prefill=3,
    min_decode=1,
    max_decode=3,
    window_s=10,
    interval_s=2,
    cooldown_s=10,
    hysteresis=0.05,
    min_requests=10,
)
CFG0 = CFG.model_copy(update={"evidence_z": 0.0})


def window(
    ttft: float = 1.0,
    tpot: float = 1.0,
    both: float | None = None,
    p: int = 2,
    d: int = 2,
    requests: int = 50,
    kv: float = 0.2,
    load: dict[str, float] | None = None,
    draining: tuple[str, ...] = (),
    **extra: Any,
) -> MetricsWindow:
    """A scripted window: workers p0.. and d0..; `load[address]` = requests running."""
    load = load or {}
    workers = []
    for role, n in (("prefill", p), ("decode", d)):
        for i in range(n):
            a = f"{role[0]}{i}"
            workers.append(
                WorkerLoad(
                    a, role, a not in draining, a in draining, 0.0, 0.0, load.get(a, 1.0), kv
                )
            )
    pre = [w.requests for w in workers if w.role == "prefill"]
    dec = [w.requests for w in workers if w.role == "decode"]
    fields: dict[str, Any] = dict(
        start=0.0,
        end=10.0,
        requests=requests,
        ok=requests,
        ttft_attainment=ttft,
        tpot_attainment=tpot,
        attainment=min(ttft, tpot) if both is None else both,
        ttft_p90_ms=None,
        tpot_p90_ms=None,
        prefill_workers=p,
        decode_workers=d,
        prefill_waiting_tokens=0.0,
        prefill_requests=sum(pre) / max(len(pre), 1),
        decode_kv_utilisation=kv,
        decode_batch=sum(dec) / max(len(dec), 1),
        decode_requests=sum(dec) / max(len(dec), 1),
        workers=tuple(workers),
    )
    fields.update(extra)
    return MetricsWindow(**fields)


def run(w: MetricsWindow, cfg: RatioConfig = CFG, state: ControllerState | None = None) -> Decision:
    return decide(w, state or ControllerState(), 100.0, cfg)


def test_meeting_target_holds() -> None:
    d = run(window(ttft=0.97, tpot=0.95))
    assert d.action == "hold" and "meets target" in d.reason


def test_ttft_misses_move_the_least_loaded_decode_worker_to_prefill() -> None:
    d = run(window(ttft=0.5, tpot=0.97, load={"d0": 3.0, "d1": 1.0}))
    assert (d.action, d.address, d.from_role, d.to_role) == ("switch", "d1", "decode", "prefill")
    assert "TTFT miss 50%" in d.reason and "d1" in d.reason


def test_tpot_misses_move_a_prefill_worker_to_decode() -> None:
    d = run(window(ttft=0.96, tpot=0.6, load={"p0": 0.0, "p1": 2.0}))
    assert (d.action, d.address, d.to_role) == ("switch", "p0", "decode")


def test_kv_saturation_means_decode_even_when_ttft_misses() -> None:
    d = run(window(ttft=0.5, tpot=0.9, kv=0.95))
    assert d.action == "switch" and d.to_role == "decode"
    assert "KV utilisation 95%" in d.reason


def test_dead_band_holds() -> None:
    # 0.87 is below the 0.9 target but above target - hysteresis = 0.85
    d = run(window(ttft=0.87, tpot=1.0))
    assert d.action == "hold" and "dead band" in d.reason


def test_misses_within_hysteresis_of_each_other_hold() -> None:
    d = run(window(ttft=0.6, tpot=0.62, both=0.5))
    assert d.action == "hold" and "no clear bottleneck" in d.reason


def test_too_few_requests_hold() -> None:
    d = run(window(ttft=0.1, tpot=1.0, requests=9))
    assert d.action == "hold" and "min_requests=10" in d.reason


def test_needy_role_at_its_max_holds() -> None:
    d = run(window(ttft=0.2, tpot=1.0, p=3, d=1))
    assert d.action == "hold" and "max_prefill=3" in d.reason


def test_donor_at_its_min_holds() -> None:
    cfg = CFG.model_copy(update={"max_prefill": 4})
    d = run(window(ttft=0.2, tpot=1.0, p=3, d=1), cfg)
    assert d.action == "hold" and "decode at min_decode=1" in d.reason


def test_donor_missing_its_own_slo_is_not_robbed() -> None:
    d = run(window(ttft=0.2, tpot=0.8, both=0.2))
    assert d.action == "hold" and "decode misses its own SLO" in d.reason


def test_a_blocked_switch_holds_naming_the_bound() -> None:
    capped = run(window(ttft=0.2, tpot=0.8, both=0.2, p=3, d=2))
    assert capped.action == "hold" and "max_prefill=3" in capped.reason


def test_light_load_never_removes_a_worker() -> None:
    """The controller only switches roles; a lightly loaded role is left alone."""
    load = {"p0": 0.1, "p1": 0.3, "d0": 2.0, "d1": 2.0}
    d = run(window(ttft=1.0, tpot=1.0, load=load))
    assert d.action == "hold" and "meets target" in d.reason


def test_cooldown_and_one_change_per_interval() -> None:
    st = ControllerState()
    miss = window(ttft=0.3, tpot=1.0)
    first = decide(miss, st, 100.0, CFG)
    assert first.action == "switch"
    st.begin(first, 100.0)
    d = decide(miss, st, 101.0, CFG)
    assert d.action == "hold" and "in progress" in d.reason
    st.end(100.5)  # a fast switch: done within the interval
    d = decide(miss, st, 101.0, CFG)
    assert d.action == "hold" and "< interval_s" in d.reason
    d = decide(miss, st, 105.0, CFG)
    assert d.action == "hold" and "cooldown: 5.5s left" in d.reason
    assert decide(miss, st, 110.5, CFG).action == "switch"
    assert st.changes == 1


def test_draining_worker_holds() -> None:
    d = run(window(ttft=0.3, tpot=1.0, draining=("d0",)))
    assert d.action == "hold" and "draining: d0" in d.reason


def test_no_flapping_on_a_scripted_drift() -> None:
    """chat-like (TPOT misses) -> balanced -> summarize-like (TTFT misses): the controller
    moves toward decode, holds while balanced, then moves toward prefill; each change only
    after the cooldown, never two in one interval, never outside the bounds."""
    st, p, d, t = ControllerState(), 2, 2, 0.0
    script = [(1.0, 0.5)] * 12 + [(0.95, 0.95)] * 10 + [(0.4, 1.0)] * 20
    history = []
    for ttft, tpot in script:
        t += CFG.interval_s
        dec = decide(window(ttft=ttft, tpot=tpot, p=p, d=d), st, t, CFG)
        if dec.action == "switch":
            st.begin(dec, t)
            st.end(t + 1.0)
            p += 1 if dec.to_role == "prefill" else -1
            d += 1 if dec.to_role == "decode" else -1
            history.append((t, dec.to_role, p, d))
        assert 1 <= p <= 3 and 1 <= d <= 3
    assert [h[1:] for h in history] == [("decode", 1, 3), ("prefill", 2, 2), ("prefill", 3, 1)]
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(history)]
    assert all(g >= CFG.cooldown_s + 1.0 for g in gaps), gaps


def test_decisions_are_consistent() -> None:
    with pytest.raises(AssertionError):
        Decision("switch", "x", address="a")
    with pytest.raises(AssertionError):
        Decision("hold", "x", to_role="decode")


def test_weak_evidence_waits_for_more_requests() -> None:
    # 9 of 12 = 75%: below the band (85%), but one standard error (12.5%) reaches into it
    d = run(window(ttft=9 / 12, tpot=1.0, requests=12))
    assert d.action == "hold" and "sampling noise" in d.reason
    assert run(window(ttft=9 / 12, tpot=1.0, requests=12), CFG0).action == "switch"
    assert run(window(ttft=30 / 60, tpot=1.0, requests=60)).action == "switch"


def judged(before: MetricsWindow, after: MetricsWindow, move: Decision) -> Decision:
    """Decide on `after`, the first window after `move` (decided on `before`) completed."""
    st = ControllerState()
    st.begin(move, 100.0, before)
    st.end(101.0)
    return decide(after, st, 101.0 + CFG.cooldown_s, CFG)


# the moved worker keeps its address; `window` names workers by their role now (p0.., d0..)
TO_DECODE = Decision("switch", "x", address="d2", from_role="prefill", to_role="decode")
TO_PREFILL = Decision("switch", "x", address="p2", from_role="decode", to_role="prefill")


def test_a_switch_that_hurt_its_donor_is_reverted_and_barred() -> None:
    before = window(ttft=0.3, tpot=1.0, requests=40)
    after = window(ttft=0.6, tpot=0.5, p=3, d=1, requests=40)  # decode now misses TPOT
    d = judged(before, after, TO_PREFILL)
    assert (d.action, d.address, d.from_role, d.to_role, d.revert) == (
        "switch",
        "p2",
        "prefill",
        "decode",
        True,
    )
    assert "decode now misses its SLO (100% -> 50%)" in d.reason
    # the direction is barred: the next TTFT misses do not move a decode worker again
    st = ControllerState(tabu={("decode", "prefill"): 200.0})
    d = decide(window(ttft=0.3, tpot=1.0), st, 150.0, CFG)
    assert d.action == "hold" and "barred 50s more" in d.reason
    assert decide(window(ttft=0.3, tpot=1.0), st, 201.0, CFG).action == "switch"


def test_a_switch_to_decode_that_lowered_tpot_is_reverted() -> None:
    before = window(ttft=1.0, tpot=0.7, requests=40)
    after = window(ttft=1.0, tpot=0.4, p=1, d=3, requests=40)
    d = judged(before, after, TO_DECODE)
    assert d.revert and (d.address, d.to_role) == ("d2", "prefill")
    assert "TPOT attainment fell (70% of 40 -> 40% of 40)" in d.reason


def test_no_revert_on_noise_on_a_load_change_or_for_prefill_backlog() -> None:
    # 5/6 -> 4/6: one request; not evidence
    noisy = judged(
        window(ttft=1.0, tpot=5 / 6, requests=6),
        window(ttft=1.0, tpot=4 / 6, p=1, d=3, requests=6),
        TO_DECODE,
    )
    assert not noisy.revert
    # judged only on a full window after the change (window_s = 10 s), however short the
    # cooldown: at 105 s the switch stands (and rules 3-6 apply), at 112 s it is reverted
    quick = CFG.model_copy(update={"cooldown_s": 2.0})
    st = ControllerState()
    st.begin(TO_DECODE, 100.0, window(ttft=1.0, tpot=0.7, requests=40))
    st.end(101.0)
    after = window(ttft=1.0, tpot=0.4, p=1, d=3, requests=40)
    assert not decide(after, st, 105.0, quick).revert
    assert decide(after, st, 112.0, quick).revert
    # TTFT still missing after a switch to prefill (the queue built before) is not judged
    backlog = judged(
        window(ttft=0.6, tpot=1.0, requests=40),
        window(ttft=0.3, tpot=1.0, p=3, d=1, requests=40),
        TO_PREFILL,
    )
    assert not backlog.revert
    off = CFG.model_copy(update={"revert_worse": False})
    st = ControllerState()
    st.begin(TO_DECODE, 100.0, window(ttft=1.0, tpot=0.7, requests=40))
    st.end(101.0)
    d = decide(window(ttft=1.0, tpot=0.4, p=1, d=3, requests=40), st, 120.0, off)
    assert not d.revert
