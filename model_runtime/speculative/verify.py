"""Verification: which of a request's proposals its step keeps. Runs in the engine thread.

A verified step ran the request's pending token and its m proposals ``d[0..m)`` as m + 1
rows; row j's logits are the target model's distribution for the token after the pending one
and ``d[0..j)``. The rule walks the rows in order and emits one token per row, each picked
exactly as the plain sampler would pick the next token at that position
(`model_runtime.sampler.Sampler`, one row at a time: temperature, top-k, top-p, banned ids
below `min_tokens`, the grammar's mask): if the token equals the proposal of that row the walk
goes on to the next row, otherwise (or after the last row, or when the token ends the request)
it stops. So a step emits the longest agreeing prefix of the proposals plus one token of the
target's own.

- Greedy: the row's argmax, so the emitted tokens are the target's greedy tokens whatever was
  proposed; with no per-row constraint (no grammar, no banned ids, no logprobs) one argmax
  over every row does it.
- Sampled: the row's token is a draw of the request's seeded generator, one exponential race
  per emitted token, as in a plain step; the walk stops at the first token that differs from
  the proposal, so the generator makes exactly one draw per emitted token. The request thus
  gets the very tokens it gets without speculation, for any proposals, any k, any batch, any
  split over workers (`sampler.skip_draws` / `num_sampled` stay one draw per token).
  For a proposal that is a point mass (the n-gram proposer's; any deterministic guess d) this
  *is* the standard lossless rejection rule: accept with probability min(1, p(d) / q(d)) =
  p(d), and on rejection the token is distributed as p with d removed, renormalized, which is
  the normalized residual max(0, p - q) / (1 - p(d)). For the draft model, which proposes
  with the same per-position races applied to its own distribution
  (`draft.DraftProposer`), it is the Gumbel-max coupling of the draft and the target
  ("drafter-invariant speculative decoding", Daliri et al. 2024): still exactly the target's
  distribution — the tokens are the non-speculative ones — accepting a proposal with
  probability at least (1 - TV) / (1 + TV) against the textbook rule's 1 - TV (TV: the two
  distributions' total variation distance). The textbook rule's tokens would depend on the
  proposals, hence on k and on the proposer's state, which migration rebuilds; this one's
  never do.
- Constrained (grammar): row j's mask is the matcher's after the accepted proposals
  ``d[0..j)``: the walk consumes each accepted proposal to mask the next row and rolls the
  matcher back at the end (`Matcher.rollback`); the scheduler's `append_token` consumes the
  kept tokens for good.
- Logprobs are the target's, per emitted row, as a plain step reports them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from model_runtime.request import Request, stop_reason
from model_runtime.sampler import Sampler
from model_runtime.scheduler_types import AcceptedToken


def banned_ids(request: Request, ahead: int = 0) -> tuple[int, ...]:
    """Token ids `request` may not sample as its output token number
    `num_output_tokens + ahead` (0-based): its stop ids (and EOS unless `ignore_eos`) while
    that is below `min_tokens`."""
    p = request.params
    if request.num_output_tokens + ahead >= p.min_tokens:
        return ()
    eos = () if p.ignore_eos else request.eos_token_ids
    return (*eos, *p.stop_token_ids)


def ends_request(request: Request, token: int, ahead: int) -> bool:
    """Whether `token`, as output token number `num_output_tokens + ahead` (0-based), ends
    the request by its stop rules (EOS, stop ids, max_tokens)."""
    n = request.num_output_tokens + ahead + 1
    return stop_reason(token, n, request.params, request.eos_token_ids) is not None


def accepted_prefix(emitted: Sequence[AcceptedToken], proposals: Sequence[int]) -> int:
    """How many of `proposals` the emitted tokens kept (their longest agreeing prefix)."""
    n = 0
    for (token, _, _), proposal in zip(emitted, proposals, strict=False):
        if token != proposal:
            break
        n += 1
    return n


class Verifier:
    """The rule of the module docstring over one sampler (and one mask row for grammars)."""

    def __init__(self, sampler: Sampler, mask_row: np.ndarray | None) -> None:
        """`mask_row`: a one-row grammar mask buffer (`Grammars.new_masks(1)`), None when the
        engine has no grammars."""
        self.sampler = sampler
        self._mask = mask_row

    def verify(
        self, request: Request, logits: torch.Tensor, proposals: Sequence[int]
    ) -> list[AcceptedToken]:
        """The tokens one verified step emits for `request` (>= 1), from its rows' float32
        `logits` [len(proposals) + 1, V]; the last is the new pending token, the others are
        accepted proposals."""
        m = len(proposals)
        assert logits.shape[0] == m + 1, (logits.shape, m)
        p = request.params
        if (
            p.greedy
            and request.matcher is None
            and p.logprobs is None
            and request.num_output_tokens >= p.min_tokens
        ):
            nan = float("nan")
            emitted: list[AcceptedToken] = []
            for j, token in enumerate(logits.max(dim=-1).indices.tolist()):
                emitted.append((token, nan, None))
                if j == m or token != proposals[j] or ends_request(request, token, j):
                    break
            return emitted
        return self._walk(request, logits, proposals)

    def _walk(
        self, request: Request, logits: torch.Tensor, proposals: Sequence[int]
    ) -> list[AcceptedToken]:
        """Row by row through the sampler (the module docstring's general case)."""
        p = request.params
        matcher = request.matcher
        emitted: list[AcceptedToken] = []
        consumed = 0
        try:
            for j in range(len(proposals) + 1):
                masks: np.ndarray | None = None
                rows: tuple[int, ...] = ()
                if matcher is not None:
                    assert self._mask is not None
                    matcher.fill_mask(self._mask, 0)
                    masks, rows = self._mask, (0,)
                out = self.sampler.sample(
                    logits[j : j + 1],
                    [p],
                    [request.generator],
                    [banned_ids(request, j)],
                    masks,
                    rows,
                )
                token = out.token_ids[0]
                emitted.append((token, out.logprobs[0], out.top_logprobs[0]))
                if j == len(proposals) or token != proposals[j] or ends_request(request, token, j):
                    break
                if matcher is not None:
                    if not matcher.consume(token):
                        break  # the mask allowed it: only a broken matcher gets here
                    consumed += 1
                    if matcher.done:
                        break
        finally:
            if matcher is not None:
                matcher.rollback(consumed)
        return emitted
