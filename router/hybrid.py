"""Conditional disaggregation: per request, prefill on a prefill worker or where it decodes.

Runs in the router process (and, being pure, in the planner's simulator). In a disaggregated
cluster whose `[router.hybrid]` section is on, every decode worker can also prefill a prompt
itself (`decode_worker.hybrid`: chunked prefill inside its decode batches, as a colocated
worker does). After the policy has picked the (prefill, decode) pair, `choose_prefill_path`
decides which leg the request takes:

- ``remote``: Reserve on D -> Prefill on P (KV pushed to D) -> Decode on D;
- ``local``: Generate on D (D prefills, then decodes; no KV transfer, P untouched).

The rule, first match wins (tokens are prompt tokens still to compute, i.e. minus the prefix
the worker is expected to hold already; loads are queued prefill tokens, `prefix_policy.
load_tokens` of the worker's view):

1. hybrid off (`local_prefill_max_tokens` 0) -> remote, reason ``off``;
2. D's queue plus this prompt's uncached tokens above `decode_queue_max_tokens` -> remote,
   ``decode_busy`` (a local prefill would stall D's decodes for longer than allowed);
3. uncached tokens on D at most `local_prefill_max_tokens` -> local, ``short_prompt`` (the
   prefill hop costs more than the few chunks it would keep off D);
4. P's queue above `prefill_queue_max_tokens` -> local, ``prefill_busy`` (the prompt would wait
   longer for P than it costs D);
5. otherwise remote, ``long_prompt``.

Why short prompts stay local: their KV move, the Reserve round trip and the second hop cost
about as much as their prefill, while a long prompt's prefill inside D's batches raises every
decoding request's TPOT; long ones go to P, which is what disaggregation is for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from router.prefix_index.base import PrefixMatch

PrefillPath = Literal["local", "remote"]
PathReason = Literal["off", "decode_busy", "short_prompt", "prefill_busy", "long_prompt"]
PATHS: tuple[PrefillPath, ...] = ("local", "remote")
REASONS: dict[PrefillPath, tuple[PathReason, ...]] = {
    "local": ("short_prompt", "prefill_busy"),
    "remote": ("off", "decode_busy", "long_prompt"),
}
"""Every (path, reason) `choose_prefill_path` can return."""


class HybridConfig(BaseModel):
    """`[router.hybrid]`: when a disaggregated cluster prefills on the decode worker. Off by
    default (`local_prefill_max_tokens` 0): every request takes the prefill worker."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    local_prefill_max_tokens: int = Field(
        default=0,
        ge=0,
        description="Prefill on the decode worker (Generate) when the prompt's uncached tokens "
        "there are at most this many; 0 turns conditional disaggregation off.",
    )
    prefill_queue_max_tokens: int = Field(
        default=0,
        ge=0,
        description="Also prefill on the decode worker, whatever the prompt's length, when "
        "the chosen prefill worker has more than this many prefill tokens queued; 0 = never.",
    )
    decode_queue_max_tokens: int = Field(
        default=0,
        ge=0,
        description="Never prefill on a decode worker whose queued prefill tokens plus this "
        "prompt's uncached ones would exceed this; 0 = no limit.",
    )

    @property
    def enabled(self) -> bool:
        return self.local_prefill_max_tokens > 0


@dataclass(frozen=True)
class PathChoice:
    """Where one request is prefilled, why, and the prompt tokens that path must compute."""

    path: PrefillPath
    reason: PathReason
    uncached_tokens: int


def choose_prefill_path(
    config: HybridConfig,
    prompt_tokens: int,
    cached_on_decode: int,
    cached_on_prefill: int,
    prefill_queued_tokens: int,
    decode_queued_tokens: int,
) -> PathChoice:
    """The path of one request (rule in the module docstring). Pure.

    `cached_on_decode` / `cached_on_prefill`: prompt tokens the chosen decode / prefill worker
    is expected to hold already (prefix index; 0 when unknown); `*_queued_tokens`: the
    workers' queued prefill tokens (`prefix_policy.load_tokens`)."""
    assert prompt_tokens > 0 and 0 <= cached_on_decode < prompt_tokens, (
        prompt_tokens,
        cached_on_decode,
    )
    local = prompt_tokens - cached_on_decode
    remote = prompt_tokens - max(0, min(cached_on_prefill, prompt_tokens - 1))
    if not config.enabled:
        return PathChoice("remote", "off", remote)
    limit = config.decode_queue_max_tokens
    if limit and decode_queued_tokens + local > limit:
        return PathChoice("remote", "decode_busy", remote)
    if local <= config.local_prefill_max_tokens:
        return PathChoice("local", "short_prompt", local)
    if config.prefill_queue_max_tokens and prefill_queued_tokens > config.prefill_queue_max_tokens:
        return PathChoice("local", "prefill_busy", local)
    return PathChoice("remote", "long_prompt", remote)


def indexed_tokens(
    worker_id: str,
    epoch: int,
    block_size: int,
    num_block_hashes: int,
    matches: Sequence[PrefixMatch] | None,
    prompt_tokens: int,
) -> int:
    """Prompt tokens the prefix index says `worker_id` (at `epoch`) holds, capped at the
    chain's length and at ``prompt_tokens - 1`` (one token always runs); 0 without an answer."""
    if not matches:
        return 0
    blocks = max(
        (m.num_blocks for m in matches if m.worker_id == worker_id and m.epoch == epoch),
        default=0,
    )
    return max(0, min(min(blocks, num_block_hashes) * block_size, prompt_tokens - 1))
