"""What migration promises about the tokens, stated as it is (issue 39).

A migrated request's new leg prefills the prompt plus every token already sent, then decodes
on (`router.flow`). The undisturbed run computed those tokens' KV one decode step at a time;
the new leg computes them in one prefill. Same math, different matrix shapes, so different
summation orders and rounding points:

- float32: the logits of the two paths are bit-identical here (measured: max difference 0.0
  between a one-shot prefill of prompt + k tokens and k decode steps, over the prompts and cut
  points below), so greedy output is token for token the undisturbed run's — exact;
- bfloat16: every op rounds to 8 significant bits, in other places for the two shapes, and the
  tiny model's sharp attention amplifies it: the two paths' logits differ by up to 6.8 % of the
  top logit (0.21 absolute; measured as above), so at a near-tie the argmax may flip (about 1
  in 100 migrated streams in the issue's probe). Greedy output equals the undisturbed run up to
  the first position where the two differ, and there the migrated token's logit (the context
  prefilled once) is within `BF16_TIE_REL` (2^-3, twice the measured spread) of the top logit —
  DESIGN.md §5's near-tie rule with a tolerance for bf16; a real bug (a wrong position or a
  lost KV entry) picks tokens a whole logit unit or more below the top.

The engine runs both legs here (a migration's new leg is a prefill on a prefill worker, whose
KV moves bit for bit to a decode worker that goes on with the same engine code).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from model_runtime.engine import EngineConfig, LLMEngine
from model_runtime.model_runner import StepInput
from model_runtime.sampling_params import SamplingParams

N = 40  # tokens of each stream
CUTS = (1, 4, 13, 29)  # where a stream moves: after that many tokens
BF16_TIE_REL = 2**-3  # of the top logit: twice the measured bf16 spread of the two paths


def _prompts() -> list[list[int]]:
    rng = random.Random(39)
    return [[rng.randrange(4, 1000) for _ in range(n)] for n in (1, 7, 16, 33, 100, 250)]


def _moved(engine: LLMEngine, prompt: list[int], tokens: list[int], cut: int) -> list[int]:
    """The stream if it moved after `cut` tokens: the undisturbed run's first `cut`, then a
    new leg from prompt + those tokens."""
    params = SamplingParams(max_tokens=N - cut, ignore_eos=True)
    (out,) = engine.generate([prompt + tokens[:cut]], params)
    return tokens[:cut] + list(out.output_token_ids)


def _undisturbed(engine: LLMEngine, prompt: list[int]) -> list[int]:
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=N, ignore_eos=True))
    return list(out.output_token_ids)


def test_float32_migration_is_exact(tiny_model_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(tiny_model_dir, EngineConfig(num_kv_blocks=256))
    for prompt in _prompts():
        tokens = _undisturbed(engine, prompt)
        for cut in CUTS:
            assert _moved(engine, prompt, tokens, cut) == tokens, (len(prompt), cut)
    engine.check_integrity()


@pytest.mark.parametrize("cut", CUTS)
def test_bfloat16_migration_equals_up_to_a_near_tie(tiny_model_dir: Path, cut: int) -> None:
    engine = LLMEngine.from_model_dir(
        tiny_model_dir, EngineConfig(dtype="bfloat16", num_kv_blocks=256)
    )
    ties = 0
    for prompt in _prompts():
        tokens = _undisturbed(engine, prompt)
        moved = _moved(engine, prompt, tokens, cut)
        k = next((i for i, (a, b) in enumerate(zip(moved, tokens, strict=True)) if a != b), None)
        if k is None:
            continue
        context = prompt + tokens[:k]
        table = list(range(-(-len(context) // engine.config.block_size)))
        logits = engine.runner.execute([StepInput(context, 0, table)])[0].float()
        top = logits.max().item()
        gap = top - logits[moved[k]].item()
        assert gap <= BF16_TIE_REL * abs(top), (
            f"prompt of {len(prompt)}, moved after {cut}: token {k} is {moved[k]}, undisturbed "
            f"{tokens[k]}; its logit is {gap:.3g} below the top {top:.3g}: not a bf16 near-tie"
        )
        ties += 1
        print(f"prompt of {len(prompt)}, moved after {cut}: bf16 near-tie at token {k}")
    print(f"{ties} of {len(_prompts())} streams moved after {cut} tokens met a near-tie")
    engine.check_integrity()
