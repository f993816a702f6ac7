"""The proposer seam's contract (`model_runtime.speculative.base.Proposer`), one test over
every implementation: the n-gram proposer, the draft model (tiny random draft) and the tests'
scripted fake (`tests.fakes.proposers.OracleProposer`)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from model_runtime.config import ModelConfig
from model_runtime.engine_config import EngineConfig
from model_runtime.request import Request
from model_runtime.sampling_params import SamplingParams
from model_runtime.speculative.base import Proposer
from model_runtime.speculative.config import DraftConfig
from model_runtime.speculative.draft import DraftProposer
from model_runtime.speculative.ngram import NgramProposer
from tests.fakes.proposers import OracleProposer
from tooling.models.random_model import make_random_model

VOCAB = 1024


def ngram(_: Path) -> Proposer:
    return NgramProposer(1, 3)


def draft(tmp: Path) -> Proposer:
    model = make_random_model(tmp / "draft", "tiny-draft", seed=2)
    cfg = DraftConfig(model=model, num_kv_blocks=32)
    engine = EngineConfig(block_size=8, dtype="float32")
    return DraftProposer.load(cfg, engine, ModelConfig.from_model_dir(model), 32)


def oracle(_: Path) -> Proposer:
    rng = random.Random(1)
    ref = {tuple(prompt(i)): [rng.randrange(VOCAB) for _ in range(64)] for i in range(3)}
    return OracleProposer(ref, VOCAB, lambda i: i % 4 == 3)


def prompt(i: int) -> list[int]:
    rng = random.Random(i)
    body = [rng.randrange(4, VOCAB) for _ in range(5 + 7 * i)]
    return body + body[:4]


@pytest.mark.parametrize("make", [ngram, draft, oracle], ids=["ngram", "draft", "oracle"])
def test_proposer_contract(make: Callable[[Path], Proposer], tmp_path: Path) -> None:
    proposer = make(tmp_path)
    params = [SamplingParams(max_tokens=40), SamplingParams(max_tokens=40, temperature=1.0, seed=3)]
    requests = [Request(f"r{i}", prompt(i), params[i % 2]) for i in range(3)]
    for r in requests:
        if not r.params.greedy:
            r.generator = torch.Generator().manual_seed(r.params.seed or 0)
    rng = random.Random(0)
    for step in range(6):
        limits = [1 + (step + i) % 4 for i in range(len(requests))]
        out = proposer.propose(requests, limits)
        assert len(out) == len(requests)
        for guess, limit in zip(out, limits, strict=True):
            assert len(guess) <= limit
            assert all(isinstance(t, int) and 0 <= t < VOCAB for t in guess)
        proposer.check_integrity({r.request_id for r in requests})
        for r, guess in zip(requests, out, strict=True):  # keep a prefix, then a token
            kept = guess[: rng.randrange(len(guess) + 1)]
            r.output_token_ids.extend([*kept, rng.randrange(4, VOCAB)])
    with pytest.raises(AssertionError):
        proposer.check_integrity({"r0"})
    for r in requests[1:]:
        proposer.release(r.request_id)
    proposer.release("never-proposed-for")  # a no-op
    proposer.check_integrity({"r0"})
    proposer.release("r0")
    proposer.check_integrity(set())
