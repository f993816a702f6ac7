"""Greedy tokens of the colocated engine equal HF transformers `generate`, token for token.

Tiny random model (sharp attention, special tokens never the argmax; see
`model_runtime.random_model`), float32. Prompt lengths hit the edge cases: 1 token, block
boundaries (block_size 16: 15/16/17, 31/32/33, 127/128/129), and long prompts.

Near-tie rule: if our token differs from HF's at step k, the test still passes only when HF's
top-2 logits at that step are closer than TIE_TOL (then the difference is float reassociation,
not a bug) — the test reports such cases, and compares nothing after the first divergence.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_runtime.engine import EngineConfig, LLMEngine
from model_runtime.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

LENGTHS = [1, 2, 7, 15, 16, 17, 31, 32, 33, 64, 100, 127, 128, 129, 250, 400]
NEW_TOKENS = 24
TIE_TOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> torch.nn.Module:
    return transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(hf_model: torch.nn.Module) -> list[list[int]]:
    vocab = hf_model.config.vocab_size
    g = torch.Generator().manual_seed(42)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def hf_outputs(
    hf_model: torch.nn.Module, prompts: list[list[int]]
) -> list[tuple[list[int], torch.Tensor]]:
    """(greedy tokens, per-step logits) from HF for each prompt, batch size 1."""
    outs = []
    with torch.inference_mode():
        for p in prompts:
            res = hf_model.generate(
                torch.tensor([p]),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            outs.append((res.sequences[0, len(p) :].tolist(), torch.cat(res.scores)))
    return outs


def _assert_same(ours: list[int], hf: list[int], scores: torch.Tensor, label: str) -> None:
    for k, (a, b) in enumerate(zip(ours, hf, strict=True)):
        if a != b:
            top2 = scores[k].topk(2).values
            gap = (top2[0] - top2[1]).item()
            assert gap < TIE_TOL, (
                f"{label}: token {k} differs (ours {a}, HF {b}); HF top-2 gap {gap:.3g} "
                f"is not a near-tie (< {TIE_TOL})"
            )
            print(f"{label}: near-tie at token {k} (gap {gap:.2g}); later tokens not compared")
            return


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_engine_greedy_equals_hf_batch_size_1(
    tiny_model_dir: Path,
    prompts: list[list[int]],
    hf_outputs: list[tuple[list[int], torch.Tensor]],
    prefix_caching: bool,
) -> None:
    engine = LLMEngine.from_model_dir(
        tiny_model_dir,
        EngineConfig(enable_prefix_caching=prefix_caching, num_kv_blocks=256, max_num_seqs=8),
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    free_at_start = engine.block_pool.num_free
    # With prefix caching, run every prompt twice: the second pass hits the cache for every
    # full block (except the block holding the last prompt token, which is always computed).
    passes = 2 if prefix_caching else 1
    for n in range(passes):
        for i, prompt in enumerate(prompts):
            (out,) = engine.generate([prompt], params)
            if prefix_caching and n == 1:
                expected_hits = ((len(prompt) - 1) // 16) * 16
                assert out.num_cached_tokens == expected_hits, (len(prompt), out.num_cached_tokens)
            _assert_same(list(out.output_token_ids), *hf_outputs[i], label=f"len {len(prompt)}")
    engine.check_integrity()
    assert engine.block_pool.num_free == free_at_start


def test_prefix_hit_from_a_different_prompt(
    tiny_model_dir: Path, prompts: list[list[int]], hf_model: torch.nn.Module
) -> None:
    """Two prompts sharing a 48-token prefix: the second reuses 3 cached blocks, same tokens."""
    shared = prompts[-1][:48]
    a, b = shared + [11, 12, 13, 14, 15], shared + [21, 22, 23]
    engine = LLMEngine.from_model_dir(tiny_model_dir, EngineConfig(num_kv_blocks=128))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.generate([a], params)
    (out_b,) = engine.generate([b], params)
    assert out_b.num_cached_tokens == 48
    with torch.inference_mode():
        ref = hf_model.generate(
            torch.tensor([b]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
        )[0, len(b) :].tolist()
    assert list(out_b.output_token_ids) == ref
