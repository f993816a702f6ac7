"""`pdserve plan --search-rate` with `--seeds` and `--search-duration`: how many requests each
simulated rate sends, and the max rates it writes; `--long-prompt-slo` (per-class SLOs) in the
simulator's attainment and the CLI. Pure, a few seconds."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from deploy.plan_cli import request_maker
from tests.unit.planner_runs import plan_cli
from tooling.goodput.analysis import LongPromptSLO
from tooling.planner.costs import CostModel, Linear
from tooling.planner.profiles import Profile
from tooling.planner.sim_types import SimOutcome, attainment

COST = CostModel(prefill=Linear((0.010, 0.0005, 0.0)), decode=Linear((0.005, 0.0005, 0.0)))


def maker_args(num_requests: int, search_duration: float) -> argparse.Namespace:
    return argparse.Namespace(
        workload="chat",
        num_requests=num_requests,
        search_duration=search_duration,
        context=512,
        output_len=None,
    )


def test_each_rate_sends_at_least_the_search_duration_of_arrivals() -> None:
    make = request_maker(maker_args(10, 30.0), seed=0)
    assert len(make(2.0)) == 60  # 30 s at 2 req/s
    assert len(make(0.1)) == 10  # never fewer than --num-requests
    assert len(request_maker(maker_args(10, 0.0), seed=0)(2.0)) == 10  # off by default
    a, b = request_maker(maker_args(10, 0.0), 0)(2.0), request_maker(maker_args(10, 0.0), 1)(2.0)
    assert [r.input_len for r in a] != [r.input_len for r in b]  # each seed its own trace


def test_plan_search_rate_over_seeds_writes_a_max_rate_per_row(tmp_path: Path) -> None:
    prof = Profile(costs={1: COST, 2: COST}).save(tmp_path / "p.json")
    out = tmp_path / "plan.json"
    argv = ["--workload", "chat", "--rate", "2", "--num-requests", "10", "--slo-ttft-ms", "300",
            "--slo-tpot-ms", "50", "--profile", str(prof), "--cores", "0", "--workers", "2",
            "--chunk-tokens", "256", "--no-hybrid", "--search-rate", "--seeds", "2",
            "--search-duration", "4", "--json", str(out)]  # fmt: skip
    assert plan_cli(*argv) == 0
    doc = json.loads(out.read_text())
    assert doc["args"]["seeds"] == 2 and doc["args"]["search_duration"] == 4.0
    rates = [row["max_rate"] for row in doc["rows"]]
    assert rates and all(r is not None and r > 0 for r in rates)
    assert plan_cli(*argv[:-2], "--seeds", "0") == 2  # bad value: exit code 2


def test_sim_attainment_judges_long_prompts_by_their_own_slos() -> None:
    outs = [
        SimOutcome(ok=True, ttft_s=0.5, tpot_s=0.008, input_len=299),  # chat: TTFT misses
        SimOutcome(ok=True, ttft_s=0.5, tpot_s=0.008, input_len=300),  # long: TPOT misses
        SimOutcome(ok=True, ttft_s=0.5, tpot_s=0.004, input_len=300),  # long: meets both
        SimOutcome(ok=False, input_len=300),  # failed: misses both
    ]
    assert attainment(outs, 0.1, 0.01) == (0.0, 0.75, 0.0)
    assert attainment(outs, 0.1, 0.01, LongPromptSLO(300, 1000.0, 5.0)) == (0.5, 0.5, 0.25)


def test_plan_long_prompt_slo_changes_the_verdict_of_the_long_prompts(tmp_path: Path) -> None:
    prof = Profile(costs={1: COST, 2: COST}).save(tmp_path / "p.json")
    argv = ["--workload", "mixed", "--rate", "0.5", "--num-requests", "40", "--context", "512",
            "--slo-ttft-ms", "150", "--slo-tpot-ms", "50", "--profile", str(prof), "--cores",
            "0", "--workers", "2", "--chunk-tokens", "512", "--no-hybrid"]  # fmt: skip
    att = {}
    for name, extra in (("one", []), ("classes", ["--long-prompt-slo", "307:6000:50"])):
        assert plan_cli(*argv, *extra, "--json", str(tmp_path / f"{name}.json")) == 0
        rows = json.loads((tmp_path / f"{name}.json").read_text())["rows"]
        att[name] = {(r["mode"], r["chunk_tokens"]): r["ttft_attainment"] for r in rows}
    # a 307-435-token prompt takes 0.16-0.23 s to prefill here: over the 150 ms of one SLO
    # for every request, well inside the summarization class's 6000 ms
    assert att["one"].keys() == att["classes"].keys()
    for k in att["one"]:
        assert att["one"][k] <= 0.9 and att["classes"][k] >= 0.95
    assert plan_cli(*argv, "--long-prompt-slo", "307:6000") == 2  # malformed: exit code 2
    assert plan_cli(*argv, "--long-prompt-slo", "307:6000:50", "--adaptive") == 2
