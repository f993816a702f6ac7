"""How close a quantized model is to its float original: perplexity on the project's own text
and greedy agreement (tests, `benchmarks/bench_quant.py`). Runs in the calling process, on
`ModelRunner`s (no scheduler, no sampler: the logits themselves).

`perplexity` feeds a token stream through a runner and scores each next token. Two ways:

- "decode" (what a served stream computes): the first token as a one-token prefill, then one
  decode step per token (teacher forcing), so every score comes from the decode path (the
  fused C step, with int8 activations where the engine uses them).
- "prefill": the stream in chunks of `chunk` tokens, each chunk's every position scored (the
  prefill path), which is ~100x faster.

The text is `tooling.goodput.text_prompts.CORPUS` (shipped with the project) in the model's
own tokens, cut to `max_tokens` (the stream restarts the context every `context` tokens: a
window's first token has no history and is not scored).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from model_runtime.model_runner import ModelRunner, StepInput

Path_ = Literal["decode", "prefill"]


def _table(runner: ModelRunner, tokens: int) -> list[int]:
    need = -(-tokens // runner.block_size)
    if need > runner.kv_cache.num_blocks:
        raise ValueError(
            f"{tokens} tokens need {need} KV blocks, the runner has {runner.kv_cache.num_blocks}"
        )
    return list(range(need))


@torch.inference_mode()
def window_logits(
    runner: ModelRunner, ids: list[int], path: Path_, chunk: int = 64
) -> torch.Tensor:
    """float32 logits [len(ids) - 1, vocab]: row i scores ids[i + 1] after ids[: i + 1]."""
    table = _table(runner, len(ids))
    rows: list[torch.Tensor] = []
    if path == "decode":
        for i, t in enumerate(ids[:-1]):
            rows.append(runner.execute([StepInput([t], i, table)])[0])
        return torch.stack(rows)
    model = runner.model
    for start in range(0, len(ids) - 1, chunk):
        part = ids[start : min(start + chunk, len(ids) - 1)]
        input_ids, positions, meta, _ = runner.build_metadata([StepInput(part, start, table)])
        hidden = model(input_ids, positions, runner.kv_cache, meta, runner.backend)
        rows.append(model.compute_logits(hidden))
    return torch.cat(rows)


@dataclass(frozen=True)
class Perplexity:
    value: float
    tokens: int  # tokens scored


def perplexity(runner: ModelRunner, ids: list[int], path: Path_, context: int = 256) -> Perplexity:
    """exp(mean negative log-likelihood) of `ids` under `runner`, in windows of `context`."""
    nll, n = 0.0, 0
    for start in range(0, len(ids) - 1, context):
        window = ids[start : start + context]
        if len(window) < 2:
            break
        logits = window_logits(runner, window, path)
        target = torch.tensor(window[1:])
        nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        n += len(window) - 1
    return Perplexity(math.exp(nll / n), n)


@dataclass(frozen=True)
class Agreement:
    """Greedy continuations of one prompt by a model and its reference."""

    tokens: list[int]
    reference: list[int]
    first_difference: int | None  # index of the first differing token, None if none
    gap: float  # at that index: the reference's logit margin of its token over ours (0 if none)


@torch.inference_mode()
def greedy(runner: ModelRunner, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """`n` greedy tokens after `prompt` (prefill, then decode steps) and the logits before each."""
    table = _table(runner, len(prompt) + n)
    logits = [runner.execute([StepInput(prompt, 0, table)])[0]]
    out: list[int] = []
    for i in range(n):
        out.append(int(logits[-1].argmax()))
        if i + 1 < n:
            logits.append(runner.execute([StepInput([out[-1]], len(prompt) + i, table)])[0])
    return out, logits


def agreement(runner: ModelRunner, reference: ModelRunner, prompt: list[int], n: int) -> Agreement:
    """`runner`'s greedy tokens against `reference`'s, with the reference's margin where they
    first part (a near-tie when small: the rule of DESIGN.md §5)."""
    ours, _ = greedy(runner, prompt, n)
    theirs, ref_logits = greedy(reference, prompt, n)
    k = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    gap = 0.0 if k is None else float(ref_logits[k][theirs[k]] - ref_logits[k][ours[k]])
    return Agreement(ours, theirs, k, gap)
