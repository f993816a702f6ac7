"""The simulated ratio controller moves the hybrid threshold online with the router's own
`decide_with_threshold` (`sim_adaptive`, `hybrid=`): a scripted overload of the prefill worker
with decode slack raises it, the next requests take the local path, and the decisions are the
router's records. Pure, about a second."""

from __future__ import annotations

import random

import pytest

from router.hybrid import HybridConfig
from router.ratio.config import RatioConfig
from tooling.planner.costs import CostModel, Linear
from tooling.planner.sim import ClusterSpec, SimRequest
from tooling.planner.sim_adaptive import simulate_adaptive

# prefill: 10 ms + 0.4 ms/token (a 64-token prompt ~36 ms); decode: 4 ms + 0.2 ms/request
COST = CostModel(
    prefill=Linear((0.010, 0.0004, 0.0)),
    decode=Linear((0.004, 0.0002, 0.0)),
    transfer=Linear((0.001, 0.0)),
    ttft_overhead=Linear((0.001, 0.0)),
)
# 1 prefill + 4 decode workers; the bounds allow no role switch that keeps a prefill worker
# and three decode workers, so the threshold is the controller's only knob
SPEC = ClusterSpec(
    1,
    4,
    chunk_tokens=256,
    max_num_seqs=32,
    num_kv_blocks=2000,
    max_inflight=200,
    hybrid_threshold=16,
)
RATIO = RatioConfig(
    mode="adaptive",
    slo_ttft_ms=100,
    slo_tpot_ms=50,
    min_prefill=1,
    max_prefill=1,
    min_decode=3,
    max_decode=4,
    window_s=2.0,
    min_requests=10,
    interval_s=1.0,
    cooldown_s=1.0,
    sample_interval_s=0.25,
)
# no spill (a short prompt sent to P while D has more work): the threshold alone picks the path
HYBRID = HybridConfig(
    local_prefill_max_tokens=16,
    min_local_prefill_max_tokens=8,
    max_local_prefill_max_tokens=128,
    spill_to_prefill=False,
)


def _requests() -> list[SimRequest]:
    """64-token prompts at 40 req/s: more than the prefill worker's ~36 req/s."""
    rng = random.Random(0)
    t, out = 0.0, []
    for _ in range(600):
        t += rng.expovariate(40.0)
        out.append(SimRequest(t, 64, 8))
    return out


def test_prefill_overload_with_decode_slack_raises_the_threshold_to_the_local_path() -> None:
    reqs = _requests()
    res = simulate_adaptive(reqs, SPEC, COST, RATIO, hybrid=HYBRID)
    # the router's decisions: raises by threshold_step (x2) until the prompts fit
    assert res.thresholds[0] == (0.0, 16)
    assert [v for _, v in res.thresholds] == [16, 32, 64]
    moves = [r for r in res.decisions if r.action == "threshold"]
    assert [(r.threshold_from, r.threshold_to) for r in moves] == [(16, 32), (32, 64)]
    assert all("raise local_prefill_max_tokens" in r.reason for r in moves)
    assert not [r for r in res.decisions if r.action == "switch"]
    # the live threshold reached the path decision: requests routed after the move to 64
    # prefilled on their decode worker, those before it on the prefill worker
    t64 = res.thresholds[-1][0]
    before = [o.path for r, o in zip(reqs, res.outcomes, strict=True) if r.arrival_s < 2.0]
    after = [o.path for r, o in zip(reqs, res.outcomes, strict=True) if r.arrival_s > t64 + 1]
    assert set(before) == {"remote"}
    assert after and set(after) == {"local"}


def test_a_fixed_hybrid_threshold_stays_put() -> None:
    reqs = _requests()
    res = simulate_adaptive(reqs, SPEC, COST, RATIO)  # no bounds given: roles only
    assert res.thresholds == []
    assert {o.path for o in res.outcomes} == {"remote"}  # 64 > 16, always


def test_threshold_control_needs_its_bounds() -> None:
    with pytest.raises(ValueError, match="max_local_prefill_max_tokens"):
        simulate_adaptive(
            _requests()[:5], SPEC, COST, RATIO, hybrid=HybridConfig(local_prefill_max_tokens=16)
        )
