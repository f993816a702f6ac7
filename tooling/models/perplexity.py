"""Perplexity and greedy agreement of a model as the engine runs it, on a token stream (the
fidelity measure for lossy serving options: an int8 KV cache, quantized weights). Runs in the
calling process (tests, benchmarks), on a `ModelRunner` it is given.

`score` feeds the stream through the runner's own model, KV cache and attention backend in
prefill chunks of `chunk` tokens (each chunk attends to the earlier ones through the paged
cache, as a chunked prefill does), and keeps every position's float32 log-probabilities of the
next token: the mean negative log-likelihood, its exponential (perplexity) and the
teacher-forced argmax at each position. `agreement` compares two runs position by position;
given the other run's choices (`against`), a score also keeps how far below its own best logit
each of them is (`gaps`), so a disagreement can be told from a near-tie. With `chunk=1` every
position is a one-token engine step (`ModelRunner.execute`): the decode path itself, the fused
C step where the runner has it (quantized weights with int8 activations multiply as served;
prefill chunks dequantize them).

`parting` is the other half of the fidelity rule: free-running greedy continuations of a
prompt by a model and its reference, where they first part and by how much the reference
preferred its own token there (a near-tie when small, DESIGN.md §5).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model_runtime.model_runner import ModelRunner, StepInput


@dataclass(frozen=True)
class Score:
    """A model's fit to one token stream: `nll` per predicted token (nats), `ppl` = e^nll,
    `argmax[i]` its greedy choice for token i + 1 given tokens 0..i."""

    tokens: int
    nll: float
    argmax: tuple[int, ...]
    gaps: tuple[float, ...] = ()  # best logit - logit of `against[i]`, when given

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)


def score(
    runner: ModelRunner,
    ids: Sequence[int],
    window: int | None = None,
    chunk: int = 256,
    against: Sequence[int] | None = None,
) -> Score:
    """Teacher-forced NLL of `ids` through `runner`, in windows of `window` tokens (default:
    the model's context; each window starts a fresh context and predicts its tokens 1..n-1).
    The runner's KV cache must hold one window (blocks 0, 1, ... are overwritten).
    `against`: another run's `argmax` on the same stream and windows (fills `gaps`)."""
    window = window or runner.config.max_position_embeddings
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    need = -(-min(window, len(ids)) // runner.block_size)
    if need > runner.kv_cache.num_blocks:
        raise ValueError(
            f"a window of {min(window, len(ids))} tokens needs {need} KV blocks of "
            f"{runner.block_size}, the runner has {runner.kv_cache.num_blocks}"
        )
    argmax: list[int] = []
    gaps: list[float] = []
    total = 0.0
    for start in range(0, len(ids), window):
        part = list(ids[start : start + window])
        if len(part) < 2:
            break
        other = None if against is None else against[len(argmax) : len(argmax) + len(part) - 1]
        nll, best, gap = _window(runner, part, chunk, other)
        total += nll
        argmax += best
        gaps += gap
    if not argmax:
        raise ValueError(f"ids must hold at least 2 tokens, got {len(ids)}")
    if against is not None and len(against) != len(argmax):
        raise ValueError(f"against has {len(against)} choices for {len(argmax)} positions")
    return Score(len(argmax), total / len(argmax), tuple(argmax), tuple(gaps))


@torch.inference_mode()
def _window(
    runner: ModelRunner, ids: list[int], chunk: int, against: Sequence[int] | None
) -> tuple[float, list[int], list[float]]:
    """(summed NLL of ids[1:], greedy choice at each of ids[:-1], gaps to `against`) for one
    context."""
    table = list(range(-(-len(ids) // runner.block_size)))
    total, argmax, gaps = 0.0, [], []
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        if chunk == 1:  # a decode step, as the engine runs it (the fused C step where it can)
            logits = runner.execute([StepInput(piece, start, table)])
        else:
            input_ids, positions, meta, _ = runner.build_metadata([StepInput(piece, start, table)])
            hidden = runner.model(input_ids, positions, runner.kv_cache, meta, runner.backend)
            logits = runner.model.compute_logits(hidden)
        logp = torch.log_softmax(logits.float(), dim=-1)
        targets = ids[start + 1 : start + 1 + len(piece)]  # the last chunk: one fewer
        if not targets:  # a last chunk of the final token alone predicts nothing
            break
        rows = torch.arange(len(targets))
        total -= float(logp[rows, torch.tensor(targets, dtype=torch.long)].sum())
        best = logp[: len(targets)].max(-1)
        argmax += best.indices.tolist()
        if against is not None:
            theirs = torch.tensor(list(against[start : start + len(targets)]))
            gaps += (best.values - logp[rows, theirs]).tolist()
    return total, argmax, gaps


def agreement(a: Score, b: Score) -> float:
    """Share of positions where the two runs' greedy choices are the same token."""
    if a.tokens != b.tokens:
        raise ValueError(f"scores of different streams: {a.tokens} and {b.tokens} tokens")
    return sum(x == y for x, y in zip(a.argmax, b.argmax, strict=True)) / a.tokens


@dataclass(frozen=True)
class Parting:
    """Greedy continuations of one prompt by a model (`tokens`) and its reference."""

    tokens: list[int]
    reference: list[int]
    first_difference: int | None  # index of the first differing token, None if none
    gap: float  # there: the reference's logit of its token minus of ours (0.0 if none)


@torch.inference_mode()
def greedy(
    runner: ModelRunner, prompt: Sequence[int], n: int
) -> tuple[list[int], list[torch.Tensor]]:
    """`n` greedy tokens after `prompt` (a prefill, then decode steps: the engine's paths) and
    the float32 logits each was chosen from."""
    table = list(range(-(-(len(prompt) + n) // runner.block_size)))
    logits = [runner.execute([StepInput(list(prompt), 0, table)])[0]]
    out: list[int] = []
    for i in range(n):
        out.append(int(logits[-1].argmax()))
        if i + 1 < n:
            logits.append(runner.execute([StepInput([out[-1]], len(prompt) + i, table)])[0])
    return out, logits


def parting(runner: ModelRunner, reference: ModelRunner, prompt: Sequence[int], n: int) -> Parting:
    """Where `runner`'s greedy continuation of `prompt` first parts from `reference`'s."""
    ours, _ = greedy(runner, prompt, n)
    theirs, ref_logits = greedy(reference, prompt, n)
    k = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    gap = 0.0 if k is None else float(ref_logits[k][theirs[k]] - ref_logits[k][ours[k]])
    return Parting(ours, theirs, k, gap)
