"""Max goodput from tested rates and the rate search, against synthetic attainment curves
(pure, milliseconds): the highest passing tested rate wins, non-monotone points are named,
the rates around the answer are tested, bisection agrees with the tested points, and repeats
run repeat by repeat with configurations interleaved."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tooling.goodput.sweep import (
    Dip,
    Grid,
    MaxGoodput,
    RateSearch,
    max_goodput,
    run_interleaved,
    run_repeats,
)

Curve = Callable[[float], float]


def step_curve(capacity: float) -> Curve:
    """Attainment 1 up to `capacity`, then falling linearly to 0 at 2x capacity."""
    return lambda rate: 1.0 if rate <= capacity else max(0.0, 1 - (rate - capacity) / capacity)


def drive(search: RateSearch, curve: Curve) -> list[float]:
    tried = []
    while (r := search.next_rate()) is not None:
        tried.append(r)
        search.record(r, curve(r))
        assert len(tried) < 50
    return tried


# ------------------------------------------------------------------------------ the answer


def test_max_goodput_is_the_highest_passing_rate_bracketed_by_the_first_failure_above() -> None:
    m = max_goodput([(1.0, 0.99), (2.0, 0.95), (3.0, 0.7), (4.0, 0.2)], 0.9)
    assert m == MaxGoodput(2.0, 3.0, False, ())
    m = max_goodput([(1.0, 0.95), (2.0, 0.96)], 0.9)
    assert (m.rate, m.first_fail, m.lower_bound) == (2.0, None, True)
    m = max_goodput([(1.0, 0.5), (2.0, 0.2)], 0.9)
    assert m == MaxGoodput(0.0, 1.0, False, ())  # below the lowest tested rate
    assert max_goodput([], 0.9) == MaxGoodput(0.0, None, False, ())


def test_a_failure_below_a_pass_never_silently_lowers_the_answer() -> None:
    # issue 42's run beside a busy loop: 2 misses in 12 at 0.50 req/s, 90 % at 0.99 req/s
    m = max_goodput([(0.25, 1.0), (0.5, 0.833), (0.99, 0.9), (1.98, 0.4)], 0.9)
    assert (m.rate, m.first_fail, m.lower_bound) == (0.99, 1.98, False)
    assert m.dips == (Dip(0.5, 0.833, 0.99, 0.9),) and m.non_monotone
    text = m.dips[0].text(lambda rate: {0.5: 12, 0.99: 20}[rate])
    assert text == (
        "0.5 req/s (83.3% of 12 requests) missed the target below 0.99 req/s (90.0% of 20 "
        "requests), which met it"
    )
    # two dips, each named with the lowest passing rate above it
    m = max_goodput([(1, 0.5), (2, 0.95), (3, 0.6), (4, 0.91), (5, 0.1)], 0.9)
    assert m.rate == 4 and m.dips == (Dip(1, 0.5, 2, 0.95), Dip(3, 0.6, 4, 0.91))


# -------------------------------------------------------------------------------- the grid


def test_grid_extends_the_listed_rates_geometrically_within_its_steps() -> None:
    g = Grid((1.0, 3.0), step=2.0, below=2, above=1)
    assert g.points == (0.25, 0.5, 1.0, 3.0, 6.0)
    assert (g.next_above(1.0), g.next_above(6.0), g.next_below(0.25)) == (3.0, None, None)
    assert (g.next_below(2.0), g.next_above(0.3)) == (1.0, 0.5)
    assert g.on_grid(0.5) and not g.on_grid(0.75)
    walk = Grid((1.0,), step=2 ** (1 / 3), below=3, above=3)
    assert walk.points == pytest.approx([0.5, 0.629961, 0.793701, 1.0, 1.259921, 1.587401, 2.0])


@pytest.mark.parametrize(
    ("kw", "message"),
    [({"rates": ()}, "rates"), ({"rates": (1.0, -1.0)}, "rates"), ({"step": 1.0}, "step"),
     ({"below": -1}, "below")],
)  # fmt: skip
def test_bad_grids(kw: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"rates": (1.0,)} | kw
    with pytest.raises(ValueError, match=message):
        Grid(**args)  # type: ignore[arg-type]


def test_bad_searches() -> None:
    with pytest.raises(ValueError, match="target"):
        RateSearch(Grid((1.0,)), target=1.5)
    with pytest.raises(ValueError, match="bisect_steps"):
        RateSearch(Grid((1.0,)), bisect_steps=-1)
    with pytest.raises(ValueError, match="start"):
        RateSearch(Grid((1.0,)), start=0.0)


# ------------------------------------------------------------------------------ the search


def test_search_fed_a_non_monotone_curve_keeps_the_higher_pass_and_names_the_dip() -> None:
    """Issue 42's curve through the search itself: the sweep goes on past the marginal failure
    at 0.5, finds 0.99 passing, brackets it from above, bisects once between 0.99 and the
    failure, and reports the dip with both points."""
    curve = {0.25: 1.0, 0.5: 0.833, 0.99: 0.9, 1.98: 0.4, 1.485: 0.7}
    search = RateSearch(Grid((0.25, 0.5, 0.99), below=0, above=1), bisect_steps=1)
    assert drive(search, curve.__getitem__) == [0.25, 0.5, 0.99, 1.98, 1.485]
    res = search.result()
    assert (res.rate, res.first_fail) == (0.99, 1.485)
    assert res.dips == (Dip(0.5, 0.833, 0.99, 0.9),)


def test_walk_checks_the_rate_below_its_answer_and_reports_a_dip_there() -> None:
    grid = Grid((1.0,), step=2.0, below=3, above=3)
    curve = {1.0: 0.95, 2.0: 0.5, 0.5: 0.85}  # 0.5 misses below 1.0's pass
    search = RateSearch(grid, give_up=0.9)
    assert drive(search, curve.__getitem__) == [1.0, 2.0, 0.5]
    res = search.result()
    assert (res.rate, res.first_fail, res.dips) == (1.0, 2.0, (Dip(0.5, 0.85, 1.0, 0.95),))


def test_walk_climbs_while_passing_and_descends_while_nothing_passed() -> None:
    grid = Grid((1.0,), step=2.0, below=4, above=4)
    up = RateSearch(grid, give_up=0.9)
    assert drive(up, step_curve(4.0)) == [1.0, 2.0, 4.0, 8.0]  # 8 fails; 2 is below 4
    assert (up.result().rate, up.result().first_fail) == (4.0, 8.0)
    down = RateSearch(grid, give_up=0.9)
    assert drive(down, step_curve(0.2)) == [1.0, 0.5, 0.25, 0.125, 0.0625]  # then below it
    assert (down.result().rate, down.result().first_fail) == (0.125, 0.25)
    assert down.points_left() == 0 and down.next_start() == 0.125


def test_search_stops_at_the_floor_and_the_ceiling() -> None:
    grid = Grid((1.0, 2.0), step=2.0, below=2, above=2)
    floor = RateSearch(grid, bisect_steps=5)
    assert drive(floor, step_curve(0.01)) == [1.0, 0.5, 0.25]
    assert floor.result() == MaxGoodput(0.0, 0.25, False, ())
    assert floor.next_start() == 0.25  # a next repeat starts where this one ended
    ceiling = RateSearch(grid, bisect_steps=2)
    assert drive(ceiling, step_curve(100.0)) == [1.0, 2.0, 4.0, 8.0]
    assert ceiling.result().lower_bound and ceiling.next_start() == 8.0


def test_sweep_goes_past_a_marginal_failure_and_stops_at_a_collapse() -> None:
    grid = Grid((1, 2, 3, 4, 5), below=0, above=0)
    search = RateSearch(grid, give_up=0.5)
    assert drive(search, lambda r: 1.0 if r < 2 else (0.6 if r < 3 else 0.1)) == [1, 2, 3]
    assert search.result().rate == 1


def test_only_listed_rates_are_swept_past_a_marginal_failure() -> None:
    """Beyond the listed rates (a warm start under them here) the search climbs only while
    rates pass: a marginal failure there is the bracket."""
    grid = Grid((4.0, 8.0), step=2.0, below=4, above=2)
    search = RateSearch(grid, give_up=0.5, start=1.0)
    assert drive(search, {1.0: 0.6, 0.5: 1.0, 0.25: 1.0}.__getitem__) == [1.0, 0.5, 0.25]
    assert search.result() == MaxGoodput(0.5, 1.0, False, ())


def test_bisection_converges_on_the_target_crossing() -> None:
    # attainment >= 0.9 up to rate 1.1 (capacity 1.0, then -10% per 0.1 req/s)
    grid = Grid((0.5, 1.0, 1.5, 2.0))
    search = RateSearch(grid, target=0.9, bisect_steps=6, min_gap=0.01)
    tried = drive(search, step_curve(1.0))
    assert tried[:4] == [0.5, 1.0, 1.5, 2.0]  # 1.5 fails, but not below give_up (0.5)
    res = search.result()
    assert res.rate == pytest.approx(1.1, abs=0.02)
    assert res.first_fail is not None and res.first_fail - res.rate <= 0.5 / 2**5 + 1e-9


def test_bisect_steps_bound_the_runs_after_the_rate_below_is_tested() -> None:
    search = RateSearch(Grid((1, 4)), bisect_steps=2)
    assert drive(search, step_curve(2.0)) == [1, 4, 0.5, 2.5, 1.75]


@settings(max_examples=300, deadline=None)
@given(
    noise=st.lists(st.floats(-0.3, 0.3), min_size=40, max_size=40),
    capacity=st.floats(0.1, 10.0),
    start_index=st.integers(0, 8),
    bisect=st.integers(0, 3),
)
def test_the_answer_always_agrees_with_the_tested_points(
    noise: list[float], capacity: float, start_index: int, bisect: int
) -> None:
    """On noisy, non-monotone curves: the answer is the highest passing tested rate; unless it
    is a bound, a failing tested rate lies above it and a tested rate at or above its grid
    neighbour lies below it (the floor aside); every failure below it is named."""
    grid = Grid((1.0,), step=2 ** (1 / 3), below=6, above=6)
    start = grid.points[start_index]
    search = RateSearch(grid, bisect_steps=bisect, give_up=0.9, start=start)
    noisy: dict[float, float] = {}

    def curve(rate: float) -> float:
        base = step_curve(capacity)(rate)
        return noisy.setdefault(rate, min(1.0, max(0.0, base + noise[len(noisy)])))

    drive(search, curve)
    res = search.result()
    passing = [r for r, a in search.points.items() if a >= 0.9]
    assert res.rate == max(passing, default=0.0)
    if res.rate > 0:
        if not res.lower_bound:
            assert res.first_fail is not None and search.points[res.first_fail] < 0.9
        below = grid.next_below(res.rate)
        if below is not None:
            assert any(below <= r < res.rate for r in search.points)
        failed_below = sorted(r for r, a in search.points.items() if a < 0.9 and r < res.rate)
        assert [d.failed_rate for d in res.dips] == failed_below
    assert search.points_left() == 0


# ------------------------------------------------------------------------------- repeats


def test_interleaving_rotates_the_order() -> None:
    curves = {"a": step_curve(1.0), "b": step_curve(3.0)}
    searches = {n: RateSearch(Grid((1.0, 2.0)), bisect_steps=1) for n in curves}
    runs = run_interleaved(searches, lambda n, r: curves[n](r))
    assert runs[:4] == [("a", 1.0), ("b", 1.0), ("b", 2.0), ("a", 2.0)]
    assert ("b", 4.0) in runs  # b passed everything: one step upwards
    assert ("a", 0.5) in runs and ("a", 1.5) in runs  # a: the rate below, then bisection


def test_repeats_run_repeat_by_repeat_and_warm_start_from_the_last_answer() -> None:
    grid = Grid((1.0,), step=2.0, below=3, above=3)
    capacity = {"a": 2.0, "b": 0.5}
    ran: list[tuple[int, str, float]] = []
    ended: list[int] = []

    def new_search(name: str, k: int, previous: RateSearch | None) -> RateSearch:
        start = previous.next_start() if previous is not None else None
        return RateSearch(grid, give_up=0.9, start=start)

    def run_point(name: str, k: int, rate: float) -> float:
        ran.append((k, name, rate))
        return step_curve(capacity[name])(rate)

    out = run_repeats(["a", "b"], 3, new_search, run_point, lambda k, s: ended.append(k))
    assert ended == [0, 1, 2]
    assert [k for k, _, _ in ran] == sorted(k for k, _, _ in ran)  # repeat-major
    assert [s.result().rate for s in out["a"]] == [2.0, 2.0, 2.0]
    assert [s.result().rate for s in out["b"]] == [0.5, 0.5, 0.5]
    # repeat 0 walked from 1.0; repeats 1 and 2 start at the answer: three runs each
    assert [r for k, n, r in ran if n == "a" and k == 0] == [1.0, 2.0, 4.0]
    assert [r for k, n, r in ran if n == "a" and k == 1] == [2.0, 4.0, 1.0]
    assert [r for k, n, r in ran if n == "b" and k == 2] == [0.5, 1.0, 0.25]
    with pytest.raises(ValueError, match="repeats"):
        run_repeats(["a"], 0, new_search, run_point)


def test_points_left_estimates_what_a_search_still_needs() -> None:
    grid = Grid((1.0,), step=2.0, below=3, above=3)
    search = RateSearch(grid, give_up=0.9, bisect_steps=1)
    assert search.points_left() == 3  # fresh: the start and one rate on each side
    search.record(1.0, 1.0)
    assert search.points_left() == 3  # the failing rate above, the rate below, a bisection
    search.record(2.0, 0.2)
    assert search.points_left() == 2
    search.record(0.5, 1.0)
    assert search.points_left() == 1
    search.record(1.5, 0.5)
    assert search.points_left() == 0 and search.next_rate() is None
