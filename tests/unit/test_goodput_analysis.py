"""Attainment, goodput, percentiles, tightest SLO scale and max goodput on hand-built records."""

from __future__ import annotations

import math

import pytest

from tooling.goodput.analysis import (
    SLO,
    attainment,
    latency_summary,
    max_goodput,
    slo_goodput_rps,
    tightest_scale,
    ttft_breakdown,
)
from tooling.goodput.records import TIMING_FIELDS, RequestRecord, RunResult

SLO_ = SLO(ttft_ms=100.0, tpot_ms=10.0)


def rec(i: int, ttft: float | None, tpot: float | None, status: str = "OK", n: int = 8,
        out: int = 8, **kw: object) -> RequestRecord:  # fmt: skip
    return RequestRecord(
        index=i, request_id=f"r{i}", scheduled_s=float(i), sent_s=float(i), input_len=16,
        output_len=out, status=status, num_tokens=n, ttft_ms=ttft, tpot_ms=tpot,
        e2e_ms=(ttft or 0) + (tpot or 0) * (n - 1), **kw,  # type: ignore[arg-type]
    )  # fmt: skip


RECORDS = [
    rec(0, 50, 5),  # meets both
    rec(1, 150, 5),  # TTFT miss
    rec(2, 50, 15),  # TPOT miss
    rec(3, 150, 15),  # both miss
    rec(4, None, None, status="RESOURCE_EXHAUSTED", n=0),  # error: misses both
    rec(5, 100, 10),  # exactly at the SLO: meets
    rec(6, 40, 9, n=5),  # fewer tokens than asked: a failure even though fast
    rec(7, 20, None, n=1, out=1),  # one token: no TPOT, meets TPOT
]


def test_attainment_counts_errors_as_misses() -> None:
    a = attainment(RECORDS, SLO_)
    assert a.n == 8 and a.errors == 2
    assert a.good == 3  # 0, 5, 7
    assert a.both == pytest.approx(3 / 8)
    assert a.ttft == pytest.approx(4 / 8)  # 0, 2, 5, 7
    assert a.tpot == pytest.approx(4 / 8)  # 0, 1, 5, 7


def test_empty_attainment() -> None:
    assert attainment([], SLO_).both == 0.0


def test_goodput_is_good_requests_per_second_of_duration() -> None:
    run = RunResult("c", 1.0, "poisson", 0, 0, RECORDS, 12.0, 0.1, 0.5)
    assert slo_goodput_rps(run, SLO_) == pytest.approx(3 / 12.0)
    assert run.valid
    assert not RunResult("c", 1.0, "poisson", 0, 0, RECORDS, 12.0, 0.1, 10.5).valid


def test_percentiles_use_successful_requests_and_pool_itl() -> None:
    rs = [rec(i, 10.0 * (i + 1), 1.0, itl_ms=[1.0] * 7) for i in range(10)]
    rs.append(rec(10, 1e6, 1e6, status="UNAVAILABLE", n=0))
    s = latency_summary(rs)
    assert s["ttft_ms"]["p50"] == pytest.approx(55.0)
    assert s["ttft_ms"]["p99"] < 100.0 + 1e-9
    assert s["itl_ms"] == {"p50": 1.0, "p90": 1.0, "p99": 1.0}
    assert math.isnan(latency_summary([])["tpot_ms"]["p50"])


def test_tightest_scale() -> None:
    rs = [rec(i, 10.0 * (i + 1), 1.0) for i in range(10)]  # needs TTFT/100 = 0.1 .. 1.0
    assert tightest_scale(rs, SLO_, 0.9) == pytest.approx(0.9)
    assert tightest_scale(rs, SLO_, 1.0) == pytest.approx(1.0)
    assert tightest_scale(rs, SLO_, 0.5) == pytest.approx(0.5)
    # The scale found is exactly the smallest one that reaches the target.
    s = tightest_scale(RECORDS, SLO_, 0.5)
    assert attainment(RECORDS, SLO_.scaled(s)).both >= 0.5
    assert attainment(RECORDS, SLO_.scaled(s * 0.999)).both < 0.5
    assert tightest_scale(RECORDS, SLO_, 0.9) == math.inf  # 2 of 8 failed


def test_ttft_breakdown_means() -> None:
    server = dict.fromkeys(TIMING_FIELDS, 10.0) | {"ttft_ms": 70.0, "e2e_ms": 200.0}
    rs = [rec(0, 80, 5, server=server), rec(1, 80, 5, server=server)]
    b = ttft_breakdown(rs)
    assert b["prefill_compute_ms"] == 10.0
    assert b["server_other"] == pytest.approx(10.0)  # 70 - 6 x 10
    assert b["client_other"] == pytest.approx(10.0)  # 80 - 70
    assert ttft_breakdown([rec(0, 80, 5)]) == {}


def test_max_goodput_takes_highest_pass_below_first_fail() -> None:
    m = max_goodput([(1.0, 0.99), (2.0, 0.95), (3.0, 0.7), (4.0, 0.2)], 0.9)
    assert (m.rate, m.first_fail, m.lower_bound, m.non_monotone) == (2.0, 3.0, False, False)
    m = max_goodput([(4.0, 0.95), (1.0, 0.99), (3.0, 0.5), (2.0, 0.9)], 0.9)
    assert (m.rate, m.first_fail, m.non_monotone) == (2.0, 3.0, True)
    m = max_goodput([(1.0, 0.95), (2.0, 0.96)], 0.9)
    assert (m.rate, m.first_fail, m.lower_bound) == (2.0, None, True)
    m = max_goodput([(1.0, 0.5)], 0.9)
    assert (m.rate, m.first_fail, m.lower_bound) == (0.0, 1.0, False)


def test_slo_validation() -> None:
    with pytest.raises(ValueError, match="ttft"):
        SLO(0.0, 1.0)
