"""Shifting workloads, phase parsing, the ratio timeline's rolling attainment and change steps,
and the plan CLI's argument handling. Pure; runs in the pytest process."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from deploy.plan_cli import add_plan_parser
from deploy.profile_cli import add_profile_parser
from tooling.planner.costs import CostModel, Linear
from tooling.planner.timeline import plot_timeline, ratio_steps, rolling
from tooling.planner.workload import parse_phases, shifting, to_sim


def test_shifting_phases_run_back_to_back() -> None:
    specs = shifting([("chat", 4.0, 10.0), ("summarize", 2.0, 5.0)], context=512, seed=3)
    assert [s.index for s in specs] == list(range(len(specs)))
    chat = [s for s in specs if s.arrival_s < 10.0]
    summ = [s for s in specs if s.arrival_s >= 10.0]
    assert 20 <= len(chat) <= 60 and 3 <= len(summ) <= 20
    assert max(s.arrival_s for s in specs) < 15.0
    assert all(s.input_len >= 0.6 * 512 - 64 for s in summ)  # long prompts
    assert sum(s.input_len for s in chat) / len(chat) < 100
    assert shifting([("chat", 4.0, 10.0)], 512, seed=3) == chat  # phase 0 is its own draw
    sims = to_sim(specs)
    assert sims[5].arrival_s == specs[5].arrival_s and sims[5].input_len == specs[5].input_len


def test_parse_phases() -> None:
    assert parse_phases("chat:4:60, summarize:1.5:30") == [
        ("chat", 4.0, 60.0),
        ("summarize", 1.5, 30.0),
    ]
    with pytest.raises(ValueError, match="WORKLOAD:RATE:SECONDS"):
        parse_phases("chat:4")
    with pytest.raises(ValueError, match="phase 0"):
        shifting([("nope", 1.0, 1.0)], 512)


def test_rolling_attainment() -> None:
    pts = [(0.5, True), (1.5, False), (2.5, True), (3.5, True)]
    ts, ys = rolling(pts, window_s=2.0, step_s=1.0)
    # t=0.5: [T]; 1.5: [T, F]; 2.5: [F, T]; 3.5: [T, T]; 4.5: [T]
    assert ts == [0.5, 1.5, 2.5, 3.5, 4.5]
    assert ys == [1.0, 0.5, 0.5, 1.0, 1.0]
    assert rolling([], 1.0) == ([], [])


def test_ratio_steps_and_plot(tmp_path: Path) -> None:
    recs = [
        {"event": "decision", "action": "switch", "wall_time": 105.0},
        {
            "event": "done",
            "action": "switch",
            "address": "a:1",
            "to_role": "prefill",
            "wall_time": 107.5,
            "prefill_workers": 2,
            "decode_workers": 1,
        },
    ]
    steps = ratio_steps(recs, t0_wall=100.0, initial=(1, 2))
    assert steps == [(0.0, 1, 2, "start"), (7.5, 2, 1, "switch a:1 -> prefill")]
    series = {"1:2": [(1.0, True), (9.0, False)], "adaptive": [(1.0, True), (9.0, True)]}
    out = plot_timeline(series, steps, tmp_path / "t.png", phases=[(0.0, "chat"), (5.0, "sum")])
    assert out.stat().st_size > 1000


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    add_plan_parser(sub)
    add_profile_parser(sub)
    return p


def test_plan_cli_recommends_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cost = CostModel(prefill=Linear((0.002, 1e-4, 0.0)), decode=Linear((0.004, 1e-4, 0.0)))
    prof = cost.save(tmp_path / "prof.json")
    argv = ["plan", "--workload", "summarize", "--rate", "20", "--num-requests", "40"]
    argv += ["--slo-ttft-ms", "100", "--slo-tpot-ms", "50", "--workers", "3"]
    argv += ["--profile", str(prof), "--context", "512", "--cores", "0"]
    argv += ["--json", str(tmp_path / "plan.json")]
    args = _parser().parse_args(argv)
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "recommended: " in out and "| 1:2 |" in out and "| colocated x3 |" in out
    data = json.loads((tmp_path / "plan.json").read_text())
    disagg = [r for r in data["rows"] if r["mode"] == "disagg"]
    assert disagg[0]["ratio"] == "2:1" and data["requests"] == 40  # long prompts: more prefill
    assert data["recommended"] == data["rows"][0]
    assert {r["ratio"] for r in data["rows"]} == {"1:2", "2:1", "colocated x3"}
    # hybrid: every split with each threshold of the grid (the prompt-length quartiles)
    grid = data["hybrid_thresholds"]
    assert grid and all(t % 16 == 0 for t in grid)
    hybrid = {(r["ratio"], r["hybrid_threshold"]) for r in data["rows"] if r["mode"] == "hybrid"}
    assert hybrid == {(ratio, t) for ratio in ("1:2", "2:1") for t in grid}
    best = data["best_by_mode"]
    assert set(best) == {"colocated", "disagg", "hybrid"} and "best of each mode" in out
    top = max(b["value_rps"] for b in best.values())
    assert best[data["recommended"]["mode"]]["value_rps"] == top
    argv += ["--hybrid-thresholds", "64,128"]
    args = _parser().parse_args(argv)
    assert args.func(args) == 0
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["hybrid_thresholds"] == [64, 128]
    args = _parser().parse_args([*argv[:-2], "--no-hybrid"])
    assert args.func(args) == 0
    data = json.loads((tmp_path / "plan.json").read_text())
    assert (
        not any(r["mode"] == "hybrid" for r in data["rows"])
        and "hybrid" not in data["best_by_mode"]
    )


def test_plan_cli_rejects_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--slo-ttft-ms", "100", "--slo-tpot-ms", "50", "--profile", "missing.json"]
    args = _parser().parse_args([*base, "--workload", "chat", "--workers", "4"])
    assert args.func(args) == 2  # no --rate
    assert "--rate" in capsys.readouterr().err
    args = _parser().parse_args([*base, "--workload", "chat", "--rate", "1", "--workers", "1"])
    assert args.func(args) == 2
    with pytest.raises(SystemExit):
        _parser().parse_args([*base, "--workers", "2", "--chunk-tokens", "0"])
    args = _parser().parse_args(["profile", "--model", str(tmp_path), "--out", "x.json"])
    assert args.func(args) == 2
