"""The simulator's cluster-scale parts against hand-computable cases: colocated steps,
admission shedding, a drain that times out, the real controller on simulated
time, `pdserve simulate`'s outputs, pairs over two nodes, profiles. Pure, about a second."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from router.ratio.config import RatioConfig
from tooling.planner.costs import CostModel, Linear
from tooling.planner.pairing import Links, spread_nodes
from tooling.planner.profiles import EngineDefaults, Profile, load_profile
from tooling.planner.scale import ScaleSetup, run_scale
from tooling.planner.scale_report import write_scale_report
from tooling.planner.sim import ClusterSpec, Sim, SimRequest, simulate
from tooling.planner.sim_adaptive import simulate_adaptive
from tooling.planner.sim_workers import Job, Route

# prefill: 10 ms + 1 ms/token; decode: 5 ms + 1 ms/request; overhead 1 ms
COST = CostModel(
    prefill=Linear((0.010, 0.001, 0.0)),
    decode=Linear((0.005, 0.001, 0.0)),
    ttft_overhead=Linear((0.001, 0.0)),
)


def test_colocated_worker_prefills_then_decodes_in_mixed_steps() -> None:
    spec = ClusterSpec(0, 0, colocated=1, chunk_tokens=64)
    (o,) = simulate([SimRequest(0.0, 100, 3)], spec, COST)
    # chunks of 64 and 36 tokens (74 + 46 ms), first token 1 ms later; then 2 decode steps of
    # 6 ms, the first of which starts right after the prefill
    assert o.ttft_s == pytest.approx(0.121) and o.end_s == pytest.approx(0.132)
    # a second request's prompt shares the first's decode steps: they become mixed steps,
    # as slow as their prefill (max of the two models)
    outs = simulate([SimRequest(0.0, 10, 4), SimRequest(0.021, 60, 2)], spec, COST)
    assert outs[0].tpot_s is not None and outs[0].tpot_s > 0.006


def test_admission_queue_full_sheds_at_once() -> None:
    spec = ClusterSpec(prefill=1, decode=1, max_inflight=1, max_queued=1)
    outs = simulate([SimRequest(0.0, 100, 5)] * 3, spec, COST)
    assert [o.ok for o in outs] == [True, True, False]
    assert outs[2].ttft_s is None and outs[2].end_s == 0.0


def test_a_drain_past_its_timeout_aborts_what_is_left_then_flips() -> None:
    sim = Sim([SimRequest(0.0, 10, 200)], ClusterSpec(prefill=1, decode=2), COST)
    (d0, d1) = [w for w in sim.workers if w.kind == "decode"]

    def tick(s: Sim) -> None:
        held = next((w for w in (d0, d1) if w.jobs), None)
        if held is not None and not held.drain_to and held.kind == "decode" and s.now > 0.1:
            s.switch(held, "prefill", drain_timeout_s=0.2)

    sim.on_tick, sim.tick_s = tick, 0.05
    (o,) = sim.run()
    assert not o.ok and o.end_s == pytest.approx(0.35, abs=0.06)  # aborted at the timeout
    assert sim.aborted == 1 and sorted(w.kind for w in sim.workers) == [
        "decode",
        "prefill",
        "prefill",
    ]


def test_the_real_controller_runs_on_simulated_time() -> None:
    cfg = RatioConfig(mode="adaptive", slo_ttft_ms=1000, slo_tpot_ms=12, max_prefill=2,
                      max_decode=2, window_s=5, interval_s=1, cooldown_s=3, min_requests=5,
                      sample_interval_s=0.5)  # fmt: skip
    reqs = [SimRequest(0.2 * i, 300, 2) for i in range(100)]  # long prompts, 5/s
    res = simulate_adaptive(reqs, ClusterSpec(prefill=1, decode=2), COST, cfg)
    events = [(r.event, r.action, r.to_role) for r in res.records]
    assert ("decision", "switch", "prefill") in events and ("done", "switch", "prefill") in events
    done = next(r for r in res.records if r.event == "done")
    decided = next(r for r in res.records if r.seq == done.decision_seq)
    assert done.t >= decided.t and done.prefill_workers == 2  # simulated seconds, drained


def _toy_profile() -> Profile:
    cost = CostModel(prefill=Linear((0.002, 2e-5, 0.0)), decode=Linear((0.005, 5e-5, 1e-7)))
    return Profile(
        costs={1: replace(cost, meta={"layers": 4})},
        name="toy",
        device="gpu",
        engine=EngineDefaults(
            num_kv_blocks=4000, block_size=16, max_num_seqs=64, chunk_tokens=2048
        ),
        kv_bytes_per_token=1e5,
        cross_node_gbps=0.5,
        role_switch_s=0.5,
    )


def test_simulate_writes_its_json_report_and_plots(tmp_path: Path) -> None:
    setup = ScaleSetup(
        _toy_profile(), 4, "chat@1024:30:8,summarize@1024:10:8", slo_ttft_s=1.0,
        slo_tpot_s=0.02,
    )  # fmt: skip
    res = run_scale(setup)
    assert sorted(r.split for r in res.fixed) == ["1:3", "2:2", "3:1"]
    best = max(res.fixed, key=lambda r: r.goodput_rps)
    assert res.best_fixed_goodput == best.goodput_rps and res.best_fixed_split == best.split
    report = write_scale_report(res, tmp_path)
    data = json.loads((tmp_path / "simulation.json").read_text())
    for key in ("adaptive_goodput", "best_fixed_goodput", "best_fixed_split", "fixed_goodput"):
        assert key in data
    assert set(data["fixed_goodput"]) == {"1:3", "2:2", "3:1"}
    assert (tmp_path / "timeline.png").stat().st_size > 1000
    assert "Adaptive / best fixed split" in report.read_text()
    with pytest.raises(ValueError, match="add up to 4"):
        run_scale(replace(setup, policy="fixed:1:1"))
    with pytest.raises(ValueError, match="add up to 4"):
        run_scale(replace(setup, start="1:1"))


def test_pairs_stay_on_their_node_over_a_slow_link() -> None:
    assert spread_nodes(3, 2, 2) == ("n0", "n1", "n0", "n0", "n1")
    setup = ScaleSetup(_toy_profile(), 4, "summarize@2048:20:5", nodes=2, slo_ttft_s=1.0,
                       slo_tpot_s=0.05)  # fmt: skip
    res = run_scale(setup)
    pr = res.pairing
    assert pr["pair_aware"]["cross_node_share"] < 0.1 < pr["node_blind"]["cross_node_share"]
    assert pr["pair_aware"]["goodput_rps"] >= pr["node_blind"]["goodput_rps"]


def test_links_serialise_cross_node_moves_on_the_prefill_workers_link() -> None:
    sim = Sim([], ClusterSpec(prefill=1, decode=1, nodes=("a", "b")), COST)
    p, d = sim.workers
    links = Links(kv_bytes_per_token=1e6, cross_node_gbps=1.0, layers=10)  # 1 ms per token
    job = Job(
        0, SimRequest(0.0, 100, 2), d, Route.REMOTE, prefill=p
    )  # 0.1 s of link; 0.11 s of compute
    sim.now = 1.0  # the prefill ends: its push started with its compute, at 0.89 s
    assert links(sim, job) == pytest.approx(0.01)  # hidden but one layer
    assert links(sim, job) == pytest.approx(0.09)  # waits for the first move (done at 0.99)
    assert links.cross == 2 and links.cross_share == 1.0


def test_profiles_load_both_formats(tmp_path: Path) -> None:
    bare = COST.save(tmp_path / "bare.json")
    assert load_profile(bare).cost(1) == COST
    prof = _toy_profile()
    back = load_profile(prof.save(tmp_path / "doc.json"))
    assert back.cost(1).prefill == prof.cost(1).prefill and back.engine == prof.engine
    with pytest.raises(KeyError, match="no costs for 2 thread"):
        back.cost(2)
    shipped = load_profile(Path(__file__).parents[2] / "deploy/profiles/h100-llama3-8b.json")
    assert shipped.device == "gpu" and shipped.sources and shipped.derivation


def test_simulate_on_a_hybrid_cluster_controls_the_threshold(tmp_path: Path) -> None:
    """`pdserve simulate --hybrid START:MIN:MAX`: every split runs hybrid at START, and the
    adaptive run's controller owns the live threshold (its moves in `thresholds` and the
    report)."""
    setup = ScaleSetup(
        _toy_profile(), 4, "chat@1024:30:8,summarize@1024:10:8", slo_ttft_s=1.0,
        slo_tpot_s=0.02, hybrid="64:16:1024",
    )  # fmt: skip
    res = run_scale(setup)
    assert res.setup["hybrid"] == "64:16:1024"
    for split in ("1:3", "2:2", "3:1"):
        paths = {o.path for o in res.outcomes[split]}
        assert "local" in paths and "remote" in paths, (split, paths)
    assert res.thresholds and res.thresholds[0] == (0.0, 64)
    assert all(16 <= n <= 1024 for _, n in res.thresholds)
    report = write_scale_report(res, tmp_path).read_text()
    assert "Hybrid threshold of the adaptive run" in report
    for bad in ("64:16", "8:16:1024", "a:b:c"):
        with pytest.raises(ValueError, match="--hybrid"):
            run_scale(replace(setup, hybrid=bad))
