"""`benchmarks.bench_modes`' pure parts on fixture data: max goodput per repeat and its median,
hybrid's ratio to the better fixed mode, the plan row -> configuration map, the planner verdict,
and the summary's tables. Milliseconds; no bench or plan runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.bench_modes import (
    WORKLOADS,
    WorkloadResult,
    bench,
    config_of_row,
    hybrid_ratio,
    hybrid_ratio_spread,
    markdown,
    max_goodputs,
    median_goodput,
    planner_verdict,
    points_of,
    repeat_seed,
)
from tooling.goodput.analysis import LongPromptSLO
from tooling.goodput.records import RequestRecord, RunResult
from tooling.goodput.workloads import WORKLOADS as WORKLOAD_LENGTHS
from tooling.goodput.workloads import summarize_min_prompt

# three repeats of one workload: (rate, attainment of both SLOs) per configuration
REPEATS: list[dict[str, list[tuple[float, float]]]] = [
    {
        "colocated": [(0.5, 1.0), (1.0, 0.95), (1.5, 0.7)],
        "disagg": [(0.5, 0.92), (1.0, 0.8), (1.5, 0.9)],  # 1.5 passes above a failure
        "hybrid": [(0.5, 1.0), (1.0, 0.9), (1.5, 0.95)],
    },
    {
        "colocated": [(0.5, 1.0), (1.0, 0.85), (1.5, 0.6)],
        "disagg": [(0.5, 0.8)],  # gave up after the first rate
        "hybrid": [(0.5, 1.0), (1.0, 0.92), (1.5, 0.88)],
    },
    {
        "colocated": [(0.5, 0.9), (1.0, 0.9), (1.5, 0.5)],
        "hybrid": [(0.5, 1.0), (1.0, 1.0), (1.5, 0.91)],  # disagg did not run
    },
]


def row(**kw: Any) -> dict[str, Any]:
    """A `pdserve plan --json` row (the fields `bench_modes` reads)."""
    base = dict(
        prefill=1, decode=1, chunk_tokens=256, chunked=True, colocated=0, hybrid_threshold=None
    )
    return base | kw


COLOCATED = row(prefill=0, decode=0, colocated=1, max_rate=0.9)
WHOLE = row(prefill=0, decode=0, colocated=1, chunked=False, chunk_tokens=544, max_rate=1.2)
DISAGG = row(max_rate=0.6)
HYBRID = row(hybrid_threshold=128, max_rate=1.1)


def test_max_goodput_per_repeat_is_the_highest_passing_rate_and_names_dips() -> None:
    got = max_goodputs(REPEATS, 0.9)
    assert {c: [m.rate for m in v] for c, v in got.items()} == {
        "colocated": [1.0, 0.5, 1.0],
        "disagg": [1.5, 0.0, 0.0],  # 1.5 above the failing 1.0 counts; repeat 3 did not run
        "hybrid": [1.5, 1.0, 1.5],
    }
    (dip,) = got["disagg"][0].dips
    assert (dip.failed_rate, dip.passed_rate) == (1.0, 1.5)
    assert got["disagg"][1].first_fail == 0.5 and got["disagg"][2].first_fail is None
    assert [median_goodput(v) for v in got.values()] == [1.0, 0.0, 1.5]
    assert median_goodput([]) == 0.0


def test_hybrid_ratio_is_over_the_better_fixed_mode() -> None:
    assert hybrid_ratio({"colocated": 1.0, "disagg": 0.5, "hybrid": 1.5}) == 1.5
    assert hybrid_ratio({"colocated": 0.4, "disagg": 0.8, "hybrid": 0.76}) == pytest.approx(0.95)
    assert hybrid_ratio({"colocated": 0.0, "disagg": 0.0, "hybrid": 0.5}) is None
    assert hybrid_ratio({"colocated": 1.0}) == 0.0  # hybrid not measured: 0 of the best
    # per repeat: hybrid over the better fixed mode of that repeat
    sp = hybrid_ratio_spread(max_goodputs(REPEATS, 0.9))
    assert sp is not None
    # repeat 1: both passed every rate (>= 1.5 each); 2: 1 / 0.5; 3: >= 1.5 over 1
    assert [v.text() for v in sp.values] == ["unknown", "2", ">= 1.5"]
    assert hybrid_ratio_spread({"hybrid": []}) is None


def test_plan_rows_map_to_the_measured_configurations_only() -> None:
    assert config_of_row(COLOCATED) == "colocated"
    assert config_of_row(WHOLE) is None  # colocated whole prompts: not benched
    assert config_of_row(row(prefill=0, decode=0, colocated=1, chunk_tokens=128)) is None
    assert config_of_row(DISAGG) == "disagg"
    assert config_of_row(HYBRID) == "hybrid"
    assert config_of_row(row(hybrid_threshold=336)) is None
    assert config_of_row(row(prefill=2, decode=1)) is None


def test_planner_verdict_judges_its_best_measured_choice_within_the_tolerance() -> None:
    medians = {"colocated": 1.0, "disagg": 0.5, "hybrid": 1.05}
    # ranked: whole prompts (not measured) first, then hybrid: the verdict is on hybrid
    got = planner_verdict([WHOLE, HYBRID, COLOCATED, DISAGG], medians, 0.10)
    assert (got.recommended, got.best_measured, got.verdict) == ("hybrid", "hybrid", "ok")
    assert got.top == "colocated x1 (whole prompts)"
    assert got.predicted == {"hybrid": 1.1, "colocated": 0.9, "disagg": 0.6}
    within = planner_verdict([COLOCATED, HYBRID], medians, 0.10)  # 1.0 / 1.05 = 0.952
    assert within.verdict == "ok" and within.recommended_vs_best == pytest.approx(1 / 1.05)
    miss = planner_verdict([DISAGG, HYBRID], medians, 0.10)
    assert (miss.verdict, miss.recommended_vs_best) == ("miss", pytest.approx(0.5 / 1.05))
    nothing = planner_verdict([HYBRID], {"colocated": 0.0, "disagg": 0.0, "hybrid": 0.0}, 0.1)
    assert (nothing.verdict, nothing.best_measured) == ("inconclusive", None)
    unmeasured = planner_verdict([WHOLE], medians, 0.10)
    assert (unmeasured.recommended, unmeasured.verdict) == (None, "not measured")


def test_points_of_a_results_json_are_attainments_per_configuration() -> None:
    def run(config: str, rate: float, ttfts: list[float]) -> dict[str, Any]:
        records = [
            RequestRecord(i, f"r{i}", 0.0, 0.0, 8, 4, num_tokens=4, ttft_ms=t, tpot_ms=10.0)
            for i, t in enumerate(ttfts)
        ]
        return RunResult(config, rate, "poisson", 0, 0, records, 10.0, 0.0, 0.0).to_json()

    results = {
        "meta": {"slo": {"ttft_ms": 100.0, "tpot_ms": 50.0}},
        "runs": [run("hybrid", 1.0, [50.0, 150.0]), run("hybrid", 0.5, [10.0, 20.0])],
    }
    assert points_of(results) == {"hybrid": [(0.5, 1.0), (1.0, 0.5)]}


def test_markdown_has_the_tables_and_the_verdicts() -> None:
    answers = max_goodputs(REPEATS, 0.9)
    curves = {"colocated": {0.5: [1.0, 1.0, 0.9]}, "hybrid": {0.5: [1.0, 1.0, 1.0]}}
    medians = {c: median_goodput(v) for c, v in answers.items()}
    check = planner_verdict([HYBRID, COLOCATED, DISAGG], medians, 0.1)
    result = WorkloadResult(
        WORKLOADS["mixed"], 0.9, ["runs/x/mixed-r1"], answers, curves, (30, 40), check
    )
    validation = {
        "margin": 0.05,
        "share_inside": 0.5,
        "points": [
            {"config": "hybrid", "inside": True, "runs": [{"source": "runs/x/mixed-r1"}]},
            {"config": "disagg", "inside": False, "runs": [{"source": "runs/x/mixed-r1"}]},
        ],
    }
    text = markdown([result], validation, "## header", 0.1)
    assert "| mixed (chat + 30 % summarize) | TTFT 1500 / TPOT 100 ms | 1 (1, 0.5, 1) | " in text
    row = "| 0 (>= 1.5, < 0.5, 0) | **1.5** (>= 1.5, 1, >= 1.5) | 1.50x (unknown, 2.00x, >= 1.50x)"
    assert row in text
    assert "- mixed, disagg, repeat 1: 1 req/s (80.0%) missed the target below 1.5 req/s" in text
    assert "every workload: **met**; >= 1.2x on at least one: **met**" in text
    assert "| hybrid 1:1 @128 (chunk 256) | 0.9 / 0.6 / 1.1 | hybrid | hybrid | 1.00 | ok |" in text
    assert "**1 of 2 points (50%) inside the measured band**" in text
    assert "| hybrid | 1/1 |" in text and "| disagg | 0/1 |" in text
    assert "| colocated | 100% |" in text and "| disagg | — |" in text


def test_each_repeat_runs_its_own_trace_and_a_kept_run_must_match_it(tmp_path: Path) -> None:
    assert [repeat_seed(5, k) for k in (1, 2, 3)] == [5, 6, 7]
    kept = tmp_path / "mixed-r2"
    kept.mkdir()
    (kept / "results.json").write_text(json.dumps({"meta": {"config": {"seed": 0}}}))
    args = argparse.Namespace()  # a kept run starts nothing, so no flag is read
    assert bench(WORKLOADS["mixed"], kept, 0, args) == 0.0
    with pytest.raises(SystemExit, match="trace seed 0, not 1"):
        bench(WORKLOADS["mixed"], kept, 1, args)


def test_mixed_classes_judges_each_application_by_its_own_slos() -> None:
    w = WORKLOADS["mixed-classes"]
    flags = w.bench_flags()
    assert flags[flags.index("--workload") + 1] == "mixed"  # the same requests as mixed
    assert flags[flags.index("--long-prompt-slo") + 1] == "307:6000:85"
    chat, summarize = WORKLOADS["chat"], WORKLOADS["summarize"]
    assert (w.ttft_slo_ms, w.tpot_slo_ms) == (chat.ttft_slo_ms, chat.tpot_slo_ms)
    lp = LongPromptSLO.parse(w.long_prompt_slo or "")
    assert (lp.ttft_ms, lp.tpot_ms) == (summarize.ttft_slo_ms, summarize.tpot_slo_ms)
    assert "prompts >= 307: 6000 / 85 ms" in w.slo_text()
    assert WORKLOADS["mixed"].slo_flags() == []


def test_the_long_prompt_class_of_mixed_is_exactly_its_summarization_prompts() -> None:
    rng = np.random.default_rng(0)
    context = WORKLOADS["mixed-classes"].context
    cut = summarize_min_prompt(context)
    chat = WORKLOAD_LENGTHS["chat"].lengths(rng, 2000, context)
    summarize = WORKLOAD_LENGTHS["summarize"].lengths(rng, 2000, context)
    assert max(r[0] for r in chat) < cut <= min(r[0] for r in summarize)


def test_points_of_judges_by_the_runs_long_prompt_slo() -> None:
    records = [
        RequestRecord(0, "r0", 0.0, 0.0, 8, 4, num_tokens=4, ttft_ms=500.0, tpot_ms=10.0),
        RequestRecord(1, "r1", 0.0, 0.0, 400, 4, num_tokens=4, ttft_ms=500.0, tpot_ms=10.0),
    ]
    run = RunResult("hybrid", 1.0, "poisson", 0, 0, records, 10.0, 0.0, 0.0).to_json()
    slo = {"ttft_ms": 300.0, "tpot_ms": 240.0}
    long = {"min_prompt_tokens": 307, "ttft_ms": 6000.0, "tpot_ms": 85.0}
    assert points_of({"meta": {"slo": slo}, "runs": [run]}) == {"hybrid": [(1.0, 0.0)]}
    classes = {"meta": {"slo": slo | {"long_prompt": long}}, "runs": [run]}
    assert points_of(classes) == {"hybrid": [(1.0, 0.5)]}
