"""`benchmarks.served_decode_report`: attributing served inter-token gaps to the decode batch
that was running (status samples on the same monotonic clock as the load generator)."""

from __future__ import annotations

import pytest

from benchmarks import served_decode_report as report


def _run(records: list[dict[str, object]], t0: float = 100.0) -> dict[str, object]:
    return {"t0_monotonic": t0, "records": records}


def _rec(
    sent_s: float, ttft_ms: float, itl_ms: list[float], status: str = "OK"
) -> dict[str, object]:
    tpot = sum(itl_ms) / len(itl_ms) if itl_ms else None
    return {
        "status": status,
        "sent_s": sent_s,
        "ttft_ms": ttft_ms,
        "itl_ms": itl_ms,
        "tpot_ms": tpot,
    }


def test_batch_at_picks_the_nearest_sample() -> None:
    samples = [(1.0, 1), (2.0, 3), (3.0, 2)]
    assert [report.batch_at(samples, t) for t in (0.0, 1.4, 1.6, 2.9, 9.0)] == [1, 1, 3, 2, 2]


def test_gaps_and_requests_are_attributed_on_the_shared_clock() -> None:
    # Batch 1 until t = 100.5, then 2. The request's first token comes at 100.2 + 0.1 = 100.3;
    # its gaps end at 100.4 (batch 1), 100.6 and 100.8 (batch 2).
    samples = [(100.0 + 0.1 * i, 1 if i <= 5 else 2) for i in range(12)]
    run = _run([_rec(0.2, 100.0, [100.0, 200.0, 200.0]), _rec(0.0, 50.0, [], status="CANCELLED")])
    got = report.attribute(run, samples)
    assert got["gaps"] == {1: [100.0], 2: [200.0, 200.0]}
    (req,) = got["requests"]
    assert req["tpot_ms"] == pytest.approx(500.0 / 3)
    assert req["batch"] == pytest.approx((1 + 1 + 1 + 2 + 2 + 2) / 6)  # samples 100.3 .. 100.8


def test_engine_step_interpolates_and_clamps() -> None:
    engine = {1: 10.0, 4: 40.0, 8: 48.0}
    assert report.engine_step_at(engine, 2) == pytest.approx(20.0)
    assert report.engine_step_at(engine, 6) == pytest.approx(44.0)
    assert report.engine_step_at(engine, 0.5) == 10.0 and report.engine_step_at(engine, 32) == 48.0


def test_rows_skip_thin_batches_and_give_ratios() -> None:
    rows = report.by_batch_rows(
        {1: [10.0] * 5, 2: [30.0] * 40, 0: [1.0] * 50}, {1: 10.0, 2: 20.0}, 30
    )
    assert [r["batch"] for r in rows] == [2]
    assert rows[0]["served_over_engine"] == pytest.approx(1.5)
    tp = report.tpot_rows(
        [{"tpot_ms": 22.0, "batch": 1.6}, {"tpot_ms": 24.0, "batch": 2.2}], {1: 10.0, 2: 20.0}
    )
    assert [(r["batch"], r["requests"]) for r in tp] == [(2, 2)]
    assert tp[0]["tpot_p50_over_engine"] == pytest.approx(1.15)


def test_worker_steps_use_intervals_with_one_batch() -> None:
    # [t, batch, steps, wall_s, cpu_s]: 10 steps at batch 2 (0.5 s wall, 0.3 s CPU), then an
    # interval where the batch changed (skipped), then 5 steps at batch 3.
    samples = [
        [0.0, 2, 0, 0.0, 0.0],
        [1.0, 2, 10, 0.5, 0.3],
        [2.0, 3, 20, 1.1, 0.7],
        [3.0, 3, 25, 1.5, 0.9],
    ]
    got = report.worker_steps(samples)
    assert got[2] == pytest.approx({"steps": 10, "wall_ms": 50.0, "cpu_ms": 30.0})
    assert got[3] == pytest.approx({"steps": 5, "wall_ms": 80.0, "cpu_ms": 40.0})
