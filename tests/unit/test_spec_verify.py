"""The verification rule (`model_runtime.speculative.verify`) on synthetic distributions.

The rule is lossless if the tokens a verified step emits are distributed as the target's
sampler would draw them. Here each position's target distribution p_j and draft distribution
q_j are fixed (as if the model ignored its context), so the emitted token at position j must be
distributed as p_j whatever was proposed — by a deterministic guess (the n-gram proposer's:
then the rule is the textbook one, accept with probability p(d)) or by the draft's coupled
draw from q_j. Over `SEEDS` seeded requests, a chi-square goodness-of-fit test against p_j
at significance `ALPHA` (a false alarm once in a thousand runs; the seeds are fixed, so the
test is deterministic) must pass, and the acceptance of a deterministic guess must be
within 4 binomial standard deviations of p(d). Each seed must also give exactly the tokens the
plain sampler gives with that seed (the stronger, per-seed statement).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from model_runtime.request import Request
from model_runtime.sampler import Sampler
from model_runtime.sampling_params import SamplingParams
from model_runtime.speculative.verify import Verifier

V = 8
SEEDS = 3000
ALPHA = 1e-3
TEMPERATURE = 1.0


def dists() -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits p [3, V] and a draft that disagrees q [3, V] (fixed, seeded)."""
    g = torch.Generator().manual_seed(0)
    p = torch.randn(3, V, generator=g) * 1.5
    q = p + torch.randn(3, V, generator=g) * 1.5
    return p, q


def request(seed: int) -> Request:
    params = SamplingParams(max_tokens=10, temperature=TEMPERATURE, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    return Request(f"r{seed}", [1], params, generator=gen)


def coupled_guesses(q: torch.Tensor, req: Request) -> list[int]:
    """The draft proposer's guesses: its own distribution with the races the target's
    generator will draw (a copy of it), as `draft.DraftProposer` picks them."""
    g = torch.Generator()
    assert req.generator is not None
    g.set_state(req.generator.get_state())
    return [int(Sampler._sample_row(q[j], req.params, g)) for j in range(q.shape[0] - 1)]


def plain_tokens(p: torch.Tensor, seed: int, n: int) -> list[int]:
    """What the plain sampler draws for positions 0..n-1 with this seed."""
    req = request(seed)
    sampler = Sampler()
    return [
        sampler.sample(p[j : j + 1], [req.params], [req.generator]).token_ids[0] for j in range(n)
    ]


def chi_square_ok(samples: list[int], logits: torch.Tensor) -> float:
    probs = torch.softmax(logits.double() / TEMPERATURE, dim=-1).numpy()
    expected = probs / probs.sum() * len(samples)
    observed = np.bincount(samples, minlength=V)
    keep = expected >= 5  # the test's validity rule; fold rare bins together
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("proposer", ["deterministic", "coupled-draft"])
def test_emitted_tokens_follow_the_target_distribution(proposer: str) -> None:
    p, q = dists()
    verifier = Verifier(Sampler(), None)
    first: list[int] = []
    second: list[int] = []
    accepted_first = 0
    fixed = [int(q[0].argmax()), int(q[1].argmax())]
    for seed in range(SEEDS):
        req = request(seed)
        guesses = fixed if proposer == "deterministic" else coupled_guesses(q, req)
        emitted = [t for t, _, _ in verifier.verify(req, p, guesses)]
        assert emitted == plain_tokens(p, seed, len(emitted)), seed
        first.append(emitted[0])
        if len(emitted) > 1:
            second.append(emitted[1])
        accepted_first += emitted[0] == guesses[0]
    assert chi_square_ok(first, p[0]) > ALPHA
    assert chi_square_ok(first, q[0]) < ALPHA  # the test tells the draft's distribution apart
    assert len(second) > 300 and chi_square_ok(second, p[1]) > ALPHA
    if proposer == "deterministic":  # the textbook rule: accepted with probability p(d)
        pd = torch.softmax(p[0], dim=-1)[fixed[0]].item()
        sd = math.sqrt(SEEDS * pd * (1 - pd))
        assert abs(accepted_first - SEEDS * pd) < 4 * sd, (accepted_first, SEEDS * pd)


def test_greedy_keeps_the_longest_agreeing_prefix_plus_one() -> None:
    p = torch.zeros(4, V)
    for j, t in enumerate([3, 5, 1, 6]):
        p[j, t] = 1.0
    req = Request("g", [1], SamplingParams(max_tokens=10))
    verifier = Verifier(Sampler(), None)
    assert [t for t, _, _ in verifier.verify(req, p, [3, 5, 1])] == [3, 5, 1, 6]
    assert [t for t, _, _ in verifier.verify(req, p, [3, 4, 1])] == [3, 5]
    assert [t for t, _, _ in verifier.verify(req, p, [2, 5, 1])] == [3]
    # max_tokens: a kept token that ends the request ends the walk
    short = Request("s", [1], SamplingParams(max_tokens=2))
    assert [t for t, _, _ in verifier.verify(short, p, [3, 5, 1])] == [3, 5]
