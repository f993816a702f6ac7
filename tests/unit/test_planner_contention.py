"""Contended multi-thread steps in the simulator's CPU model (`sim_cpu`), the cost model's
choice of efficiency (`CostModel.contended_eff`) and the fit of the efficiencies to saved bench
runs (`fit_contention`, `pdserve plan --validate --fit-contention`). Pure, about a second."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tests.unit.planner_runs import cluster_json, plan_cli, simulated_bench
from tooling.planner.costs import CostModel, Linear
from tooling.planner.fit_contention import fit_contention
from tooling.planner.profiles import Profile, load_profile
from tooling.planner.sim import ClusterSpec, simulate
from tooling.planner.sim_cpu import SharedCpu
from tooling.planner.sim_types import SimRequest
from tooling.planner.sim_workers import Entity


def run_until_idle(cpu: SharedCpu) -> dict[str, float]:
    """Real time at which each entity finishes."""
    now, done = 0.0, {}
    while (t := cpu.next_time(now)) != float("inf"):
        cpu.advance(t - now)
        now = t
        for w in cpu.finished():
            done[w.kind] = now
    return done


@pytest.mark.parametrize(("efficiency", "step_end"), [(1.0, 1.15), (0.5, 1.30)])
def test_a_contended_step_turns_only_part_of_its_share_into_progress(
    efficiency: float, step_end: float
) -> None:
    """A 2-thread step of 1 s and 0.3 s of host work on 2 cores: 3 threads, 2/3 each, so the host
    is done at 0.45 s; by then the step made 0.45 * 2/3 * efficiency; it runs the rest alone."""
    cpu = SharedCpu(2.0)
    step, host = Entity("step", 0), Entity("host", -1)
    cpu.busy(step, 1.0, 2.0, efficiency)
    cpu.busy(host, 0.3, 1.0)
    done = run_until_idle(cpu)
    assert done["host"] == pytest.approx(0.45)
    assert done["step"] == pytest.approx(step_end)
    assert cpu.demand == pytest.approx(0.0)


def test_efficiency_is_ignored_without_shared_cores_and_on_spare_cores() -> None:
    cpu = SharedCpu(None)
    step, host = Entity("step", 0), Entity("host", -1)
    cpu.busy(step, 1.0, 2.0, 0.3)
    cpu.busy(host, 0.3, 1.0)
    assert run_until_idle(cpu) == pytest.approx({"host": 0.3, "step": 1.0})
    cpu = SharedCpu(4.0)  # 3 threads on 4 cores: nobody waits
    cpu.busy(step, 1.0, 2.0, 0.3)
    cpu.busy(host, 0.3, 1.0)
    assert run_until_idle(cpu) == pytest.approx({"host": 0.3, "step": 1.0})


def test_a_cancelled_contended_step_frees_its_threads_and_more_work_extends_it() -> None:
    cpu = SharedCpu(2.0)
    step, host = Entity("step", 0), Entity("host", -1)
    cpu.busy(step, 1.0, 2.0, 0.5)
    cpu.busy(step, 0.5, 2.0, 0.5)  # more work for the same entity: 1.5 s in all
    assert run_until_idle(cpu) == pytest.approx({"step": 1.5})
    cpu.busy(step, 1.0, 2.0, 0.5)
    cpu.busy(host, 0.3, 1.0)
    cpu.cancel(step)
    assert cpu.demand == pytest.approx(1.0)
    assert run_until_idle(cpu) == pytest.approx({"host": 0.3})


COST = CostModel(
    prefill=Linear((0.010, 0.001, 0.0)),
    decode=Linear((0.005, 0.0005, 0.0)),
    host_request_s=0.004,
    host_token_s=0.002,
)


def test_the_step_takes_the_efficiency_of_the_part_that_dominates_it() -> None:
    cost = replace(COST, contended_prefill_eff=0.6, contended_decode_eff=0.9)
    assert cost.contended_eff([], 8, 800) == 0.9  # decode only
    assert cost.contended_eff([(0, 100)], 0, 0) == 0.6  # prompt only
    assert cost.contended_eff([(0, 100)], 2, 200) == 0.6  # 0.112 s of arithmetic > 0.006 s
    slow_decode = replace(cost, decode=Linear((0.5, 0.0, 0.0)))
    assert slow_decode.contended_eff([(0, 4)], 2, 200) == 0.9
    back = CostModel.from_json(json.loads(json.dumps(cost.to_json())))
    assert (back.contended_prefill_eff, back.contended_decode_eff) == (0.6, 0.9)
    old = {k: v for k, v in cost.to_json().items() if not k.startswith("contended")}
    assert CostModel.from_json(old).contended_prefill_eff == 1.0  # profiles from before


def colocated_bench(path: Path, cost: CostModel, rate: float, threads: int = 2) -> Path:
    """A `pdserve bench` folder with one run of a colocated worker of `threads` threads on 2
    cores, whose latencies are `cost`'s simulation."""
    reqs = [SimRequest(i / rate, 60 + 40 * (i % 4), 12) for i in range(40)]
    spec = ClusterSpec(prefill=0, decode=0, colocated=1, threads=threads, cores=2.0)
    outs = simulate(reqs, spec, cost)
    cluster = cluster_json("colocated", 0, 0, 1, threads)
    return simulated_bench(path, reqs, outs, "colocated", cluster, rate, (300.0, 30.0), 12)


def test_the_fit_recovers_the_efficiency_the_runs_were_made_with(tmp_path: Path) -> None:
    made = replace(COST, contended_prefill_eff=0.6)
    dirs = [colocated_bench(tmp_path / f"r{rate:g}", made, rate) for rate in (4.0, 5.0, 6.0)]
    profile = Profile(costs={2: COST})
    fitted, rows = fit_contention(dirs, profile, 2.0, prefill_grid=(1.0, 0.8, 0.6, 0.4))
    best = rows[0]
    assert (best.prefill_eff, best.decode_eff) == (0.6, 1.0)
    assert best.inside == best.points == 3
    assert best.latency_err == pytest.approx(0.0, abs=1e-9) and best.attainment_err < 1e-9
    assert rows[-1].latency_err > 0.05  # the grid's far end is visibly wrong: the test can fail
    assert fitted.cost(2).contended_prefill_eff == 0.6
    assert profile.cost(2).contended_prefill_eff == 1.0  # the input is not changed
    one_thread = colocated_bench(tmp_path / "t1", COST, 5.0, threads=1)
    with pytest.raises(ValueError, match="multi-thread"):
        fit_contention([one_thread], Profile(costs={1: COST}), 2.0)


def test_plan_validate_fit_contention_writes_the_fitted_profile(tmp_path: Path) -> None:
    made = replace(COST, contended_prefill_eff=0.6)
    d = colocated_bench(tmp_path / "run", made, 6.0)
    prof = Profile(costs={2: COST}).save(tmp_path / "p.json")
    out, report = tmp_path / "fitted.json", tmp_path / "validation.md"
    assert plan_cli("--validate", str(d), "--profile", str(prof), "--cores", "2",
                    "--fit-contention", str(out), "--report", str(report)) == 0  # fmt: skip
    fitted = load_profile(out)
    assert fitted.cost(2).contended_prefill_eff == 0.6
    assert "--fit-contention" in fitted.derivation[-1]
    assert "1 of 1 points" in report.read_text()
