"""Attainment, goodput, percentiles and tightest SLO scale on hand-built records (max goodput:
`test_goodput_sweep.py`)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tooling.goodput.analysis import (
    SLO,
    LongPromptSLO,
    attainment,
    latency_summary,
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


def test_slo_validation() -> None:
    with pytest.raises(ValueError, match="ttft"):
        SLO(0.0, 1.0)


CLASSES = SLO(ttft_ms=100.0, tpot_ms=10.0, long_prompt=LongPromptSLO(300, 1000.0, 5.0))


def test_long_prompts_are_judged_by_their_own_slos() -> None:
    short_slow = replace(rec(0, 500, 8), input_len=299)  # chat: TTFT 500 > 100 misses
    long_slow = replace(rec(1, 500, 8), input_len=300)  # summarize: TTFT 500 <= 1000, TPOT 8 > 5
    long_fast = replace(rec(2, 500, 4), input_len=400)  # summarize: meets both
    a = attainment([short_slow, long_slow, long_fast], CLASSES)
    assert (a.ttft, a.tpot, a.good) == (2 / 3, 2 / 3, 1)
    assert CLASSES.for_prompt(299) == (100.0, 10.0) and CLASSES.for_prompt(300) == (1000.0, 5.0)
    # tightest scale per class: request 0 needs 5x, 1 needs 1.6x, 2 needs 0.8x
    assert tightest_scale([short_slow, long_slow, long_fast], CLASSES, 2 / 3) == pytest.approx(1.6)
    scaled = CLASSES.scaled(2.0)
    assert scaled.long_prompt == LongPromptSLO(300, 2000.0, 10.0)
    assert attainment([long_slow], scaled).good == 1


def test_slo_json_round_trip_keeps_old_files_readable() -> None:
    assert SLO.from_json(CLASSES.to_json()) == CLASSES
    assert SLO_.to_json() == {"ttft_ms": 100.0, "tpot_ms": 10.0}  # as older results.json files
    assert SLO.from_json({"ttft_ms": 100, "tpot_ms": 10}) == SLO_
    assert "prompts >= 300 tokens: TTFT <= 1000 ms" in CLASSES.text()


@pytest.mark.parametrize(
    "text", ["300:6000", "300:6000:85:1", "x:6000:85", "0:6000:85", "300:0:85"]
)
def test_long_prompt_slo_parse_rejects_malformed_text(text: str) -> None:
    with pytest.raises(ValueError):
        LongPromptSLO.parse(text)


def test_long_prompt_slo_parse() -> None:
    assert LongPromptSLO.parse("307:6000:85") == LongPromptSLO(307, 6000.0, 85.0)
    assert LongPromptSLO.parse("307:6000:85").text() == "307:6000:85"
