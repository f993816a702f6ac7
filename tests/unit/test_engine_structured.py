"""Grammar-constrained decoding in the engine and sampler (random tiny model, CPU): outputs
match their constraint, unconstrained neighbours are token-identical to a batch without
constraints, a matcher rebuilt after a hand-off or migration continues the same output, a
first token the grammar refuses is refused, `max_tokens` inside an object ends 'length', and
the masks are applied as a per-token reference would."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from model_runtime.engine import LLMEngine
from model_runtime.engine_config import EngineConfig
from model_runtime.sampler import Sampler, apply_masks
from model_runtime.sampling_params import SamplingParams
from model_runtime.structured import StructuredOutput, choice
from model_runtime.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 50},
        "b": {"enum": ["x", "y"]},
        "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}
JSON = StructuredOutput("json", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine.from_model_dir(
        tiny_model_dir, EngineConfig(num_kv_blocks=256, dtype="float32")
    )


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


def _text(tok: Tokenizer, ids: tuple[int, ...]) -> str:
    return tok.decode(list(ids))


def test_outputs_match_their_constraints(engine: LLMEngine, tok: Tokenizer) -> None:
    prompt = tok.encode("the weather today", add_bos=False)
    params = [
        SamplingParams(max_tokens=80, structured=JSON),
        *(
            SamplingParams(max_tokens=80, temperature=0.8, seed=s, structured=JSON)
            for s in range(4)
        ),
        SamplingParams(max_tokens=10, structured=choice(["yes", "no"])),
        SamplingParams(
            max_tokens=20,
            temperature=1.0,
            seed=3,
            structured=StructuredOutput("regex", "[0-9]{3}-[a-z]{2}"),
        ),
        SamplingParams(max_tokens=40, structured=StructuredOutput("json_object")),
    ]
    outs = engine.generate([prompt] * len(params), params)
    for out in outs[:5]:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(_text(tok, out.output_token_ids)), SCHEMA)
    assert _text(tok, outs[5].output_token_ids) in ("yes", "no")
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", _text(tok, outs[6].output_token_ids))
    obj = _text(tok, outs[7].output_token_ids)  # any object: a random model may run long
    assert obj.startswith("{")
    if outs[7].finish_reason == "stop":
        assert isinstance(json.loads(obj), dict)
    else:
        assert outs[7].finish_reason == "length"
    engine.check_integrity()
    assert engine.block_pool.num_free == engine.num_kv_blocks


def test_unconstrained_rows_unchanged_by_constrained_neighbours(
    engine: LLMEngine, tok: Tokenizer
) -> None:
    prompts = [tok.encode(t, add_bos=False) for t in ("one two", "three four five", "six")]
    free = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, temperature=0.9, seed=7)]
    alone = engine.generate(prompts[:2], free)
    mixed = engine.generate(prompts, [*free, SamplingParams(max_tokens=40, structured=JSON)])
    for a, m in zip(alone, mixed[:2], strict=True):
        assert a.output_token_ids == m.output_token_ids


def test_max_tokens_inside_an_object_is_length(engine: LLMEngine, tok: Tokenizer) -> None:
    out = engine.generate(
        [tok.encode("x", add_bos=False)], SamplingParams(max_tokens=4, structured=JSON)
    )[0]
    assert out.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(_text(tok, out.output_token_ids))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_continuation_after_migration(
    engine: LLMEngine, tok: Tokenizer, temperature: float
) -> None:
    """A migration re-prefills prompt + the k tokens so far with num_sampled = k: the matcher
    is rebuilt over them (and the generator skips their draws), so the continuation is the
    single run's, greedy and seeded."""
    prompt = tok.encode("a config file", add_bos=False)
    params = SamplingParams(max_tokens=60, temperature=temperature, seed=11, structured=JSON)
    whole = engine.generate([prompt], params)[0].output_token_ids
    k = 5
    assert len(whole) > k
    engine.add_request("mig", prompt + list(whole[:k]), _fewer(params, k), num_sampled=k)
    tail: tuple[int, ...] = ()
    while engine.has_unfinished():
        for out in engine.step():
            tail = out.output_token_ids
    assert tuple(whole[:k]) + tail == tuple(whole)


def _fewer(params: SamplingParams, k: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, max_tokens=params.max_tokens - k)


def test_first_token_the_grammar_refuses_is_refused(engine: LLMEngine, tok: Tokenizer) -> None:
    prompt = tok.encode("hello", add_bos=False)
    params = SamplingParams(max_tokens=20, structured=JSON)
    blocks = engine.block_pool.allocate(4)
    assert blocks is not None
    bad = tok.encode("[", add_bos=False)[0]
    with pytest.raises(ValueError, match="not allowed by its grammar"):
        engine.add_prefilled_request("p", prompt, bad, params, blocks)
    engine.block_pool.free(blocks)
    with pytest.raises(ValueError, match="output token 0"):
        engine.add_request("m", prompt + [bad], params, num_sampled=1)


def test_apply_masks_matches_a_per_token_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word is partial
    logits = torch.randn(5, vocab, generator=gen)
    allowed = [
        set(np.random.default_rng(r).choice(vocab, 7, replace=False).tolist()) for r in range(2)
    ]
    masks = np.zeros((2, 4), dtype=np.int32)
    for k, ids in enumerate(allowed):
        for t in ids:
            masks[k, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    out = logits.clone()
    apply_masks(out, masks, [1, 3])
    for row in range(5):
        for t in range(vocab):
            keep = row not in (1, 3) or t in allowed[[1, 3].index(row)]
            assert (out[row, t] == logits[row, t]) if keep else out[row, t] == float("-inf")
    # the sampler: greedy and sampled rows pick only allowed tokens
    params = [SamplingParams(temperature=0.0 if r % 2 else 1.0, seed=r) for r in range(5)]
    gens = [torch.Generator().manual_seed(r) for r in range(5)]
    for _ in range(20):
        picked = Sampler().sample(logits, params, gens, None, masks, [1, 3]).token_ids
        assert picked[1] in allowed[0] and picked[3] in allowed[1]
