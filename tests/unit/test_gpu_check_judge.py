"""The GPU check's greedy judges (`benchmarks.gpucheck.common`) on fabricated logits: float32
exact up to `TIE_TOL`; bfloat16 by the tie rule, else by HF float32's logits within the noise
HF's own bfloat16 logits show on that step."""

from __future__ import annotations

import torch

from benchmarks.gpucheck.common import bf16_agrees, greedy_agrees

V = 8


def row(**vals: float) -> torch.Tensor:
    """A logit row of `V` zeros with entries t<i>=value."""
    r = torch.zeros(V)
    for k, v in vals.items():
        r[int(k[1:])] = v
    return r


def never(k: int) -> torch.Tensor:
    raise AssertionError(f"float32 logits asked for at step {k}")


def test_float32_is_exact_up_to_the_tie_tolerance():
    logits = [row(t1=4.0, t2=4.0 - 5e-5), row(t3=1.0)]
    assert greedy_agrees([1, 3], [1, 3], logits, None) == (True, "equal")
    ok, why = greedy_agrees([2, 3], [1, 3], logits, None)
    assert ok and "near-tie at token 0" in why
    ok, why = greedy_agrees([1, 2], [1, 3], logits, None)
    assert not ok and "differs at token 1" in why


def test_bf16_equal_and_tie_rule_need_no_float32_logits():
    logits = [row(t1=4.0, t2=3.9)]  # 0.1 <= 2**-5 * 4 = 0.125
    assert bf16_agrees([1], [1], logits, never) == (True, "equal")
    ok, why = bf16_agrees([2], [1], logits, never)
    assert ok and "near-tie at token 0" in why


def test_bf16_within_the_measured_noise_of_hf_bf16_agrees():
    # HF bf16 picks 1 (gap 0.6 to our 2: beyond the tie rule); in float32 the top is 5,
    # our 2 is 0.5 below it and HF bf16's logits stray up to 3.0 from float32's.
    bf16 = [row(t1=4.0, t2=3.4, t5=1.0)]
    f32 = row(t1=0.9, t2=3.5, t5=4.0)
    ok, why = bf16_agrees([2], [1], bf16, lambda k: f32)
    assert ok, why
    assert "bf16 noise: HF bf16 itself off by 3" in why and "within" in why
    assert "ours is 0.5 below the top" in why and "own choice 3.1" in why


def test_bf16_beyond_the_noise_fails():
    # HF bf16 is close to float32 (noise 0.1); our token is 2.0 below the float32 top.
    bf16 = [row(t1=4.0, t2=2.1)]
    f32 = row(t1=4.1, t2=2.0)
    ok, why = bf16_agrees([2], [1], bf16, lambda k: f32)
    assert not ok
    assert "ours is 2.1 below the top" in why and "off by 0.1" in why and "beyond" in why


def test_bf16_bound_is_at_least_hf_bf16s_own_gap_under_float32():
    # noise 0.9 (t3), but HF bf16's own choice (1) sits 1.2 below the float32 top (t3);
    # ours (2) sits 1.0 below: no further than HF bf16's own choice.
    bf16 = [row(t1=4.0, t2=3.0, t3=3.7)]
    f32 = row(t1=3.4, t2=3.6, t3=4.6)
    ok, why = bf16_agrees([2], [1], bf16, lambda k: f32)
    assert ok, why


def test_bf16_asks_float32_logits_at_the_first_difference_only():
    asked: list[int] = []

    def at(k: int) -> torch.Tensor:
        asked.append(k)
        return row(t1=1.0, t2=1.0)

    bf16 = [row(t1=1.0), row(t1=1.0), row(t1=5.0, t2=1.0), row(t3=1.0)]
    ok, _ = bf16_agrees([1, 1, 2, 7], [1, 1, 1, 3], bf16, at)
    assert asked == [2] and ok  # float32 ties them; the later difference is not compared


def test_bf16_length_mismatch_fails_without_float32():
    ok, why = bf16_agrees([1], [1, 2], [row(t1=1.0), row(t2=1.0)], never)
    assert not ok and "lengths differ" in why


def test_bf16_tokens_masked_in_hf_scores_are_masked_in_float32():
    # HF's scores mask EOS (t0) under min_new_tokens: not noise, and not a float32 top.
    bf16 = [row(t0=float("-inf"), t1=4.0, t2=3.0)]
    f32 = row(t0=9.0, t1=4.1, t2=3.05)
    ok, why = bf16_agrees([2], [1], bf16, lambda k: f32)
    assert not ok and "off by 0.1" in why and "ours is 1.05 below the top" in why
