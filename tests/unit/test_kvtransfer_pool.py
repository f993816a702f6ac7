"""`benchmarks.kvtransfer_pool`: pooled rep-by-rep ratios and the interval around their median."""

from __future__ import annotations

from typing import Any

from benchmarks.kvtransfer_pool import median_interval, pool


def _run(raw: list[float], xfer: list[float], paired: float) -> dict[str, Any]:
    band = {
        "tokens": 512,
        "raw_gloo_s": {"all": raw},
        "transfer_s": {"all": xfer},
        "vs_raw_gloo_paired": paired,
        "shm_vs_memcpy": 0.4,
    }
    return {"bandwidth": [band]}


def test_pool_takes_every_reps_ratio_from_every_run():
    runs = [_run([1.0, 2.0], [2.0, 2.0], 0.75), _run([3.0], [1.0], 3.0)]
    row = pool(runs)[512]
    assert sorted(row["ratios"]) == [0.5, 1.0, 3.0]
    assert row["paired"] == [0.75, 3.0] and row["shm_vs_memcpy"] == [0.4, 0.4]


def test_median_interval_brackets_the_median_and_narrows_with_more_reps():
    few = [float(x) for x in range(11)]
    many = [float(x % 11) for x in range(1100)]
    # n = 11: order statistics floor(5.5 - 1.645 * sqrt(11) / 2) = 2 and ceil(5.5 + 2.73) = 9
    assert median_interval(few) == (5.0, 2.0, 9.0)
    m2, lo2, hi2 = median_interval(many)
    assert m2 == 5.0 and lo2 == hi2 == 5.0  # 100 copies of each value: no doubt left
    assert median_interval([2.0]) == (2.0, 2.0, 2.0)
