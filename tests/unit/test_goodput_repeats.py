"""Max goodput over repeats: bounds of one answer, median and range, paired ratios and the
headline's words (pure, milliseconds)."""

from __future__ import annotations

import math

import pytest

from tooling.goodput.repeats import Bounded, Spread, ratio_fmt, ratio_spread, spread
from tooling.goodput.sweep import MaxGoodput


def exact(rate: float) -> MaxGoodput:
    return MaxGoodput(rate, rate * 1.26, False)


def at_least(rate: float) -> MaxGoodput:
    return MaxGoodput(rate, None, True)


def below(first_fail: float) -> MaxGoodput:
    return MaxGoodput(0.0, first_fail, False)


def test_an_answer_is_exact_a_lower_bound_or_below_the_lowest_tested_rate() -> None:
    assert Bounded.of(exact(2.0)) == Bounded(2.0, 2.0)
    assert Bounded.of(at_least(2.0)) == Bounded(2.0, math.inf)
    assert Bounded.of(below(0.5)) == Bounded(0.0, 0.5)
    assert Bounded.of(MaxGoodput(0.0, None, False)) == Bounded(0.0, math.inf)  # nothing ran
    texts = [Bounded(2, 2).text(), Bounded(2, math.inf).text(), Bounded(0, 0.5).text()]
    assert texts == ["2", ">= 2", "< 0.5"]
    assert Bounded(1, 2).text() == "between 1 and 2" and Bounded(0, math.inf).text() == "unknown"
    assert Bounded(2, math.inf).to_json() == {"lo": 2, "hi": None}


def test_ratios_of_bounds() -> None:
    assert Bounded(4, 4).over(Bounded(2, 2)) == Bounded(2, 2)
    assert Bounded(4, math.inf).over(Bounded(2, 2)) == Bounded(2, math.inf)
    assert Bounded(4, 4).over(Bounded(0, 0.5)) == Bounded(8, math.inf)  # base met no rate
    assert Bounded(0, 0.5).over(Bounded(2, 2)) == Bounded(0, 0.25)  # top met no rate
    assert Bounded(4, 4).over(Bounded(2, math.inf)) == Bounded(0, 2)
    assert Bounded(0, 1).over(Bounded(0, 1)) == Bounded(0, math.inf)


def test_headline_ratio_is_the_median_of_the_per_seed_ratios_with_their_range() -> None:
    top = [exact(2.0), exact(2.52), exact(1.59)]
    base = [exact(1.0), exact(1.0), exact(1.0)]
    r = ratio_spread(top, base)
    assert r.median == Bounded(2.0, 2.0) and (r.low, r.high) == (1.59, 2.52)
    assert r.text(ratio_fmt) == "= 2.00x (1.59x-2.52x over 3 repeats)"
    assert r.to_json()["range"] == {"lo": 1.59, "hi": 2.52}
    assert len(r.to_json()["repeats"]) == 3
    with pytest.raises(ValueError, match="pair"):
        ratio_spread(top, base[:2])


def test_bounded_repeats_bound_the_median_and_the_range() -> None:
    # colocated met no tested rate in two repeats of three: the ratio is a lower bound there
    r = ratio_spread([exact(2.0)] * 3, [below(0.25), exact(0.5), below(0.25)])
    assert r.median == Bounded(8.0, math.inf)
    assert r.text(ratio_fmt) == ">= 8.00x (repeats: >= 8.00x, 4.00x, >= 8.00x)"
    sp = spread([exact(1.0), at_least(2.0), exact(1.5)])
    assert sp.median == Bounded(1.5, 1.5) and sp.range_text() == "1, >= 2, 1.5"
    sp = spread([below(0.5), below(0.5), exact(1.0)])
    assert sp.median == Bounded(0.0, 0.5) and sp.text() == "< 0.5 (repeats: < 0.5, < 0.5, 1)"
    assert spread([exact(0.8)]).text() == "= 0.8 (1 repeat)"
    assert spread([exact(1.0), below(2.0), exact(3.0)]).median.text() == "between 1 and 2"
    with pytest.raises(ValueError, match="repeat"):
        Spread(())
