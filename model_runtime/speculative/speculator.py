"""The engine's speculation: one proposer, each request's adaptive k, and the counters. Runs in
the engine thread; torch-free (the proposer may not be).

Where it sits in one engine step (`LLMEngine.step`)::

    scheduler.schedule(lookahead=speculator.lookahead)   k per decoding request; the scheduler
                                                         grants positions and blocks (<= k)
    speculator.propose(requests, grants)                 the proposer's guesses (<= grant)
    runner.execute(pending + guesses, a row each)        one forward, causal over the guesses
    Verifier.verify(...)                                 tokens kept (`verify`)
    scheduler.update(..., accepted=)                     kept tokens computed, the rest rolled
                                                         back (module `scheduler`, lookahead)
    speculator.end_step(verified)                        adapt k, count

The speculator holds per-request state only for requests it was asked about and drops it when
the engine tells it a request left (`release`), as its proposer does.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from model_runtime.request import Request
from model_runtime.speculative.adapt import AdaptiveK
from model_runtime.speculative.base import Proposer


@dataclass
class SpecStats:
    """Counters since the engine started, under vLLM's names (`vllm:spec_decode_*`):
    `num_drafts` verified steps of a request that had proposals, `num_draft_tokens` proposals
    verified, `num_accepted_tokens` proposals kept, `accepted_per_pos[i]` drafts whose i-th
    proposal (0-based) was kept."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Kept proposals / verified proposals (NaN before any)."""
        if not self.num_draft_tokens:
            return float("nan")
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens one draft's step emitted, on average: 1 + kept / drafts (vLLM's "mean
        acceptance length"; NaN before any)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")


class Speculator:
    """One engine's speculation state (module docstring)."""

    def __init__(self, proposer: Proposer, k_max: int, max_step_rows: int | None = None) -> None:
        """`k_max`: most proposals per request per step; `max_step_rows`: most decode rows of
        a step with proposals (`SpeculativeConfig.max_step_rows`; None: no limit)."""
        self.proposer = proposer
        self.k_max = k_max
        self.max_step_rows = max_step_rows
        self.stats = SpecStats(accepted_per_pos=[0] * k_max)
        self._k: dict[str, AdaptiveK] = {}
        self._asked: list[str] = []  # this step's decoding requests, in `lookahead` order

    def lookahead(self, request: Request) -> int:
        """How many proposals the decoding `request` wants verified this step (its adaptive
        k; 0 when it opted out). Called by the scheduler once per decoding request per step."""
        if not request.params.speculative:
            return 0
        k = self._k.get(request.request_id)
        if k is None:
            k = self._k[request.request_id] = AdaptiveK(self.k_max)
        self._asked.append(request.request_id)
        return k.k

    def propose(self, requests: Sequence[Request], grants: Sequence[int]) -> list[list[int]]:
        """The proposer's guesses for `requests`, at most `grants[i]` (>= 1) each."""
        proposals = self.proposer.propose(requests, grants)
        for got, grant in zip(proposals, grants, strict=True):
            assert len(got) <= grant, (len(got), grant)
        return proposals

    def end_step(self, verified: Mapping[str, tuple[int, int]]) -> None:
        """After the step's update: `verified[request id] = (proposed, accepted)` for the
        requests whose proposals it verified; every other request asked this step proposed
        nothing. Adapts each one's k and counts."""
        stats = self.stats
        for rid in self._asked:
            k = self._k.get(rid)
            if k is None:  # it left during the step
                continue
            proposed, accepted = verified.get(rid, (0, 0))
            k.observe(proposed, accepted)
            if proposed:
                stats.num_drafts += 1
                stats.num_draft_tokens += proposed
                stats.num_accepted_tokens += accepted
                for i in range(accepted):
                    stats.accepted_per_pos[i] += 1
        self._asked.clear()

    def release(self, request_id: str) -> None:
        """The request left the engine (finished, aborted): drop its state everywhere."""
        self._k.pop(request_id, None)
        self.proposer.release(request_id)

    def check_integrity(self, live: Collection[str]) -> None:
        """State only for `live` request ids (here and in the proposer)."""
        stale = [rid for rid in self._k if rid not in live]
        assert not stale, f"speculation state for requests that left: {stale}"
        self.proposer.check_integrity(live)
