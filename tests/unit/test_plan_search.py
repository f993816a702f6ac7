"""`pdserve plan --search-rate` with `--seeds` and `--search-duration`: how many requests each
simulated rate sends, and the max rates it writes. Pure, a few seconds."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from deploy.plan_cli import request_maker
from tests.unit.planner_runs import plan_cli
from tooling.planner.costs import CostModel, Linear
from tooling.planner.profiles import Profile

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
