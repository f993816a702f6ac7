"""The proposer seam: what speculative decoding asks of whatever guesses a request's next tokens.
Runs in the engine thread of a worker (decode and colocated steps); torch-free here.

A proposer guesses up to k tokens that follow a decoding request's tokens so far; the engine
verifies the guesses in the request's next step (`model_runtime.speculative.verify`) and keeps
the longest prefix the target model agrees with, plus one token of its own. A guess never
changes what a request returns, only how many tokens one step gives it, so a proposer is free
to guess badly, to guess nothing, or to lose its state: its guesses are hints.

Contract:

- `propose(requests, limits)` returns, for each request, at most `limits[i]` token ids (maybe
  none) that would follow `requests[i].prompt_token_ids + requests[i].output_token_ids`. The
  requests are the scheduler's (read-only here). Called once per engine step with every
  decoding request the step speculates on.
- Per-request state (an index of its tokens, a draft model's KV) is the proposer's own, keyed
  by request id. It is created when a request is first proposed for on this engine, whatever
  brought it here (a local prompt, a prefilled hand-off, a migration's re-prefill): it is
  rebuilt from the request's tokens, so nothing about it ever crosses workers.
- `release(request_id)` drops that state (the request finished, was aborted or preempted past
  its usefulness); a no-op for a request it holds nothing for (most requests that never
  speculated). The engine calls it for every request that leaves.
- `check_integrity(live)` asserts the proposer holds state only for ids in `live` and that its
  own resources (a draft model's KV blocks) are all accounted for.

Implementations: `ngram.NgramProposer` (prompt lookup, no model), `draft.DraftProposer` (a
smaller model on the same worker). EAGLE-style heads, which read the target's hidden states,
would be a third behind the same calls.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from model_runtime.request import Request


class Proposer(Protocol):
    """Guesses the next tokens of decoding requests (module docstring)."""

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        """For each request, at most `limits[i]` (>= 1) guessed next tokens (maybe none)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget the request's state, if any."""
        ...

    def check_integrity(self, live: Collection[str]) -> None:
        """Assert that state is held only for `live` ids and own resources add up."""
        ...
