"""Colocated engine on a real runner and a tiny random model: batching never changes tokens.

Oracle: the same model run one request at a time (max_num_seqs=1, no chunking, no prefix
cache). Every batched configuration — continuous batching with staggered arrivals, chunked
prefill under a small budget, prefix-cache hits, preemption by recompute — must give the same
greedy tokens, and a seeded sampled request the same tokens alone or in a crowd. After every run
the block pool is back to all-free and its integrity holds.

Near-tie rule (DESIGN section 5): batching changes float32 summation order, so logits may move
by ~1e-6. A greedy token may therefore differ from the oracle's only where the oracle itself is
at a near-tie: at the first differing position, the batched run's token must have a reference
logit within `TIE_TOL` of the reference maximum. Later positions are not compared (the contexts
differ). Anything else — a lost KV entry, a wrong position, a wrong block — moves logits by
whole units and fails.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from model_runtime.engine import EngineConfig, LLMEngine, num_kv_blocks_for
from model_runtime.model_runner import StepInput
from model_runtime.request import RequestOutput, RequestStatus
from model_runtime.sampling_params import SamplingParams
from tooling.models.random_model import make_random_model

BLOCK = 8
TIE_TOL = 1e-3
GREEDY = SamplingParams(max_tokens=12)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    make_random_model(out, preset="tiny", seed=0)
    return out


class Oracle:
    """Batch-size-1 reference engine with memoised results."""

    def __init__(self, model_dir: Path) -> None:
        cfg = EngineConfig(
            block_size=BLOCK,
            num_kv_blocks=64,
            max_num_seqs=1,
            max_num_batched_tokens=512,
            enable_chunked_prefill=False,
            enable_prefix_caching=False,
        )
        self.engine = LLMEngine.from_model_dir(model_dir, cfg)
        self._memo: dict[tuple[tuple[int, ...], SamplingParams], RequestOutput] = {}

    def run(self, prompt: list[int], params: SamplingParams) -> RequestOutput:
        key = (tuple(prompt), params)
        if key not in self._memo:
            self._memo[key] = self.engine.generate([prompt], params)[0]
        return self._memo[key]

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """Full next-token logits after `tokens` (the idle oracle's KV blocks are scratch)."""
        assert not self.engine.has_unfinished()
        table = list(range(-(-len(tokens) // BLOCK)))
        return self.engine.runner.execute([StepInput(tokens, 0, table)])[0]

    def assert_same_greedy(self, got: RequestOutput, params: SamplingParams = GREEDY) -> None:
        prompt = list(got.prompt_token_ids)
        want = self.run(prompt, params)
        for i, (a, b) in enumerate(zip(got.output_token_ids, want.output_token_ids, strict=True)):
            if a != b:
                ref = self.logits(prompt + list(want.output_token_ids[:i]))
                gap = (ref.max() - ref[a]).item()
                assert gap <= TIE_TOL, (
                    f"{got.request_id}: token {i} is {a}, oracle says {b}; reference logit gap "
                    f"{gap:.3g} > TIE_TOL {TIE_TOL} — not a near-tie"
                )
                return
        assert got.finish_reason == want.finish_reason


@pytest.fixture(scope="module")
def oracle(model_dir: Path) -> Oracle:
    return Oracle(model_dir)


def make_engine(model_dir: Path, **overrides: object) -> LLMEngine:
    cfg = EngineConfig(block_size=BLOCK, **{"num_kv_blocks": 64, "max_num_seqs": 8, **overrides})  # type: ignore[arg-type]
    return LLMEngine.from_model_dir(model_dir, cfg)


def random_prompts(n: int, seed: int, shared: int = 0) -> list[list[int]]:
    """n prompts of mixed lengths (1, block multiples, odd sizes); the first `shared` tokens of
    every prompt are common when shared > 0. Token ids avoid the special ids 0-2."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 1024) for _ in range(shared)]
    lengths = [1, BLOCK, 2 * BLOCK, 2 * BLOCK + 1, 37, 5, 61, 3 * BLOCK - 1]
    return [
        prefix + [rng.randrange(3, 1024) for _ in range(lengths[i % len(lengths)])]
        for i in range(n)
    ]


@pytest.fixture
def leak_check() -> Iterator[list[LLMEngine]]:
    """Engines appended to the yielded list must end idle, all blocks free, integrity intact."""
    engines: list[LLMEngine] = []
    yield engines
    for engine in engines:
        assert not engine.has_unfinished()
        assert engine.block_pool.num_free == engine.num_kv_blocks
        engine.check_integrity()


@pytest.mark.parametrize(
    ("overrides", "shared"),
    [
        # budgets that are not block multiples put chunk ends mid-block
        ({"max_num_batched_tokens": 21, "max_num_seqs": 6}, 0),  # chunked prefill, small budget
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 128}, 0),
        ({"max_num_batched_tokens": 37, "max_num_seqs": 8}, 2 * BLOCK + 3),  # prefix hits
    ],
    ids=["chunked", "whole-prompts", "prefix-cache"],
)
def test_batched_greedy_matches_batch_size_one(
    model_dir: Path,
    oracle: Oracle,
    leak_check: list[LLMEngine],
    overrides: dict[str, object],
    shared: int,
) -> None:
    engine = make_engine(model_dir, **overrides)
    leak_check.append(engine)
    prompts = random_prompts(10, seed=1, shared=shared)
    # the oracle's own logits agree with its greedy tokens (the tie rule relies on them)
    first = oracle.run(prompts[4], GREEDY).output_token_ids[0]
    assert oracle.logits(prompts[4]).argmax().item() == first
    outs = engine.generate(prompts, GREEDY)
    assert [list(o.prompt_token_ids) for o in outs] == prompts
    for out in outs:
        assert out.finished and len(out.output_token_ids) == GREEDY.max_tokens
        oracle.assert_same_greedy(out)
    if shared:
        assert sum(o.num_cached_tokens > 0 for o in outs) >= 1
        # a second pass is served mostly from the cache and still matches
        again = engine.generate(prompts, GREEDY)
        assert all(o.num_cached_tokens >= 2 * BLOCK for o in again)
        for out in again:
            oracle.assert_same_greedy(out)


def test_continuous_batching_with_staggered_arrivals(
    model_dir: Path, oracle: Oracle, leak_check: list[LLMEngine]
) -> None:
    engine = make_engine(model_dir, max_num_batched_tokens=13, max_num_seqs=4)
    leak_check.append(engine)
    prompts = random_prompts(9, seed=2)
    finals: dict[str, RequestOutput] = {}
    streamed: dict[str, list[int]] = {}
    # 1. a new request arrives every other step while earlier ones decode
    for step in range(400):
        if step % 2 == 0 and step // 2 < len(prompts):
            engine.add_request(f"r{step // 2}", prompts[step // 2], GREEDY)
        for out in engine.step():
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
        engine.check_integrity()
        if len(finals) == len(prompts):
            break
    # 2. all finished, the stream adds up to the final output, tokens match the oracle
    assert len(finals) == len(prompts)
    for rid, out in finals.items():
        assert tuple(streamed[rid]) == out.output_token_ids
        oracle.assert_same_greedy(out)


def test_preemption_gives_same_tokens(
    model_dir: Path, oracle: Oracle, leak_check: list[LLMEngine]
) -> None:
    # 14 blocks of 8 tokens; each request needs up to 5: at most ~2-3 fit together
    engine = make_engine(model_dir, num_kv_blocks=14, max_num_batched_tokens=32)
    leak_check.append(engine)
    prompts = [p[:20] for p in random_prompts(6, seed=3, shared=0)]
    params = SamplingParams(max_tokens=20)
    seeded = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=11)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}", prompt, params)
    engine.add_request("seeded", prompts[0], seeded)
    finals: dict[str, RequestOutput] = {}
    saw_preemption = False
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        saw_preemption |= any(r.status is RequestStatus.PREEMPTED for r in engine.scheduler.waiting)
        engine.check_integrity()
    assert saw_preemption, "the scenario should run out of blocks"
    for i in range(len(prompts)):
        oracle.assert_same_greedy(finals[f"g{i}"], params)
    assert finals["seeded"].output_token_ids == oracle.run(prompts[0], seeded).output_token_ids


def test_seeded_sampling_same_alone_and_in_batch(
    model_dir: Path, oracle: Oracle, leak_check: list[LLMEngine]
) -> None:
    engine = make_engine(model_dir, max_num_batched_tokens=24)
    leak_check.append(engine)
    prompts = random_prompts(6, seed=4)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, seed=1234)
    alone = oracle.run(prompts[0], seeded)
    mixed = [
        seeded,
        SamplingParams(max_tokens=16, temperature=0.7),  # unseeded: engine RNG
        GREEDY,
        SamplingParams(max_tokens=9, temperature=1.2, seed=1234),
        seeded,
        GREEDY,
    ]
    outs = engine.generate([prompts[0], *prompts[1:5], prompts[0]], mixed)
    assert outs[0].output_token_ids == alone.output_token_ids
    assert outs[4].output_token_ids == oracle.run(prompts[4], seeded).output_token_ids
    oracle.assert_same_greedy(outs[5])
    # the seeded request really samples: greedy on the same prompt differs somewhere
    assert alone.output_token_ids[:12] != oracle.run(prompts[0], GREEDY).output_token_ids


def test_seeded_sampling_continues_after_tokens_sampled_elsewhere(
    model_dir: Path, oracle: Oracle, leak_check: list[LLMEngine]
) -> None:
    """A migrated request (prompt + its first k tokens, `num_sampled=k`) and a prefilled one
    (first token given, `num_sampled=k - 1` before it) draw what the undisturbed request drew
    at the same positions: the generator skips the draws of the tokens sampled elsewhere."""
    engine = make_engine(model_dir)
    leak_check.append(engine)
    prompt = random_prompts(1, seed=6)[0]
    seeded = SamplingParams(max_tokens=14, temperature=0.9, top_k=40, seed=77)
    whole = list(oracle.run(prompt, seeded).output_token_ids)
    for k in (1, 6):
        rest = dataclasses.replace(seeded, max_tokens=14 - k)
        engine.add_request(f"moved{k}", prompt + whole[:k], rest, num_sampled=k)
        rest_after_first = dataclasses.replace(seeded, max_tokens=15 - k)
        blocks = engine.block_pool.allocate(-(-(len(prompt) + 14) // BLOCK))
        assert blocks is not None
        engine.runner.execute([StepInput(prompt + whole[: k - 1], 0, blocks)])  # the prompt KV
        after = engine.add_prefilled_request(
            f"prefilled{k}", prompt + whole[: k - 1], whole[k - 1], rest_after_first, blocks, k - 1
        )
        assert after is None
        finals = {}
        while engine.has_unfinished():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        assert list(finals[f"moved{k}"].output_token_ids) == whole[k:], k
        assert list(finals[f"prefilled{k}"].output_token_ids) == whole[k - 1 :], k


def test_abort_and_bad_requests(model_dir: Path, leak_check: list[LLMEngine]) -> None:
    engine = make_engine(model_dir, num_kv_blocks=8, max_num_batched_tokens=16)
    leak_check.append(engine)
    prompt = random_prompts(1, seed=5)[0] + [5] * 20
    # 1. abort mid-prefill and mid-decode frees every block
    engine.add_request("a", prompt, GREEDY)
    engine.add_request("b", prompt[:5], GREEDY)
    engine.step()
    assert engine.block_pool.num_free < engine.num_kv_blocks
    assert engine.abort_request("a").finish_reason == "abort"
    engine.step()
    out = engine.abort_request("b")
    assert out.finished and len(out.output_token_ids) >= 1
    # 2. unknown ids, duplicates and impossible requests are errors naming the numbers
    with pytest.raises(KeyError, match="'a'"):
        engine.abort_request("a")
    engine.add_request("c", [7], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("c", [7], GREEDY)
    engine.abort_request("c")
    with pytest.raises(ValueError, match=r"prompt length 1025 exceeds .* 1024"):
        engine.add_request("d", [7] * 1025, GREEDY)
    with pytest.raises(ValueError, match=r"1020 \+ max_tokens 12 = 1032 exceeds .* 1024"):
        engine.add_request("d", [7] * 1020, GREEDY)
    with pytest.raises(ValueError, match=r"needs 9 KV blocks of 8 tokens, but .* only 8"):
        engine.add_request("d", [7] * 60, GREEDY)
    with pytest.raises(ValueError, match="token ids must be ints in \\[0, 1024\\), got 1024"):
        engine.add_request("d", [1024], GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("d", [7], SamplingParams(top_p=0.0))
    with pytest.raises(RuntimeError, match="idle"):
        engine.add_request("e", [7], GREEDY)
        engine.generate([[7]], GREEDY)
    engine.abort_request("e")


def test_engine_config(model_dir: Path) -> None:
    from model_runtime.config import ModelConfig

    with pytest.raises(ValueError, match="max_num_seqs \\(65\\) must not exceed"):
        EngineConfig(max_num_seqs=65, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="extra"):
        EngineConfig(blocksize=8)  # type: ignore[call-arg]
    mc = ModelConfig.from_model_dir(model_dir)
    # tiny: 2 (K,V) * 4 layers * 16 tokens * 2 kv heads * 32 dims * 4 bytes = 32 KiB per block
    assert num_kv_blocks_for(EngineConfig(kv_cache_memory_mb=1), mc) == 32
    assert num_kv_blocks_for(EngineConfig(kv_cache_memory_mb=1, dtype="bfloat16"), mc) == 64
    assert num_kv_blocks_for(EngineConfig(num_kv_blocks=5), mc) == 5
