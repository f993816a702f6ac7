"""Sampler: exact greedy, top-k / top-p support, per-request seeded reproducibility."""

from __future__ import annotations

import math

import torch

from model_runtime.sampler import Sampler, apply_top_k_top_p
from model_runtime.sampling_params import GREEDY_BELOW, SamplingParams

GREEDY = SamplingParams()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_exact_argmax_with_logprob() -> None:
    logits = torch.tensor(
        [[0.0, 3.0, 1.0, 2.999999], [5.0, -1.0, 5.0, 0.0], [-2.0, -3.0, -1.0, -9.0]]
    )
    out = Sampler().sample(logits, [SamplingParams(logprobs=0)] * 3, [None] * 3)
    assert out.token_ids == [1, 0, 2]  # near-tie resolved exactly; exact tie -> lowest index
    expected = torch.log_softmax(logits, -1)[torch.arange(3), torch.tensor([1, 0, 2])]
    assert out.logprobs == expected.tolist()


def test_logprobs_only_for_rows_that_ask_and_tokens_unchanged() -> None:
    """A greedy batch that asks for no logprobs gets the exact argmax and NaN logprobs (no
    log-softmax); in a mixed batch the rows that ask get log_softmax's exact bits."""
    logits = torch.randn(16, 49152, generator=_gen(5)) * 4
    logits[3, 7] = logits[3, 9] = logits[3].max() + 1  # an exact tie: the lowest index wins
    plain = Sampler().sample(logits, [GREEDY] * 16, [None] * 16)
    assert plain.token_ids == logits.argmax(-1).tolist() and plain.token_ids[3] == 7
    assert all(math.isnan(v) for v in plain.logprobs)
    assert plain.top_logprobs == [None] * 16
    params = [SamplingParams(logprobs=2) if i % 5 == 0 else GREEDY for i in range(16)]
    mixed = Sampler().sample(logits, params, [None] * 16)
    assert mixed.token_ids == plain.token_ids
    lp = torch.log_softmax(logits, -1)
    for i in range(16):
        if i % 5:
            assert math.isnan(mixed.logprobs[i]) and mixed.top_logprobs[i] is None
            continue
        assert mixed.logprobs[i] == lp[i, plain.token_ids[i]].item()
        top = lp[i].topk(2)
        assert mixed.top_logprobs[i] == tuple(
            zip(top.indices.tolist(), top.values.tolist(), strict=True)
        )


def test_greedy_ignores_generator_and_empty_batch() -> None:
    logits = torch.randn(2, 50, generator=_gen(0))
    a = Sampler().sample(logits, [GREEDY] * 2, [_gen(1), None])
    assert a.token_ids == logits.argmax(-1).tolist()
    empty = Sampler().sample(torch.empty(0, 50), [], [])
    assert empty.token_ids == [] and empty.logprobs == []


def test_top_k_restricts_support() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 0.5, 3.5, 2.0]])
    params = SamplingParams(temperature=5.0, top_k=2, max_tokens=1)
    gen = _gen(7)
    seen = {Sampler().sample(logits, [params], [gen]).token_ids[0] for _ in range(200)}
    assert seen == {1, 4}


def test_top_p_restricts_support() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05: p=0.7 keeps the first two (mass before 3rd is 0.8)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0)
    params = SamplingParams(temperature=1.0, top_p=0.7, max_tokens=1)
    gen = _gen(3)
    seen = {Sampler().sample(logits, [params], [gen]).token_ids[0] for _ in range(200)}
    assert seen == {0, 1}
    # the most likely token always survives, even for a tiny p
    kept = apply_top_k_top_p(logits[0], 0, 0.01)
    assert torch.isfinite(kept).tolist() == [True, False, False, False]


def test_top_k_top_p_noops() -> None:
    row = torch.randn(10, generator=_gen(0))
    assert torch.equal(apply_top_k_top_p(row, 0, 1.0), row)
    assert torch.equal(apply_top_k_top_p(row, 10, 1.0), row)


def test_sampling_follows_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    params = SamplingParams(temperature=1.0, max_tokens=1)
    gen = _gen(11)
    counts = [0, 0, 0]
    n = 600
    for _ in range(n):
        counts[Sampler().sample(probs.log().unsqueeze(0), [params], [gen]).token_ids[0]] += 1
    for c, p in zip(counts, probs.tolist(), strict=True):
        # 5 standard deviations of a binomial count
        assert abs(c - n * p) < 5 * math.sqrt(n * p * (1 - p)), counts


def test_seeded_rows_independent_of_batch_composition() -> None:
    vocab = 64
    row = torch.randn(vocab, generator=_gen(1))
    seeded = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=123)
    other = SamplingParams(temperature=1.3, seed=5)
    sampler = Sampler()

    def draw(batch_before: int, batch_after: int, steps: int = 20) -> list[int]:
        gen = _gen(seeded.seed or 0)
        noise_gens = [_gen(100 + i) for i in range(batch_before + batch_after)]
        tokens = []
        for step in range(steps):
            noise = torch.randn(batch_before + batch_after, vocab, generator=_gen(step))
            logits = torch.cat([noise[:batch_before], row.unsqueeze(0), noise[batch_before:]])
            params = [other] * batch_before + [seeded] + [other] * batch_after
            gens = [*noise_gens[:batch_before], gen, *noise_gens[batch_before:]]
            tokens.append(sampler.sample(logits, params, gens).token_ids[batch_before])
        return tokens

    alone = draw(0, 0)
    assert draw(3, 0) == alone
    assert draw(1, 4) == alone
    assert len(set(alone)) > 1  # it really samples
    # a different seed gives a different stream
    gen = _gen(124)
    other_stream = [
        sampler.sample(row.unsqueeze(0), [seeded], [gen]).token_ids[0] for _ in range(20)
    ]
    assert other_stream != alone


def test_top_logprobs_are_the_models_own_and_banned_tokens_never_win() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, -1.0], [2.0, 1.0, 0.0, -1.0, 4.0]])
    params = [SamplingParams(logprobs=3), SamplingParams(temperature=0.7, logprobs=0)]
    out = Sampler().sample(logits, params, [None, _gen(3)], banned=[(1,), ()])
    assert out.token_ids[0] == 3  # 1 is banned: the next best wins
    lp = torch.log_softmax(logits, -1)
    assert out.logprobs[0] == lp[0, 3].item()  # reported under the unmasked distribution
    assert out.top_logprobs[0] == ((1, lp[0, 1].item()), (3, lp[0, 3].item()), (2, lp[0, 2].item()))
    assert out.top_logprobs[1] == ()  # logprobs=0: the token's own logprob only
    none = Sampler().sample(logits, [GREEDY] * 2, [None] * 2)
    assert none.top_logprobs == [None, None]
    for seed in range(20):  # a banned token is never sampled either
        out = Sampler().sample(logits[1:], [params[1]], [_gen(seed)], banned=[(4, 0)])
        assert out.token_ids[0] not in (4, 0)


def test_tiny_temperatures_are_greedy() -> None:
    """1e-45 / 1e-38 overflowed logits / T to inf (NaN probabilities, token 0 every time);
    a temperature below `GREEDY_BELOW` is greedy: exact argmax, no generator needed."""
    logits = torch.tensor([[0.5, -3.0, 7.25, 7.0, 1.0], [-50.0, 80.0, 60.0, -1.0, 0.0]])
    for t in (1e-45, 1e-38, 1e-12, GREEDY_BELOW / 2):
        params = SamplingParams(temperature=t)
        assert params.greedy, t
        out = Sampler().sample(logits, [params] * 2, [_gen(3), _gen(4)])
        assert out.token_ids == [2, 1], t
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy
