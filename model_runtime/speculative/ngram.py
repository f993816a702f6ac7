"""Prompt-lookup proposer: no model, just the request's own tokens. Runs in the engine thread.

For a request whose tokens so far are ``t[0..L)``, try n from `prompt_lookup_max` down to
`prompt_lookup_min`: if the last n tokens ``t[L-n..L)`` occurred earlier, ending at e < L,
propose what followed that latest earlier occurrence, ``t[e..min(e+k, L))``. It pays where an
answer quotes its context (summaries, edits, RAG, code) and costs a dict lookup where it does
not: a request with nothing to match gets no proposal, so its step is the plain one.

Each request's index is built incrementally: a dict per n from every n-gram of its tokens to
the end of its latest occurrence, extended by the tokens appended since the previous call
(O(new tokens) per step; the prompt is indexed once, at its first decode step here). It is
rebuilt from the tokens on any worker that continues the request (a hand-off, a migration).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from model_runtime.request import Request


@dataclass
class _Index:
    """One request's tokens so far and where each n-gram of them last ended (exclusive)."""

    tokens: list[int]
    ends: list[dict[tuple[int, ...], int]] = field(default_factory=list)  # one per n
    indexed: int = 0  # every n-gram ending at <= this is in `ends`


class NgramProposer:
    """`base.Proposer` by prompt lookup (module docstring)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}"
            )
        self.min_n = min_n
        self.max_n = max_n
        self._index: dict[str, _Index] = {}

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        return [self._propose(r, k) for r, k in zip(requests, limits, strict=True)]

    def _propose(self, request: Request, limit: int) -> list[int]:
        index = self._index.get(request.request_id)
        if index is None:
            index = self._index[request.request_id] = _Index(
                list(request.prompt_token_ids),
                [{} for _ in range(self.max_n - self.min_n + 1)],
            )
        tokens = index.tokens
        known = len(tokens) - request.num_prompt_tokens
        tokens.extend(request.output_token_ids[known:])
        end = len(tokens)
        assert end == request.num_tokens, (request.request_id, end, request.num_tokens)
        # Index the n-grams ending before the last token: the suffix itself must not match.
        for e in range(index.indexed + 1, end):
            for i, table in enumerate(index.ends):
                n = self.min_n + i
                if e >= n:
                    table[tuple(tokens[e - n : e])] = e
        index.indexed = max(index.indexed, end - 1)
        for i in range(len(index.ends) - 1, -1, -1):
            n = self.min_n + i
            if end < n:
                continue
            found = index.ends[i].get(tuple(tokens[end - n :]))
            if found is not None:
                return tokens[found : min(found + limit, end)]
        return []

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)

    def check_integrity(self, live: Collection[str]) -> None:
        stale = [rid for rid in self._index if rid not in live]
        assert not stale, f"n-gram state for requests that left: {stale}"
