"""A short end-to-end `pdserve bench` against real `tiny` clusters (router + worker processes).

Starts colocated and disaggregated 1P+1D clusters of the tiny model as local processes, runs a
two-rate sweep with the load generator in its own process (`give_up` 0: both rates run whatever
their attainment, which a busy machine decides), and checks that the report is valid:
every request succeeded, the server's TTFT breakdown came through, plots were written, and
every process started was stopped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from deploy.bench_cli import main as bench_cli_main
from deploy.tool_launchers import launch_cluster
from tooling.goodput.bench import BenchConfig, run_bench
from tooling.goodput.records import TIMING_FIELDS

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_bench_tiny_clusters_writes_a_valid_report(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = BenchConfig(
        out=out, model=tiny_model_dir, configs=("colocated", "disagg"), workload="summarize",
        context=256, output_len=8, rates=(2.0, 4.0), duration_s=2.0, min_requests=8,
        ttft_scale=20.0, tpot_scale=20.0, bisect_steps=0, num_kv_blocks=256, repeats=1,
        grid_below=0, grid_above=0, give_up=0.0,
    )  # fmt: skip
    summary = run_bench(cfg, launch=launch_cluster)
    data = json.loads((out / "results.json").read_text())
    runs = data["runs"]
    assert sorted((r["config"], r["rate"]) for r in runs) == [
        ("colocated", 2.0), ("colocated", 4.0), ("disagg", 2.0), ("disagg", 4.0)
    ]  # fmt: skip
    for run in runs:
        assert len(run["records"]) >= 8
        for rec in run["records"]:
            assert rec["status"] == "OK" and rec["num_tokens"] == 8, rec
            assert rec["input_len"] >= 0.6 * 256 - 8
            assert set(TIMING_FIELDS) <= set(rec["server"])
        assert run["send_lag_p99_ms"] >= 0.0
    disagg = [rec for r in runs if r["config"] == "disagg" for rec in r["records"]]
    assert all(rec["prefill_worker"] and rec["decode_worker"] for rec in disagg)
    assert all(rec["server"]["prefill_compute_ms"] > 0 for rec in disagg)
    calib = data["meta"]["calibration"]
    assert calib["config"] == "colocated" and calib["prefill_ms"] > 0 and calib["decode_ms"] > 0
    assert data["meta"]["slo"]["tpot_ms"] == pytest.approx(20 * calib["decode_ms"], abs=0.1)
    assert set(summary.max_goodput) == {"colocated", "disagg"}
    assert "disagg/colocated" in summary.headline
    report = (out / "report.md").read_text()
    assert summary.headline in report and "GFLOP/s" in report and "| disagg |" in report
    for png in ("attainment.png", "latency_cdf.png", "ttft_breakdown.png"):
        assert (out / png).stat().st_size > 1000
    pids = [p for c in data["meta"]["clusters"].values() for p in c["pids"]]
    assert len(pids) == 2 + 3 and not [p for p in pids if _alive(p)]
    # the CLI re-renders the saved run
    assert bench_cli_main(["report", str(out)]) == 0
