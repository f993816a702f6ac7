"""Speculative decoding in the colocated engine on the tiny random model, float32: the same
tokens as without it, whatever is proposed.

The proposer is `tests.fakes.proposers.OracleProposer` (the reference output, wrong where a
test says) or the real n-gram proposer; the reference is the same engine configuration
without speculation. Every run ends with `check_integrity` (blocks and speculation state) and
every block free.

Near-tie rule (as tests/integration/test_engine.py): a verified step's rows and a plain step's
row go through the same fused C step, but a step that also holds a prefill chunk runs on the
torch path, whose float32 sums differ in the last bits; a token may then differ only where
the reference is at a near-tie (`TIE_TOL`), and nothing after it is compared.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from model_runtime.config import ModelConfig
from model_runtime.engine import EngineConfig, LLMEngine
from model_runtime.model_runner import StepInput
from model_runtime.request import RequestOutput
from model_runtime.sampling_params import SamplingParams
from model_runtime.speculative.config import DraftConfig, NgramConfig
from model_runtime.speculative.draft import DraftProposer
from model_runtime.speculative.speculator import Speculator
from model_runtime.structured import StructuredOutput
from tests.fakes.proposers import OracleProposer
from tooling.models.random_model import make_random_model

BLOCK = 8
TIE_TOL = 1e-3
K = 4
ROWS = 64  # max_step_rows: every request of a test's batch may speculate
LENGTHS = [1, 7, 8, 9, 15, 17, 30]


def prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 1024) for _ in range(n)] for n in LENGTHS]


def config(**kw: object) -> EngineConfig:
    base: dict[str, object] = {
        "block_size": BLOCK,
        "num_kv_blocks": 128,
        "dtype": "float32",
        "max_num_seqs": 16,
    }
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def spec_engine(
    model_dir: Path,
    reference: Sequence[RequestOutput],
    wrong: Callable[[int], bool],
    **kw: object,
) -> tuple[LLMEngine, OracleProposer]:
    """An engine of its own (its own KV cache: engines never share one) whose speculation
    proposes `reference`'s tokens, wrong where `wrong(output index)` says."""
    proposer = OracleProposer(
        {r.prompt_token_ids: r.output_token_ids for r in reference},
        ModelConfig.from_model_dir(model_dir).vocab_size,
        wrong,
    )
    spec = NgramConfig(num_speculative_tokens=K, max_step_rows=ROWS)
    engine = LLMEngine.from_model_dir(model_dir, config(speculative=spec, **kw), proposer=proposer)
    return engine, proposer


def assert_same(
    engine: LLMEngine, got: Sequence[RequestOutput], want: Sequence[RequestOutput]
) -> None:
    """Equal tokens and finish reasons, or a first difference at a reference near-tie."""
    for g, w in zip(got, want, strict=True):
        if g.output_token_ids == w.output_token_ids:
            assert g.finish_reason == w.finish_reason
            continue
        i = next(
            j
            for j, (a, b) in enumerate(zip(g.output_token_ids, w.output_token_ids, strict=False))
            if a != b
        )
        tokens = list(w.prompt_token_ids) + list(w.output_token_ids[:i])
        table = list(range(-(-len(tokens) // BLOCK)))
        ref = engine.runner.execute([StepInput(tokens, 0, table)])[0]
        gap = (ref.max() - ref[g.output_token_ids[i]]).item()
        assert gap <= TIE_TOL, (g.request_id, i, g.output_token_ids, w.output_token_ids, gap)


def assert_same_logprobs(got: RequestOutput, want: RequestOutput) -> None:
    """The target's logprobs: each token's and its top alternatives' (ids equal, values
    close: a verified row and a plain row may sum in a different order)."""
    torch.testing.assert_close(
        torch.tensor(got.output_logprobs), torch.tensor(want.output_logprobs)
    )
    for g, w in zip(got.output_top_logprobs, want.output_top_logprobs, strict=True):
        assert g is not None and w is not None
        assert [t for t, _ in g] == [t for t, _ in w]
        torch.testing.assert_close(torch.tensor([v for _, v in g]), torch.tensor([v for _, v in w]))


def idle_check(engine: LLMEngine) -> None:
    engine.check_integrity()
    assert engine.block_pool.num_free == engine.num_kv_blocks


PATTERNS: dict[str, Callable[[int], bool]] = {
    "all-right": lambda i: False,
    "all-wrong": lambda i: True,
    "every-third-wrong": lambda i: i % 3 == 2,
    "scattered": lambda i: (i * 7919) % 5 in (1, 3),
}


@pytest.mark.parametrize(
    ("pattern", "kv"), [(p, "auto") for p in PATTERNS] + [("scattered", "int8")]
)
def test_greedy_tokens_equal_without_speculation(
    tiny_model_dir: Path, pattern: str, kv: str
) -> None:
    params = SamplingParams(max_tokens=20)
    base = LLMEngine.from_model_dir(tiny_model_dir, config(kv_cache_dtype=kv))
    want = base.generate(prompts(), params)
    engine, proposer = spec_engine(tiny_model_dir, want, PATTERNS[pattern], kv_cache_dtype=kv)
    got = engine.generate(prompts(), params)
    assert_same(base, got, want)
    idle_check(engine)
    stats = engine.speculator.stats  # type: ignore[union-attr]
    assert proposer.proposed > 0 and stats.num_draft_tokens == proposer.proposed
    if pattern == "all-right":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    if pattern == "all-wrong":
        assert stats.num_accepted_tokens == 0


def test_seeded_sampling_gives_the_same_tokens_and_logprobs(tiny_model_dir: Path) -> None:
    """One race per emitted token: a seeded request draws what it draws without speculation,
    whatever was accepted (top-k, top-p, logprobs too)."""
    base = LLMEngine.from_model_dir(tiny_model_dir, config())
    cases = [
        SamplingParams(max_tokens=16, temperature=1.0, seed=11),
        SamplingParams(max_tokens=16, temperature=0.8, top_k=50, top_p=0.9, seed=12, logprobs=3),
    ]
    for params in cases:
        want = base.generate(prompts(), params)
        engine, _ = spec_engine(tiny_model_dir, want, PATTERNS["every-third-wrong"])
        got = engine.generate(prompts(), params)
        for g, w in zip(got, want, strict=True):
            assert g.output_token_ids == w.output_token_ids
            if params.logprobs is not None:
                assert_same_logprobs(g, w)
        idle_check(engine)


def test_stop_rules_and_logprobs_as_without_speculation(tiny_model_dir: Path) -> None:
    """min_tokens (banned ids row by row), stop ids, max_tokens, greedy logprobs."""
    base = LLMEngine.from_model_dir(tiny_model_dir, config())
    free = base.generate(prompts(), SamplingParams(max_tokens=12))
    stop_id = free[2].output_token_ids[5]  # a token greedy decoding reaches
    params = SamplingParams(max_tokens=12, min_tokens=4, stop_token_ids=(stop_id,), logprobs=2)
    want = base.generate(prompts(), params)
    assert any(w.finish_reason == "stop" for w in want)
    engine, _ = spec_engine(tiny_model_dir, want, PATTERNS["scattered"])
    got = engine.generate(prompts(), params)
    assert_same(base, got, want)
    for g, w in zip(got, want, strict=True):
        if g.output_token_ids == w.output_token_ids:
            assert_same_logprobs(g, w)
    idle_check(engine)


def test_grammar_constrained_requests_keep_their_grammar(tiny_model_dir: Path) -> None:
    """Each verification row is masked by the matcher after the accepted proposals; wrong
    proposals (outside the grammar too) are rejected, the matcher rolled back."""
    so = StructuredOutput.of("regex", "[a-z ]{3,40}")
    params = SamplingParams(max_tokens=20, structured=so)
    base = LLMEngine.from_model_dir(tiny_model_dir, config())
    want = base.generate(prompts(), params)
    engine, proposer = spec_engine(tiny_model_dir, want, PATTERNS["every-third-wrong"])
    got = engine.generate(prompts(), params)
    assert [g.output_token_ids for g in got] == [w.output_token_ids for w in want]
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    assert proposer.proposed > 0
    idle_check(engine)


def test_opted_out_requests_are_not_speculated(tiny_model_dir: Path) -> None:
    params = SamplingParams(max_tokens=10, speculative=False)
    base = LLMEngine.from_model_dir(tiny_model_dir, config())
    want = base.generate(prompts(), params)
    engine, proposer = spec_engine(tiny_model_dir, want, PATTERNS["all-right"])
    got = engine.generate(prompts(), params)
    assert [g.output_token_ids for g in got] == [w.output_token_ids for w in want]
    assert proposer.proposed == 0
    idle_check(engine)


def test_verification_beside_a_prefill_chunk(tiny_model_dir: Path) -> None:
    """Staggered arrivals: verified rows share steps with prefill chunks (the torch path,
    causal attention over the proposals inside the paged cache) under a small budget."""
    params = SamplingParams(max_tokens=14)
    base = LLMEngine.from_model_dir(tiny_model_dir, config())
    ps = prompts(5)
    want = base.generate(ps, params)
    engine, _ = spec_engine(tiny_model_dir, want, PATTERNS["scattered"], max_num_batched_tokens=16)
    pending = list(enumerate(ps))
    final: dict[str, RequestOutput] = {}
    while pending or engine.has_unfinished():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.check_integrity()
    got = [final[f"r{i}"] for i in range(len(ps))]
    assert_same(base, got, want)
    idle_check(engine)


def test_ngram_proposer_end_to_end(tiny_model_dir: Path) -> None:
    """The real n-gram proposer on prompts that repeat themselves."""
    rng = random.Random(9)
    ps = []
    for n in (6, 20, 40):
        body = [rng.randrange(4, 1024) for _ in range(n)]
        ps.append(body + body + body[: n // 2])
    params = SamplingParams(max_tokens=24)
    base = LLMEngine.from_model_dir(tiny_model_dir, config())
    want = base.generate(ps, params)
    spec = NgramConfig(num_speculative_tokens=3, max_step_rows=ROWS)
    engine = LLMEngine.from_model_dir(tiny_model_dir, config(speculative=spec))
    got = engine.generate(ps, params)
    assert_same(base, got, want)
    assert isinstance(engine.speculator, Speculator)
    idle_check(engine)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random draft (a different, smaller model with the target's tokenizer)."""
    return make_random_model(tmp_path_factory.mktemp("draft"), "tiny-draft", seed=1)


def draft_engine(draft: Path, target: Path, **kw: object) -> LLMEngine:
    spec = DraftConfig(model=draft, num_speculative_tokens=K, num_kv_blocks=64, max_step_rows=ROWS)
    return LLMEngine.from_model_dir(target, config(speculative=spec, **kw))


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_draft_model_that_agrees_is_accepted_and_tokens_are_unchanged(
    tiny_model_dir: Path, kv: str
) -> None:
    """The target as its own draft: every guess is kept, greedy and seeded sampled alike
    (the draft guesses with the races the target will draw), and the tokens are the ones
    without speculation."""
    base = LLMEngine.from_model_dir(tiny_model_dir, config(kv_cache_dtype=kv))
    engine = draft_engine(tiny_model_dir, tiny_model_dir, kv_cache_dtype=kv)
    for params in (
        SamplingParams(max_tokens=16),
        SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=4),
    ):
        want = base.generate(prompts(), params)
        got = engine.generate(prompts(), params)
        assert_same(base, got, want)
        idle_check(engine)
        stats = engine.speculator.stats  # type: ignore[union-attr]
        assert stats.num_draft_tokens > 0
        assert stats.acceptance_rate > 0.9, stats
    proposer = engine.speculator.proposer  # type: ignore[union-attr]
    assert isinstance(proposer, DraftProposer)
    assert proposer.pool.num_free == proposer.pool.num_blocks


def test_random_draft_changes_nothing_but_speed(tiny_model_dir: Path, draft_dir: Path) -> None:
    """An unrelated draft: almost nothing accepted, tokens unchanged, k backs off, the
    draft's KV blocks all back."""
    params = SamplingParams(max_tokens=24)
    base = LLMEngine.from_model_dir(tiny_model_dir, config())
    want = base.generate(prompts(), params)
    engine = draft_engine(draft_dir, tiny_model_dir)
    got = engine.generate(prompts(), params)
    assert_same(base, got, want)
    idle_check(engine)
    stats = engine.speculator.stats  # type: ignore[union-attr]
    # backed off: far fewer proposals than k per step
    assert stats.num_draft_tokens < K * len(LENGTHS) * params.max_tokens / 3, stats


def test_draft_must_share_the_vocabulary(
    tiny_model_dir: Path, draft_dir: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    shutil.copytree(draft_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] += 1
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="vocab_size 1025 is not the target's 1024"):
        draft_engine(other, tiny_model_dir)
    vocab = json.loads((other / "tokenizer.json").read_text())
    vocab["model"]["vocab"]["zzz"] = vocab["model"]["vocab"].pop(
        next(iter(vocab["model"]["vocab"]))
    )
    (other / "tokenizer.json").write_text(json.dumps(vocab))
    cfg["vocab_size"] -= 1
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="tokenizer"):
        draft_engine(other, tiny_model_dir)


def test_many_seeds_sample_the_same_tokens_with_a_random_draft(
    tiny_model_dir: Path, draft_dir: Path
) -> None:
    """Per seed, the speculative engine's sampled tokens are the plain engine's (so their
    frequencies over seeds are too; `tests/unit/test_spec_verify.py` checks them against the
    exact distribution)."""
    prompt = prompts()[3]
    cases = [SamplingParams(max_tokens=8, temperature=1.2, seed=s) for s in range(48)]
    base = LLMEngine.from_model_dir(tiny_model_dir, config())
    engine = draft_engine(draft_dir, tiny_model_dir)
    want = base.generate([prompt] * len(cases), cases)
    got = engine.generate([prompt] * len(cases), cases)
    assert [g.output_token_ids for g in got] == [w.output_token_ids for w in want]
    assert len({w.output_token_ids for w in want}) > 10  # the seeds do sample differently
    idle_check(engine)


@pytest.mark.parametrize("method", ["ngram", "self-draft"])
def test_a_migrated_request_continues_as_if_undisturbed(tiny_model_dir: Path, method: str) -> None:
    """A migration's new leg: prompt + tokens so far, `num_sampled` of them sampled elsewhere.
    The proposer's state is rebuilt from the tokens on the new engine (n-gram: its index; the
    draft: a prefill of its KV), and greedy and seeded tokens continue as without any move."""
    spec = (
        NgramConfig(num_speculative_tokens=K, prompt_lookup_min=1, max_step_rows=ROWS)
        if method == "ngram"
        else DraftConfig(model=tiny_model_dir, num_speculative_tokens=K, num_kv_blocks=64)
    )
    base = LLMEngine.from_model_dir(tiny_model_dir, config())
    prompt = prompts()[4]
    total, moved = 20, 7
    for params in (
        SamplingParams(max_tokens=total),
        SamplingParams(max_tokens=total, temperature=0.9, seed=21),
    ):
        (want,) = base.generate([prompt], params)
        first = LLMEngine.from_model_dir(tiny_model_dir, config(speculative=spec))
        (head,) = first.generate([prompt], dataclasses.replace(params, max_tokens=moved))
        assert head.output_token_ids == want.output_token_ids[:moved]
        second = LLMEngine.from_model_dir(tiny_model_dir, config(speculative=spec))
        rest = dataclasses.replace(params, max_tokens=total - moved)
        second.add_request("moved", prompt + list(head.output_token_ids), rest, num_sampled=moved)
        outs = []
        while second.has_unfinished():
            outs += second.step()
            second.check_integrity()
        assert outs[-1].output_token_ids == want.output_token_ids[moved:]
        idle_check(second)
