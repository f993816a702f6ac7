"""The engine's logprobs and min_tokens on the tiny model: top alternatives are the model's own
log-softmax, a batch does not change them, and stop ids cannot end a request early."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_runtime.engine import EngineConfig, LLMEngine
from model_runtime.model_runner import StepInput
from model_runtime.sampling_params import SamplingParams

PROMPT = [5, 17, 300, 42, 9, 77]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine.from_model_dir(tiny_model_dir, EngineConfig(num_kv_blocks=64, block_size=16))


def test_top_logprobs_are_the_log_softmax_of_the_logits(engine: LLMEngine) -> None:
    (out,) = engine.generate([PROMPT], SamplingParams(max_tokens=4, logprobs=5))
    assert len(out.output_top_logprobs) == len(out.output_token_ids) == 4
    tokens = PROMPT + list(out.output_token_ids)
    for i, (tok, lp, top) in enumerate(
        zip(out.output_token_ids, out.output_logprobs, out.output_top_logprobs, strict=True)
    ):
        seen = tokens[: len(PROMPT) + i]
        table = list(range(-(-len(seen) // 16)))
        logits = engine.runner.execute([StepInput(seen, 0, table)])[0]
        want = torch.log_softmax(logits, -1).topk(5)
        assert top is not None and [t for t, _ in top] == want.indices.tolist()
        assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-5)
        assert top[0][0] == tok and lp == pytest.approx(top[0][1], abs=1e-6)  # greedy = top-1
    engine.check_integrity()


def test_logprobs_same_alone_and_in_a_batch(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=5, logprobs=2)
    (alone,) = engine.generate([PROMPT], params)
    batch = engine.generate([[8, 9, 10], PROMPT, list(range(20, 60))], params)
    assert batch[1].output_token_ids == alone.output_token_ids
    assert batch[1].output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)
    (none,) = engine.generate([PROMPT], SamplingParams(max_tokens=5))
    assert none.output_top_logprobs == ()  # not asked for: nothing kept


def test_min_tokens_keeps_stop_ids_from_ending_the_request(engine: LLMEngine) -> None:
    (greedy,) = engine.generate([PROMPT], SamplingParams(max_tokens=6))
    first = greedy.output_token_ids[0]
    (stopped,) = engine.generate([PROMPT], SamplingParams(max_tokens=6, stop_token_ids=(first,)))
    assert stopped.output_token_ids == (first,) and stopped.finish_reason == "stop"
    (held,) = engine.generate(
        [PROMPT], SamplingParams(max_tokens=6, stop_token_ids=(first,), min_tokens=3)
    )
    assert first not in held.output_token_ids[:3]  # banned until 3 tokens exist
    assert len(held.output_token_ids) >= 3
    engine.check_integrity()
