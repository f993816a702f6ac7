"""The int8 KV cache (`engine.kv_cache_dtype = "int8"`) on the tiny random model, in process.

- Fidelity: perplexity on the tiny model's own corpus (`tooling.models.corpus.PROSE`, the text
  its tokenizer was trained on) within 0.5 % of the full-precision cache's, in float32 and
  bfloat16; greedy (teacher-forced) agreement is printed and must stay above a floor. The tiny
  model is a harsh oracle for KV noise: its q/k projections are scaled up so attention is sharp
  (DESIGN section 5), which turns a one-step int8 rounding of a key into a visible change of
  the attention weights (a bfloat16 cache alone moves its perplexity by ~0.1 %).
- Batching never changes tokens: continuous batching with chunked prefill under a small budget
  and prefix-cache hits give the batch-size-one engine's greedy tokens (both int8). Attention
  reads every token back from the cache, so a token's keys are the same quantized bytes
  whichever chunk or request computed them; float32 summation order can still move a K/V value
  across an int8 rounding boundary, hence the near-tie rule with `TIE_TOL`.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from model_runtime.engine import EngineConfig, LLMEngine
from model_runtime.model_runner import ModelRunner, StepInput
from model_runtime.sampling_params import SamplingParams
from model_runtime.tokenizer import Tokenizer
from tooling.models.corpus import PROSE
from tooling.models.perplexity import agreement, score

BLOCK = 16
PPL_BOUND = 0.005
AGREEMENT_FLOOR = 0.75  # measured 0.83 (float32) and 0.79 (bfloat16) on seed 0
TIE_TOL = 0.05  # one int8 step of one key, seen through the tiny model's sharp attention


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_kv_perplexity_within_half_a_percent(tiny_model_dir: Path, dtype: str) -> None:
    ids = Tokenizer.from_model_dir(tiny_model_dir).encode(PROSE, add_bos=False)
    blocks = -(-len(ids) // BLOCK)
    runs = {}
    for kv in ("auto", "int8"):
        runner = ModelRunner.from_model_dir(
            tiny_model_dir, blocks, BLOCK, dtype=dtype, kv_cache_dtype=kv
        )
        runs[kv] = score(runner, ids)
    full, int8 = runs["auto"], runs["int8"]
    ratio = int8.ppl / full.ppl
    agree = agreement(int8, full)
    print(
        f"tiny {dtype}: ppl {full.ppl:.2f} -> {int8.ppl:.2f} ({ratio:.4f}x), "
        f"greedy agreement {agree:.3f} over {full.tokens} tokens"
    )
    assert abs(ratio - 1) <= PPL_BOUND, f"int8 KV perplexity {ratio:.4f}x the full cache's"
    assert agree >= AGREEMENT_FLOOR, f"greedy agreement {agree:.3f}"


def _engine(model_dir: Path, **overrides: object) -> LLMEngine:
    fields: dict[str, object] = {
        "block_size": BLOCK,
        "num_kv_blocks": 64,
        "kv_cache_dtype": "int8",
        **overrides,
    }
    return LLMEngine.from_model_dir(model_dir, EngineConfig(**fields))  # type: ignore[arg-type]


def test_int8_batching_chunking_and_prefix_hits_keep_tokens(tiny_model_dir: Path) -> None:
    oracle = _engine(
        tiny_model_dir,
        max_num_seqs=1,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
    )
    batched = _engine(tiny_model_dir, max_num_batched_tokens=21, max_num_seqs=6)
    assert batched.runner.kv_cache.quantized and oracle.runner.kv_cache.quantized
    rng = random.Random(4)
    prefix = [rng.randrange(3, 1024) for _ in range(2 * BLOCK + 3)]  # shared: prefix-cache hits
    prompts = [prefix + [rng.randrange(3, 1024) for _ in range(n)] for n in (1, 9, 16, 37, 5)]
    params = SamplingParams(max_tokens=10)
    got = batched.generate(prompts, params)
    assert any(out.num_cached_tokens > 0 for out in got), "no prefix-cache hit"
    for out in got:
        prompt = list(out.prompt_token_ids)
        (want,) = oracle.generate([prompt], params)
        pairs = zip(out.output_token_ids, want.output_token_ids, strict=True)
        for i, (a, b) in enumerate(pairs):
            if a != b:
                table = list(range(-(-(len(prompt) + i) // BLOCK)))
                ctx = prompt + list(want.output_token_ids[:i])
                logits = oracle.runner.execute([StepInput(ctx, 0, table)])[0]
                gap = float(logits.max() - logits[a])
                assert gap <= TIE_TOL, f"{out.request_id} token {i}: {a} vs {b}, gap {gap:.3g}"
                break
    for engine in (batched, oracle):
        assert engine.block_pool.num_free == engine.num_kv_blocks
        engine.check_integrity()
