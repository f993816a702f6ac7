"""`benchmarks.bench_llamacpp.tier_table` on a hand-made `results.json`: per SLO tier, each
configuration's max goodput by the shared rules (per seed, median and range) and its dips."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.bench_llamacpp import tier_table
from tooling.goodput.records import RequestRecord, RunResult


def run(config: str, seed: int, rate: float, ttft_ms: list[float]) -> dict[str, object]:
    records = [
        RequestRecord(i, f"r{i}", 0.0, 0.0, 100, 8, num_tokens=8, ttft_ms=t, tpot_ms=5.0)
        for i, t in enumerate(ttft_ms)
    ]
    return RunResult(config, rate, "poisson", seed, 0, records, 10.0, 0.0, 0.0).to_json()


def test_tiers_take_the_highest_passing_rate_per_seed_and_name_the_dip(tmp_path: Path) -> None:
    fast, slow = [100.0] * 10, [100.0] * 5 + [5000.0] * 5  # 100 % / 50 % in every tier
    curves = {0: (fast, slow, fast, slow), 1: (fast, fast, slow, slow), 2: (fast, fast, slow)}
    runs = [
        run("openai", seed, rate, ttfts)
        for seed, curve in curves.items()
        for rate, ttfts in zip((1.0, 2.0, 3.0, 4.0), curve, strict=False)
    ]
    (tmp_path / "results.json").write_text(json.dumps({"meta": {}, "runs": runs}))
    table, data = tier_table(tmp_path, 0.9)
    loose = data["tiers"]["loose"]["configs"]["openai"]
    # seed 0: 3 passes above the failing 2 (a dip, named); seeds 1 and 2: 2 -> median 2
    assert loose["max_goodput_rps"] == 2.0 and not loose["lower_bound"]
    assert loose["max_goodput"]["range"] == {"lo": 2.0, "hi": 3.0}
    row = "| loose (4000 / 250) | llama.cpp | 2 (2-3 over 3 repeats) | 100% | 100% | 50% | 50% |"
    assert row in table
    assert "- loose, llama.cpp, seed 0: 2 req/s (50.0%) missed the target below 3 req/s" in table
    assert data["seeds"] == [0, 1, 2] and len(data["non_monotone"]) == len(data["tiers"])
