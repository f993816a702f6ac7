"""A scripted proposer for speculative-decoding tests (`model_runtime.speculative.base.Proposer`).

`OracleProposer` knows each prompt's reference output (a run without speculation) and
proposes its continuation from the request's position, wrong where `wrong(i)` says so for
output index i (a wrong guess is the right token + 1, wrapped into the vocabulary). So a test
chooses how much of every verified step is accepted — all, none, a prefix — and the output
must still be the reference. Requests are keyed by their prompt (`LLMEngine.generate` names
them itself).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from model_runtime.request import Request


class OracleProposer:
    """`Proposer` from reference outputs (module docstring)."""

    def __init__(
        self,
        reference: Mapping[tuple[int, ...], Sequence[int]],
        vocab_size: int,
        wrong: Callable[[int], bool] = lambda i: False,
    ) -> None:
        self.reference = reference
        self.vocab_size = vocab_size
        self.wrong = wrong
        self.seen: set[str] = set()
        self.proposed = 0

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        out = []
        for request, limit in zip(requests, limits, strict=True):
            self.seen.add(request.request_id)
            ref = self.reference.get(tuple(request.prompt_token_ids), ())
            n = request.num_output_tokens
            guess = []
            for i in range(n, min(n + limit, len(ref))):
                token = ref[i]
                guess.append((token + 1) % self.vocab_size if self.wrong(i) else token)
            self.proposed += len(guess)
            out.append(guess)
        return out

    def release(self, request_id: str) -> None:
        self.seen.discard(request_id)

    def check_integrity(self, live: Collection[str]) -> None:
        stale = self.seen - set(live)
        assert not stale, f"oracle state for requests that left: {sorted(stale)}"
