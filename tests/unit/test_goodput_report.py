"""`pdserve report` recomputes the headline from saved runs: each configuration's max goodput
per trace seed, the median and range over seeds, the ratio paired by seed, every non-monotone
point named with both rates, and summary.json keeping every repeat. Built on a hand-made
`results.json` (no cluster; the plots make it take about a second)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deploy.bench_cli import main as bench_cli_main
from tooling.goodput.records import RequestRecord, RunResult
from tooling.goodput.report import write_report

SLO = {"ttft_ms": 100.0, "tpot_ms": 10.0}
# (config, seed) -> {rate: requests meeting both SLOs, of 40}; 36 of 40 is exactly 90 %
CURVES: dict[tuple[str, int], dict[float, int]] = {
    ("colocated", 0): {0.5: 40, 0.63: 30, 0.4: 40},
    ("colocated", 1): {0.5: 34, 0.4: 38, 0.32: 40},  # passes 0.4 only
    ("colocated", 2): {0.5: 33, 0.4: 35, 0.63: 37, 0.79: 20},  # 0.63 passes above two misses
    ("disagg", 0): {1.0: 40, 1.26: 39, 1.59: 20},
    ("disagg", 1): {1.26: 40, 1.59: 10, 1.0: 40},
    ("disagg", 2): {1.26: 37, 1.59: 30, 1.0: 40},
}


def run(config: str, seed: int, rate: float, good: int) -> dict[str, Any]:
    records = [
        RequestRecord(i, f"r{i}", i / rate, i / rate, 300, 8, num_tokens=8,
                      ttft_ms=50.0 if i < good else 500.0, tpot_ms=5.0, e2e_ms=85.0)
        for i in range(40)
    ]  # fmt: skip
    return RunResult(config, rate, "poisson", seed, 0, records, 40 / rate, 1.0, 2.0).to_json()


def results() -> dict[str, Any]:
    meta = {
        "config": {"target": 0.9, "title": "t", "trace": None, "workload": "summarize",
                   "arrival": "poisson", "seed": 0, "bisect_steps": 0, "min_requests": 40},
        "machine": {"cpu_count": 2, "platform": "linux", "torch_version": "2",
                    "memory_bandwidth_gbs": 10.0, "matmul_gflops": 50.0},
        "model": {"path": "models/x"},
        "context": 512,
        "lengths": {k: 1.0 for k in ("input_mean", "output_mean", "input_p50", "output_p50",
                                     "input_max", "output_max")},
        "slo": SLO,
        "sweep_rates": [0.5],
        "search": {"grid": [0.32, 0.4, 0.5, 0.63, 0.79, 1.0, 1.26, 1.59], "seeds": [0, 1, 2],
                   "warm_start": True, "give_up": 0.5, "bisect_steps": 0},
    }  # fmt: skip
    runs = [run(c, s, rate, good) for (c, s), pts in CURVES.items() for rate, good in pts.items()]
    return {"meta": meta, "runs": runs}


def test_report_recomputes_medians_ranges_ratios_and_names_dips(tmp_path: Path) -> None:
    (tmp_path / "results.json").write_text(json.dumps(results()))
    summary = write_report(tmp_path)
    # colocated per seed: 0.5, 0.4, 0.63 -> median 0.5; disagg: 1.26, 1.26, 1.26
    assert [m.rate for m in summary.max_goodput["colocated"]] == [0.5, 0.4, 0.63]
    assert [m.rate for m in summary.max_goodput["disagg"]] == [1.26, 1.26, 1.26]
    assert "colocated 0.5 req/s (0.4-0.63 over 3 repeats)" in summary.headline
    # per seed 2.52x, 3.15x, 2.00x -> median 2.52x, range 2.00-3.15x
    assert "disagg/colocated = 2.52x (2.00x-3.15x over 3 repeats)" in summary.headline
    assert summary.warnings == [
        "colocated, seed 2: non-monotone: 0.4 req/s (87.5% of 40 requests) missed the target "
        "below 0.63 req/s (92.5% of 40 requests), which met it",
        "colocated, seed 2: non-monotone: 0.5 req/s (82.5% of 40 requests) missed the target "
        "below 0.63 req/s (92.5% of 40 requests), which met it",
    ]
    report = (tmp_path / "report.md").read_text()
    assert summary.headline in report and summary.warnings[0] in report
    assert "| disagg/colocated | **2.52x** | 2.00x-3.15x | 2.52x, 3.15x, 2.00x |" in report
    data = json.loads((tmp_path / "summary.json").read_text())
    col = data["series"]["colocated"]
    assert col["max_goodput_rps"] == 0.5
    assert [r["seed"] for r in col["repeats"]] == [0, 1, 2]
    assert [len(r["runs"]) for r in col["repeats"]] == [3, 3, 4]
    assert col["repeats"][2]["non_monotone"][0]["failed_rate"] == 0.4
    ratio = data["ratios"]["disagg/colocated"]
    assert ratio["median"] == {"lo": pytest.approx(2.52), "hi": pytest.approx(2.52)}
    assert len(ratio["repeats"]) == 3 and len(data["non_monotone"]) == 2
    # `pdserve report DIR` prints the same headline and the warnings
    assert bench_cli_main(["report", str(tmp_path)]) == 0


def test_a_run_from_before_repeats_is_one_repeat(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = results()
    del data["meta"]["search"]
    data["runs"] = [r for r in data["runs"] if r["seed"] == 0]
    (tmp_path / "results.json").write_text(json.dumps(data))
    assert bench_cli_main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "disagg/colocated = 2.52x (1 repeat)" in out and "warning" not in out


def test_a_spec_configuration_is_paired_with_its_base() -> None:
    from tooling.goodput.report import ratios
    from tooling.goodput.sweep import MaxGoodput

    def mg(rate: float) -> MaxGoodput:
        return MaxGoodput(rate=rate, first_fail=None, lower_bound=False)

    answers = {"disagg": {0: mg(1.0), 1: mg(2.0)}, "disagg-spec": {0: mg(1.26), 1: mg(2.0)}}
    r = ratios(answers)
    assert set(r) == {"disagg-spec/disagg"}
    assert r["disagg-spec/disagg"].text(lambda x: f"{x:.2f}x").startswith("= 1.13x")
