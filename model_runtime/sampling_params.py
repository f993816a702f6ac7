"""Per-request sampling parameters and their validation. Torch-free (the router uses it).

Validation happens at the edge (router, `pdserve batch`), raising ValueError naming the field
and the allowed values; past the edge the engine trusts a `SamplingParams`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model_runtime.structured import StructuredOutput

MAX_LOGPROBS = 20
"""Most alternatives a request may ask for per token (OpenAI's `top_logprobs` limit)."""

TopLogprobs = tuple[tuple[int, float], ...]
"""The k most likely (token id, log-probability) pairs at one position, most likely first."""

GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy: dividing logits by a tiny temperature overflows
float32 (1e-38 already makes inf - inf = NaN probabilities), and the distribution is an
argmax long before that."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    temperature 0 (or anything below `GREEDY_BELOW`) means greedy (exact argmax). top_k 0
    means no top-k cut; top_p 1.0 means no nucleus cut. `seed` makes a sampled request
    reproducible whatever else is in the batch. Generation stops at EOS (unless `ignore_eos`),
    at any of `stop_token_ids`, or after `max_tokens` tokens; before `min_tokens` tokens EOS and
    the stop ids cannot be sampled. `logprobs` None reports no log-probabilities; k reports each
    token's and the k most likely tokens' (under the model's own distribution, before
    temperature, top-k and top-p). `structured` constrains the output (`StructuredOutput`,
    checked at the edge by its own `check`): every token is sampled under its grammar's mask,
    and the request ends 'stop' once the grammar is complete. `speculative` False opts the
    request out of its engine's speculative decoding (`EngineConfig.speculative`); its tokens
    are the same either way, only how many arrive per step differs.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    structured: StructuredOutput | None = None
    speculative: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the first bad field; `vocab_size` bounds token ids."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature == float("inf"):
            raise ValueError("temperature must be finite, got inf")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or self.seed < 0
            or self.seed >= 2**63
        ):
            raise ValueError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int):
            raise ValueError(f"min_tokens must be an integer, got {self.min_tokens!r}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be a bool, got {self.speculative!r}")
        for tok in self.stop_token_ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
                raise ValueError(
                    f"stop_token_ids entries must be token ids in [0, {vocab_size}), got {tok!r}"
                )
