"""Each request's adaptive proposal length (`model_runtime.speculative.adapt`)."""

from __future__ import annotations

import pytest

from model_runtime.speculative.adapt import FIRST_IDLE, MAX_IDLE, AdaptiveK


def test_all_accepted_grows_partial_shrinks_to_what_held() -> None:
    k = AdaptiveK(k_max=6, k=3)
    k.observe(3, 3)
    assert k.k == 4
    k.observe(4, 1)
    assert k.k == 2
    k.observe(2, 2)
    k.observe(3, 3)
    k.observe(4, 4)
    k.observe(5, 5)
    k.observe(6, 6)
    assert k.k == 6  # k_max
    k.observe(2, 2)  # a short proposal, all kept: no change
    assert k.k == 6


def test_nothing_accepted_backs_off_to_rare_probes() -> None:
    k = AdaptiveK(k_max=4)
    k.observe(4, 0)
    assert k.k == 2
    k.observe(2, 0)
    assert k.k == 0
    rows = 0  # extra rows paid over the next steps
    idle = FIRST_IDLE
    for _ in range(12):  # idle steps, then a probe that fails, with doubling idle
        for _ in range(idle):
            assert k.k == 0
            k.observe(0, 0)
        assert k.k == 1
        rows += 1
        k.observe(1, 0)
        idle = min(2 * idle, MAX_IDLE)
    assert k.idle == MAX_IDLE
    # in the long run one row per MAX_IDLE steps
    assert rows <= 12


def test_a_successful_probe_resumes_and_resets_the_backoff() -> None:
    k = AdaptiveK(k_max=4)
    for _ in range(2):
        k.observe(k.k, 0)
    for _ in range(FIRST_IDLE):
        k.observe(0, 0)
    k.observe(1, 0)  # a failed probe: idle doubles
    assert k.idle == 2 * FIRST_IDLE
    for _ in range(2 * FIRST_IDLE):
        k.observe(0, 0)
    k.observe(1, 1)
    assert (k.k, k.next_idle, k.misses) == (2, FIRST_IDLE, 0)


def test_steps_without_proposals_change_nothing_while_speculating() -> None:
    k = AdaptiveK(k_max=3)
    k.observe(0, 0)
    assert k.k == 3


def test_k_max_must_be_positive() -> None:
    with pytest.raises(ValueError, match="k_max"):
        AdaptiveK(0)
