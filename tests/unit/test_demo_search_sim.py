"""`benchmarks.demo_search_sim`: the demo's search on a simulated curve finds the true ratio to
within a grid step, and its table has a row per case (pure; well under a second)."""

from __future__ import annotations

import random

import pytest

from benchmarks.demo_search_sim import CASES, main, one_demo


def test_one_simulated_demo_brackets_the_true_ratio() -> None:
    rng = random.Random(0)
    seconds, runs, median = one_demo(2.0, {"colocated": 0.8, "disagg": 2.0}, None, rng, 3.0, 80)
    assert median.exact and 2.5 / 2**0.5 <= median.lo <= 2.5 * 2**0.5  # true ratio 2.5
    assert 15 <= runs <= 30 and 80 + runs * 3 < seconds < 3600


def test_the_table_has_a_row_per_case(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--trials", "3"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(CASES)  # the header, then the cases
