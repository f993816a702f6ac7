"""`model_runtime.limits.check_context`: the one context check the worker roles and the
engine's entry points share (the router checks the same rule in its own vocabulary)."""

from __future__ import annotations

import pytest

from model_runtime.limits import check_context


def test_a_request_that_fits_passes_and_the_last_position_counts() -> None:
    check_context("r", 1, 1, 2)
    check_context("r", 10, 22, 32)  # every one of the 32 positions used


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "message"),
    [
        (0, 4, "prompt is empty"),
        (4, 0, "max_tokens must be >= 1, got 0"),
        (33, 1, "prompt length 33 exceeds the model's context 32"),
        (30, 3, r"prompt length 30 \+ max_tokens 3 = 33 exceeds the model's context 32"),
    ],
)
def test_refusals_name_the_numbers(prompt: int, max_tokens: int, message: str) -> None:
    with pytest.raises(ValueError, match=rf"request 'r': {message}"):
        check_context("r", prompt, max_tokens, 32)
