"""The router's poll health rule (`router.pool.PollHealth`), pure.

A timed-out `GetStatus` is a miss (the worker may be live but starved of CPU); only
`status_poll_misses` misses in a row make it unhealthy. Any other failure is down at once.
(`tests/integration/test_router_poll_health.py` checks the `WorkerPool` applying it.)
"""

from __future__ import annotations

import grpc
import pytest

from router.pool import PollHealth, Verdict

TIMEOUT = grpc.StatusCode.DEADLINE_EXCEEDED


def test_timeouts_are_slow_until_the_limit_in_a_row() -> None:
    rule = PollHealth(misses=3)
    assert rule.observe("a", None) is Verdict.HEALTHY
    assert rule.observe("a", TIMEOUT) is Verdict.SLOW
    assert rule.observe("a", TIMEOUT) is Verdict.SLOW
    assert rule.observe("a", TIMEOUT) is Verdict.DOWN
    assert rule.observe("a", TIMEOUT) is Verdict.DOWN  # stays down while it stays silent
    assert rule.observe("a", None) is Verdict.HEALTHY


def test_an_answer_resets_the_count_and_workers_count_apart() -> None:
    rule = PollHealth(misses=2)
    assert rule.observe("a", TIMEOUT) is Verdict.SLOW
    assert rule.observe("b", TIMEOUT) is Verdict.SLOW
    assert rule.observe("a", None) is Verdict.HEALTHY
    assert rule.observe("a", TIMEOUT) is Verdict.SLOW  # the earlier miss no longer counts
    assert rule.observe("b", TIMEOUT) is Verdict.DOWN
    rule.forget("a")
    assert rule.observe("a", TIMEOUT) is Verdict.SLOW


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INTERNAL],
)
def test_any_other_failure_is_down_at_once_and_clears_misses(code: grpc.StatusCode) -> None:
    rule = PollHealth(misses=3)
    assert rule.observe("a", TIMEOUT) is Verdict.SLOW
    assert rule.observe("a", code) is Verdict.DOWN
    assert rule.observe("a", TIMEOUT) is Verdict.SLOW  # a fresh run of misses


def test_one_miss_allowed_is_the_strict_rule_and_zero_is_refused() -> None:
    assert PollHealth(misses=1).observe("a", TIMEOUT) is Verdict.DOWN
    with pytest.raises(ValueError, match="status_poll_misses must be >= 1"):
        PollHealth(misses=0)
