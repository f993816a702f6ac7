"""`BurstGate` (the soak client's hold on a burst): it opens only once the client has seen the
router decide the whole burst, then ends every started request, at once or at its start."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tooling.soak.client import BurstGate


class Cancels:
    """Records which requests the gate cancelled, in order."""

    def __init__(self) -> None:
        self.done: list[int] = []

    def of(self, index: int) -> Callable[[], None]:
        return lambda: self.done.append(index)


def test_opens_on_the_refusals_beyond_what_the_router_admits() -> None:
    gate, cancels = BurstGate(10, max_inflight=3, max_queued=3), Cancels()
    for i in range(3):
        gate.started(i, cancels.of(i))
    for i in range(6, 9):  # 3..5 wait in the router's queue, unseen
        gate.ended(i, "RESOURCE_EXHAUSTED")
    assert not gate.is_open and cancels.done == []
    gate.ended(9, "RESOURCE_EXHAUSTED")
    assert gate.is_open and sorted(cancels.done) == [0, 1, 2]
    for i in range(3, 6):  # the queued ones start once the running ones are gone
        gate.started(i, cancels.of(i))
    assert sorted(cancels.done) == [0, 1, 2, 3, 4, 5]


def test_opens_on_requests_seen_when_earlier_requests_freed_slots_to_the_burst() -> None:
    # requests running before the burst ended during it: 5 burst requests started, 2 refused
    gate, cancels = BurstGate(10, max_inflight=3, max_queued=3), Cancels()
    for i in range(5):
        gate.started(i, cancels.of(i))
    gate.ended(5, "RESOURCE_EXHAUSTED")
    assert not gate.is_open
    gate.ended(6, "RESOURCE_EXHAUSTED")  # 7 seen = 10 - 3 queued
    assert gate.is_open and sorted(cancels.done) == [0, 1, 2, 3, 4]


def test_a_request_that_ended_before_the_gate_opened_is_not_cancelled() -> None:
    gate, cancels = BurstGate(4, max_inflight=1, max_queued=1), Cancels()
    gate.started(0, cancels.of(0))
    gate.ended(0, "OK")
    gate.started(1, cancels.of(1))
    assert not gate.is_open
    gate.ended(2, "RESOURCE_EXHAUSTED")
    gate.ended(3, "RESOURCE_EXHAUSTED")
    assert gate.is_open and cancels.done == [1]


def test_a_burst_the_router_can_admit_whole_is_refused() -> None:
    with pytest.raises(ValueError, match="must exceed"):
        BurstGate(6, max_inflight=3, max_queued=3)
