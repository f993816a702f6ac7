"""The one check of a request's size against the model's context. Torch-free.

"prompt + max_tokens <= context" is checked once per edge: the router validates its public
requests in its own vocabulary (`router.validation`, INVALID_ARGUMENT naming the field); the
worker roles (a network edge too: `Reserve`, `Prefill`) and the engine's entry points (the
offline API's edge) call `check_context`, whose ValueError the roles answer with
INVALID_ARGUMENT; the scheduler behind them asserts it as an invariant.
"""

from __future__ import annotations


def check_context(request_id: str, num_prompt: int, max_tokens: int, context: int) -> None:
    """ValueError naming the numbers unless 1 <= `num_prompt`, 1 <= `max_tokens` and
    `num_prompt + max_tokens <= context` (every token, prompt and generated, has a position)."""
    if num_prompt < 1:
        raise ValueError(f"request {request_id!r}: prompt is empty")
    if max_tokens < 1:
        raise ValueError(f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}")
    if num_prompt > context:
        raise ValueError(
            f"request {request_id!r}: prompt length {num_prompt} exceeds the model's context "
            f"{context}"
        )
    if num_prompt + max_tokens > context:
        raise ValueError(
            f"request {request_id!r}: prompt length {num_prompt} + max_tokens {max_tokens} = "
            f"{num_prompt + max_tokens} exceeds the model's context {context}"
        )
