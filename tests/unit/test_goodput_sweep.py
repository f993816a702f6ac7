"""Rate search: sweep then bisection, against synthetic attainment curves (pure)."""

from __future__ import annotations

import pytest

from tooling.goodput.sweep import RateSearch, run_interleaved


def step_curve(capacity: float):  # type: ignore[no-untyped-def]
    """Attainment 1 up to `capacity`, then falling linearly to 0 at 2x capacity."""
    return lambda rate: 1.0 if rate <= capacity else max(0.0, 1 - (rate - capacity) / capacity)


def drive(search: RateSearch, curve) -> list[float]:  # type: ignore[no-untyped-def]
    tried = []
    while (r := search.next_rate()) is not None:
        tried.append(r)
        search.record(r, curve(r))
        assert len(tried) < 50
    return tried


def test_bisection_converges_on_the_target_crossing() -> None:
    # attainment >= 0.9 up to rate 1.1 (capacity 1.0, then -10% per 0.1 req/s)
    search = RateSearch([0.5, 1.0, 1.5, 2.0], target=0.9, bisect_steps=6, min_gap=0.01)
    tried = drive(search, step_curve(1.0))
    assert tried[:4] == [0.5, 1.0, 1.5, 2.0]  # 1.5 fails, but not below give_up (0.5)
    res = search.result()
    assert res.rate == pytest.approx(1.1, abs=0.02)
    assert res.first_fail is not None and res.first_fail - res.rate <= 0.5 / 2**5 + 1e-9


def test_sweep_stops_early_after_a_collapse() -> None:
    search = RateSearch([1, 2, 3, 4, 5], target=0.9, bisect_steps=0, give_up=0.5)
    tried = drive(search, lambda r: 1.0 if r < 2 else 0.1)
    assert tried == [1, 2]
    assert search.result().rate == 1


def test_bisect_steps_bound_the_runs() -> None:
    search = RateSearch([1, 4], bisect_steps=2)
    tried = drive(search, step_curve(2.0))
    assert tried == [1, 4, 2.5, 1.75]


def test_all_failing_bisects_towards_zero() -> None:
    search = RateSearch([1.0], bisect_steps=2)
    assert drive(search, step_curve(0.2)) == [1.0, 0.5, 0.25]
    assert search.result().rate == 0.0


def test_bisection_stops_at_the_rate_floor() -> None:
    search = RateSearch([1.0, 2.0], bisect_steps=5)  # floor: 1.0 / 4
    assert drive(search, step_curve(0.01)) == [1.0, 0.5, 0.25]
    assert search.result().first_fail == 0.25


def test_all_passing_extends_upwards() -> None:
    search = RateSearch([1.0, 2.0], bisect_steps=2)
    assert drive(search, step_curve(100.0)) == [1.0, 2.0, 4.0, 8.0]
    assert search.result().lower_bound


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="rates"):
        RateSearch([])
    with pytest.raises(ValueError, match="target"):
        RateSearch([1.0], target=1.5)


def test_interleaving_rotates_the_order_and_counts_runs() -> None:
    curves = {"a": step_curve(1.0), "b": step_curve(3.0)}
    searches = {n: RateSearch([1.0, 2.0], bisect_steps=1) for n in curves}
    runs = run_interleaved(searches, lambda n, r, k: curves[n](r))
    assert runs[:4] == [("a", 1.0, 0), ("b", 1.0, 0), ("b", 2.0, 1), ("a", 2.0, 1)]
    assert [k for n, _, k in runs if n == "a"] == list(range(3))
    assert ("b", 4.0, 2) in runs  # b passed everything: one step upwards
    assert ("a", 1.5, 2) in runs
