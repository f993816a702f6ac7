"""The simulator with the real controller core in the loop: a role switch drains before it
flips, the controller follows a shifting workload both ways, and beats the fixed splits on it.
Pure, well under a second."""

from __future__ import annotations

from router.ratio.config import RatioConfig
from tooling.planner.costs import CostModel, Linear
from tooling.planner.sim import ClusterSpec, Sim, SimRequest, attainment, simulate
from tooling.planner.sim_adaptive import simulate_adaptive

# prefill 1 ms/token (a 300-token prompt: 0.3 s); decode 5 ms + 5 ms per request in the batch
COST = CostModel(prefill=Linear((0.0, 0.001, 0.0)), decode=Linear((0.005, 0.005, 0.0)))
CFG = RatioConfig(
    mode="adaptive",
    slo_ttft_ms=1000,
    slo_tpot_ms=12,
    max_prefill=2,
    max_decode=2,
    window_s=5,
    interval_s=1,
    cooldown_s=3,
    min_requests=5,
    sample_interval_s=0.5,
)


def test_switch_drains_then_flips() -> None:
    sim = Sim([SimRequest(0.0, 10, 50)], ClusterSpec(prefill=1, decode=2), COST)
    (d0, d1) = [w for w in sim.workers if w.kind == "decode"]

    def tick(s: Sim) -> None:
        held = next((w for w in (d0, d1) if w.jobs), None)
        if held is not None and s.now >= 0.1 and not held.drain_to and held.kind == "decode":
            s.switch(held, "prefill")

    sim.on_tick, sim.tick_s = tick, 0.05
    (o,) = sim.run()
    # the request that reserved blocks on the draining worker still decodes there, alone
    assert o.ok and o.tpot_s is not None and abs(o.tpot_s - 0.01) < 1e-9
    assert sorted(w.kind for w in sim.workers) == ["decode", "prefill", "prefill"]


def shifting() -> list[SimRequest]:
    """20 s of long outputs, 20 s of long prompts, 20 s of long outputs again. Long outputs
    every 0.25 s, 40 tokens each: alternating over two decode workers each runs alone (10 ms
    steps, within the 12 ms TPOT SLO); one decode worker runs them overlapped (>= 15 ms).
    Long prompts at 5/s: one prefill worker serves 3.3/s (its queue grows past the 1 s TTFT
    SLO), two serve 6.7/s."""
    chat = [SimRequest(0.25 * i, 10, 40) for i in range(80)]
    summ = [SimRequest(20.0 + 0.2 * i, 300, 2) for i in range(100)]
    chat2 = [SimRequest(40.0 + 0.25 * i, 10, 40) for i in range(80)]
    return chat + summ + chat2


def test_controller_follows_the_shift() -> None:
    res = simulate_adaptive(shifting(), ClusterSpec(prefill=1, decode=2), COST, CFG)
    kinds = [(round(t), p, d) for t, p, d, _ in res.changes]
    assert kinds[0] == (0, 1, 2)
    assert any(p == 2 and d == 1 and 20 < t < 40 for t, p, d in kinds), kinds  # for prompts
    assert kinds[-1][1:] == (1, 2) and kinds[-1][0] > 40, kinds  # and back for outputs
    assert all(d.action == "switch" for d in res.decisions)
    for d0, d1 in zip(res.decisions, res.decisions[1:], strict=False):
        assert d1.t - d0.t >= CFG.cooldown_s  # cooldown (and the drain) between changes


def test_adaptive_beats_every_fixed_split_on_a_shifting_workload() -> None:
    reqs = shifting()
    slo = (CFG.slo_ttft_s, CFG.slo_tpot_s)
    adaptive = attainment(simulate_adaptive(reqs, ClusterSpec(1, 2), COST, CFG).outcomes, *slo)
    fixed = [attainment(simulate(reqs, ClusterSpec(p, 3 - p), COST), *slo) for p in (1, 2)]
    assert adaptive[2] > max(f[2] for f in fixed) + 0.1, (adaptive, fixed)
