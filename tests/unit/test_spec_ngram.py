"""Prompt-lookup proposer (`model_runtime.speculative.ngram`) on token lists, no model."""

from __future__ import annotations

import random

import pytest

from model_runtime.request import Request
from model_runtime.sampling_params import SamplingParams
from model_runtime.speculative.ngram import NgramProposer


def req(prompt: list[int], output: list[int] = (), rid: str = "r") -> Request:  # type: ignore[assignment]
    r = Request(rid, list(prompt), SamplingParams(max_tokens=64))
    r.output_token_ids.extend(output)
    return r


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule by brute force: the longest n whose suffix occurs earlier, its latest
    occurrence's continuation."""
    end = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if end < n:
            continue
        suffix = tokens[end - n :]
        for e in range(end - 1, n - 1, -1):
            if tokens[e - n : e] == suffix:
                return tokens[e : min(e + k, end)]
    return []


def test_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    p = NgramProposer(2, 3)
    #          0  1  2  3  4  5  6  7  8  9
    prompt = [9, 1, 2, 3, 4, 1, 2, 5, 6, 1, 2]
    # suffix (1, 2): latest earlier occurrence ends at 7 -> 5, 6, 1, 2
    assert p.propose([req(prompt)], [3]) == [[5, 6, 1]]
    p.release("r")
    # a longer suffix wins: (3, 4, 1) ends at 6 in "... 2 3 4 1 2 ...", not the 2-gram
    assert p.propose([req([3, 4, 1, 2, 7, 3, 4, 1])], [4]) == [[2, 7, 3, 4]]


def test_nothing_to_match_proposes_nothing_and_continuation_stops_at_the_end() -> None:
    p = NgramProposer(1, 2)
    assert p.propose([req([1, 2, 3, 4])], [4]) == [[]]
    p.release("r")
    assert p.propose([req([5, 6, 5])], [8]) == [[6, 5]]  # capped at the last token


def test_incremental_index_matches_brute_force_as_tokens_arrive() -> None:
    rng = random.Random(7)
    for trial in range(20):
        vocab = rng.choice([3, 5, 20])
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        r = req(prompt, rid=f"r{trial}")
        p = NgramProposer(1 + trial % 2, 3 + trial % 2)
        for _ in range(40):
            k = rng.randrange(1, 6)
            got = p.propose([r], [k])[0]
            assert got == reference(r.all_token_ids, k, p.min_n, p.max_n), (trial, r.all_token_ids)
            r.output_token_ids.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 4)))
        p.check_integrity({r.request_id})
        p.release(r.request_id)
        p.check_integrity(set())


def test_state_is_per_request_and_checked() -> None:
    p = NgramProposer(2, 2)
    p.propose([req([1, 2, 1, 2], rid="a"), req([3, 4, 5], rid="b")], [2, 2])
    p.check_integrity({"a", "b"})
    with pytest.raises(AssertionError, match="left"):
        p.check_integrity({"a"})
    p.release("b")
    p.release("never-seen")  # a no-op
    p.check_integrity({"a"})


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)
