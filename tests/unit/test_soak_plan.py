"""Unit tests of the soak's pure parts: config parsing, the seeded plan, stop-string cutting."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest
from pydantic import ValidationError

from tooling.soak.config import FAULT_KINDS, SoakConfig, parse_faults, parse_topology
from tooling.soak.workload import (
    PROBE_TIMEOUT_S,
    PlannedFault,
    burst_times,
    f32,
    make_plan,
    with_stop_strings,
)

VOCAB = 1024


def config(**kw: object) -> SoakConfig:
    return SoakConfig(model=Path("m"), out=Path("o"), **kw)  # type: ignore[arg-type]


def test_topology_and_fault_lists_parse() -> None:
    assert parse_topology("2p2d") == (2, 2) and parse_topology("1P3D") == (1, 3)
    for bad in ("2p", "0p1d", "p2d2", ""):
        with pytest.raises(ValueError, match="topology"):
            parse_topology(bad)
    assert parse_faults("kill-prefill:2,stop") == [("kill-prefill", 2), ("stop", None)]
    assert parse_faults("none") == []
    with pytest.raises(ValueError, match="unknown kind 'reboot'"):
        parse_faults("reboot")
    with pytest.raises(ValidationError, match="faults"):
        config(faults="stop:x")
    with pytest.raises(ValidationError, match="stop_min_s"):
        config(stop_min_s=5.0, stop_max_s=2.0)


def test_fault_counts_spread_the_rest_evenly() -> None:
    c = config(faults="kill-prefill:3,stop,redis", num_faults=5)
    assert c.fault_counts() == {"kill-prefill": 3, "stop": 3, "redis": 2}
    assert sum(config(requests=2000).fault_counts().values()) == 40
    assert set(config().fault_counts()) == set(FAULT_KINDS)


def test_plan_is_seeded_and_complete() -> None:
    c = config(requests=300, num_faults=10, seed=7)
    plan = make_plan(c, VOCAB)
    assert plan == make_plan(c, VOCAB)
    assert plan != make_plan(config(requests=300, num_faults=10, seed=8), VOCAB)
    reqs = plan.requests
    assert len(reqs) == 300 and [r.index for r in reqs] == list(range(300))
    assert all(a.at_s <= b.at_s for a, b in itertools.pairwise(reqs))
    assert len({r.request_id for r in reqs}) == 300
    bursts = Counter(r.burst for r in reqs if r.kind == "burst")
    assert list(bursts.values()) == [c.burst_size] and c.burst_size > c.max_inflight + c.max_queued
    kinds = Counter(f.kind for f in plan.faults)
    assert kinds == Counter(c.fault_counts())
    for f in plan.faults:
        assert 0 < f.at_s < plan.duration_s
        if f.kind == "kv-stall":
            probe = reqs[f.probe] if f.probe is not None else None
            assert probe is not None and probe.kind == "probe" and probe.at_s == f.at_s
            assert probe.timeout_s == PROBE_TIMEOUT_S
        if f.kind == "stop":
            assert c.stop_min_s <= f.duration_s <= c.stop_max_s
        if f.kind == "long-stop":  # outlasts every request's deadline
            assert f.duration_s == c.default_timeout_s + 10 > c.default_timeout_s
    for r in reqs:
        if r.token_ids is not None:
            assert all(4 <= t < VOCAB for t in r.token_ids)
            assert len(r.token_ids) + r.max_tokens <= 1024
        if r.kind == "sampled":
            assert r.seed is not None and r.temperature == f32(r.temperature) > 0
    mix = Counter(r.kind for r in reqs)
    assert mix["greedy"] and mix["sampled"] and mix["text"]
    assert any(r.cancel_after_tokens for r in reqs) and any(r.cancel_after_s for r in reqs)
    assert any(r.timeout_s and r.kind != "probe" for r in reqs)


def test_bursts_keep_away_from_kills_and_freezes() -> None:
    """A burst inside a kill's or freeze's recovery would be answered UNAVAILABLE, not shed:
    it goes to the quietest moment instead; Redis restarts and KV stalls do not push it."""
    faults = [
        PlannedFault(0, 10.0, "kill-prefill"),
        PlannedFault(1, 40.0, "stop", duration_s=3.0),
        PlannedFault(2, 30.0, "redis"),
        PlannedFault(3, 31.0, "kv-stall"),
    ]
    (at,) = burst_times(faults, 1, 50.0)  # candidates: 7.5 .. 42.5 s
    assert at == pytest.approx(28.0, abs=0.2)  # middle of the gap between 16 s and 40 s
    two = burst_times(faults, 2, 50.0)
    assert two == sorted(two) and all(not 10 <= t <= 16 and not 40 <= t <= 49 for t in two)
    assert abs(two[1] - two[0]) >= 5
    assert burst_times([], 1, 50.0) == [7.5]  # nothing to avoid: the earliest candidate


def test_too_few_requests_for_bursts_and_probes_is_refused() -> None:
    with pytest.raises(ValueError, match="no room for the stream"):
        make_plan(config(requests=50, bursts=1), VOCAB)


def test_stop_strings_are_cut_from_the_reference_text() -> None:
    plan = make_plan(config(requests=300, seed=3), VOCAB)
    marked = [r for r in plan.requests if r.stop_at is not None]
    assert marked
    texts = {r.index: f"alpha beta gamma delta {r.index}" for r in marked}
    texts[marked[0].index] = "ab"  # too short to cut from: no stop string
    cut = with_stop_strings(plan, texts)
    for before, after in zip(plan.requests, cut.requests, strict=True):
        if before.stop_at is None or before.index == marked[0].index:
            assert after == before
            continue
        assert after.stop and after.stop[0] in texts[before.index] and len(after.stop[0]) == 3


def test_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    from deploy.cli import main

    assert main(["soak", "--model", "m", "--out", "o", "--topology", "2x"]) == 2
    assert "topology" in capsys.readouterr().err
    assert main(["soak", "--model", "m", "--out", "o", "--faults", "reboot"]) == 2
