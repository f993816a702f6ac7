"""`pdserve plan --validate` on bench folders written here: a run replayed with the costs that
made it is predicted inside its band; one whose decode steps were slower is not, and the
diagnosis names the decode step; the CLI writes the report. Pure, well under a second."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.planner_runs import cluster_json, plan_cli, simulated_bench
from tooling.planner.costs import CostModel, Linear
from tooling.planner.profiles import Profile
from tooling.planner.sim import ClusterSpec, simulate
from tooling.planner.sim_types import SimRequest
from tooling.planner.validate import anchored_cost, load_cases, validate

COST = CostModel(prefill=Linear((0.010, 0.001, 0.0)), decode=Linear((0.005, 0.001, 0.0)))
SLOW_DECODE = CostModel(prefill=COST.prefill, decode=Linear((0.030, 0.001, 0.0)))
CLUSTER = cluster_json("disagg", 1, 1, 0, threads=1)


def bench_folder(path: Path, cost: CostModel, rate: float, probe: bool = False) -> Path:
    """A `pdserve bench` results.json whose one run's latencies are `cost`'s simulation;
    `probe`: with the bench's unloaded probe of the configuration (one request alone)."""
    reqs = [SimRequest(i / rate, 50 + 10 * (i % 5), 10) for i in range(30)]
    outs = simulate(reqs, ClusterSpec(1, 1), cost)
    meta = {}
    if probe:
        (alone,) = simulate([SimRequest(0.0, 60, 10)], ClusterSpec(1, 1), cost)
        assert alone.ttft_s is not None and alone.tpot_s is not None
        meta["unloaded"] = {
            "disagg": {
                "prompt_len": 60,
                "output_len": 10,
                "prefill_ms": alone.ttft_s * 1e3,
                "decode_ms": alone.tpot_s * 1e3,
            }
        }
    return simulated_bench(path, reqs, outs, "disagg", CLUSTER, rate, (200.0, 12.0), 10, **meta)


def test_runs_replayed_with_their_costs_fall_in_their_band(tmp_path: Path) -> None:
    dirs = [bench_folder(tmp_path / f"r{k}", COST, 5.0) for k in range(3)]
    (case,) = load_cases(dirs[0])
    assert case.spec.prefill == case.spec.decode == 1 and case.threads == 1
    v = validate(dirs, Profile(costs={1: COST}), machine_cores=None)
    (point,) = v.points
    assert len(point.runs) == 3 and point.inside and v.share_inside == 1.0
    assert point.predicted == pytest.approx(point.runs[0].measured["attainment"])


def test_a_slower_decode_than_modelled_is_outside_and_named(tmp_path: Path) -> None:
    dirs = [bench_folder(tmp_path / f"r{k}", SLOW_DECODE, 5.0) for k in range(2)]
    v = validate(dirs, Profile(costs={1: COST}), machine_cores=None)
    (point,) = v.points
    assert not point.inside and point.runs[0].measured["attainment"] == 0.0
    assert "TPOT" in point.diagnosis and "decode step" in point.diagnosis


def test_anchoring_to_the_unloaded_probe_scales_the_steps_to_the_environment(
    tmp_path: Path,
) -> None:
    """The runs decode 5x slower than the profile says, and so did the bench's own unloaded
    probe: anchored, the replay uses the probe's step costs and lands in the band."""
    dirs = [bench_folder(tmp_path / f"r{k}", SLOW_DECODE, 5.0, probe=True) for k in range(2)]
    plain = validate(dirs, Profile(costs={1: COST}), machine_cores=None)
    assert not plain.points[0].inside and plain.points[0].runs[0].scale is None
    v = validate(dirs, Profile(costs={1: COST}), machine_cores=None, anchor=True)
    (point,) = v.points
    assert point.inside and v.anchored
    prefill, decode = point.runs[0].scale or (0.0, 0.0)
    assert prefill == pytest.approx(1.0, abs=0.01)
    assert decode == pytest.approx(SLOW_DECODE.decode(1, 70) / COST.decode(1, 70), rel=0.05)
    cost, _ = anchored_cost(COST, ClusterSpec(1, 1), {"prompt_len": 60, "output_len": 10,
                                                      "prefill_ms": 1e3 * 0.07,
                                                      "decode_ms": 1e3 * 0.006})  # fmt: skip
    assert cost.prefill.coef == pytest.approx(COST.prefill.coef, rel=0.01)  # already right


def test_plan_validate_cli_writes_the_report(tmp_path: Path) -> None:
    d = bench_folder(tmp_path / "run", COST, 5.0)
    prof = Profile(costs={1: COST}).save(tmp_path / "p.json")
    report, out = tmp_path / "validation.md", tmp_path / "validation.json"
    assert plan_cli("--validate", str(d), "--profile", str(prof), "--cores", "0",
                    "--report", str(report), "--json", str(out)) == 0  # fmt: skip
    assert "1 of 1 points" in report.read_text()
    assert json.loads(out.read_text())["share_inside"] == 1.0


def test_a_run_with_a_long_prompt_slo_is_judged_by_it_on_both_sides(tmp_path: Path) -> None:
    reqs = [SimRequest(i / 5.0, 50 + 10 * (i % 5), 10) for i in range(30)]
    outs = simulate(reqs, ClusterSpec(1, 1), COST)
    slo = {"ttft_ms": 1.0, "tpot_ms": 1.0}  # nothing meets it
    long = {"min_prompt_tokens": 70, "ttft_ms": 5000.0, "tpot_ms": 500.0}  # 70-90: all meet
    path = simulated_bench(tmp_path / "r", reqs, outs, "disagg", CLUSTER, 5.0, (1.0, 1.0), 10,
                           slo=slo | {"long_prompt": long})  # fmt: skip
    (case,) = load_cases(path)
    assert case.slo.long_prompt is not None and case.slo.long_prompt.min_prompt_tokens == 70
    (point,) = validate([path], Profile(costs={1: COST}), machine_cores=None).points
    assert point.runs[0].measured["attainment"] == pytest.approx(0.6)  # 70, 80, 90 of 50..90
    assert point.predicted == pytest.approx(0.6) and point.inside
