"""Arrival generators and synthetic workloads: rates, seeds, shapes (pure, milliseconds)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tooling.goodput.arrivals import arrival_times, empirical_rate, inter_arrival_gaps
from tooling.goodput.workloads import WORKLOADS, make_requests


@pytest.mark.parametrize("kind", ["poisson", "gamma"])
@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
def test_mean_rate_matches(kind: str, rate: float) -> None:
    times = arrival_times(20_000, rate, kind, cv=2.0, seed=3)  # type: ignore[arg-type]
    assert times[0] == 0.0
    assert all(b >= a for a, b in itertools.pairwise(times))
    assert empirical_rate(times) == pytest.approx(rate, rel=0.05)


def test_same_seed_same_times_other_seed_differs() -> None:
    a = arrival_times(100, 2.0, "poisson", seed=1)
    assert a == arrival_times(100, 2.0, "poisson", seed=1)
    assert a != arrival_times(100, 2.0, "poisson", seed=2)


def test_rates_scale_the_same_draws() -> None:
    """Common random numbers: one seed at two rates gives the same gaps, scaled."""
    slow = np.array(arrival_times(50, 1.0, "gamma", cv=3.0, seed=5))
    fast = np.array(arrival_times(50, 4.0, "gamma", cv=3.0, seed=5))
    np.testing.assert_allclose(fast * 4.0, slow, rtol=1e-9)


def test_poisson_gaps_have_cv_one_and_gamma_is_burstier() -> None:
    exp = inter_arrival_gaps(50_000, 2.0, "poisson", seed=0)
    gam = inter_arrival_gaps(50_000, 2.0, "gamma", cv=3.0, seed=0)
    assert exp.std() / exp.mean() == pytest.approx(1.0, rel=0.05)
    assert gam.std() / gam.mean() == pytest.approx(3.0, rel=0.1)
    assert gam.mean() == pytest.approx(0.5, rel=0.05)


@pytest.mark.parametrize(
    ("args", "field"),
    [((10, 0.0, "poisson"), "rate"), ((10, 1.0, "uniform"), "kind"), ((-1, 1.0, "poisson"), "n")],
)
def test_bad_arguments_name_the_field(args: tuple[int, float, str], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        inter_arrival_gaps(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
@pytest.mark.parametrize("context", [256, 4096])
def test_workloads_fit_the_context_and_are_seeded(name: str, context: int) -> None:
    specs = make_requests(name, 200, 2.0, context=context, seed=11)
    assert len(specs) == 200
    assert [s.index for s in specs] == list(range(200))
    assert all(s.input_len >= 1 and s.output_len >= 1 for s in specs)
    assert all(s.input_len + s.output_len <= context - 1 for s in specs)
    assert specs == make_requests(name, 200, 2.0, context=context, seed=11)
    assert specs != make_requests(name, 200, 2.0, context=context, seed=12)


def test_lengths_do_not_depend_on_the_rate() -> None:
    a = make_requests("chat", 50, 1.0, context=2048, seed=4)
    b = make_requests("chat", 50, 8.0, context=2048, seed=4)
    assert [(s.input_len, s.output_len) for s in a] == [(s.input_len, s.output_len) for s in b]


def test_workload_shapes() -> None:
    L = 4096
    med = {
        n: np.median([s.input_len for s in make_requests(n, 400, 1.0, context=L, seed=0)])
        for n in WORKLOADS
    }
    assert med["summarize"] > 0.6 * L > med["code"] > med["chat"]
    summ = make_requests("summarize", 200, 1.0, context=L, seed=0)
    assert np.median([s.output_len for s in summ]) < L / 32


def test_prefix_groups_share_a_prefix() -> None:
    specs = make_requests("prefix", 64, 1.0, context=1024, seed=2)
    groups = {s.prefix_group for s in specs}
    assert len(groups) >= 2 and None not in groups
    assert all(s.shared_len == 256 for s in specs)


def test_multiturn_turns_extend_the_previous_prompt() -> None:
    specs = make_requests("multiturn", 64, 1.0, context=2048, seed=9)
    by_conv: dict[int, list[int]] = {}
    for s in specs:
        assert s.prefix_group is not None and s.shared_len == s.input_len
        by_conv.setdefault(s.prefix_group, []).append(s.input_len)
    assert any(len(v) > 1 for v in by_conv.values())
    for lens in by_conv.values():
        assert lens == sorted(lens) and len(set(lens)) == len(lens)


def test_fixed_output_len() -> None:
    specs = make_requests("summarize", 30, 1.0, context=512, seed=0, output_len=24)
    assert {s.output_len for s in specs} == {24}
    assert all(s.input_len + 24 <= 511 for s in specs)


def test_mixed_draws_chat_turns_and_summarization_prompts_together() -> None:
    L = 2048
    specs = make_requests("mixed", 400, 1.0, context=L, seed=3)
    long = [s for s in specs if s.input_len >= 0.6 * L]
    assert 0.2 < len(long) / len(specs) < 0.4  # MIXED_SUMMARIZE_SHARE = 0.3
    short = [s for s in specs if s.input_len < 0.6 * L]
    assert np.median([s.input_len for s in short]) < L / 4
