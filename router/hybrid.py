"""Conditional disaggregation: per request, prefill on a prefill worker or where it decodes.

Runs in the router process (and, being pure, in the planner's simulator). In a disaggregated
cluster whose `[router.hybrid]` section is on, every decode worker can also prefill a prompt
itself (its "decode" role's `Generate`: chunked prefill inside its decode batches, as a colocated
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
3. uncached tokens on D at most `local_prefill_max_tokens`:
   a. with `spill_to_prefill` on, D's work above P's by more than `spill_margin_tokens` ->
      remote, ``spill``. Work is counted in prompt tokens of one prefill step: D's queued
      prefill tokens plus one per request decoding there (a local prompt runs inside D's
      decode batch, where each decoding row is one more row of every matrix product, as a
      prompt token is) plus this prompt's uncached tokens on D; P's queued tokens plus this
      prompt's uncached tokens on P. The margin is what the hop costs, in prefill tokens;
   b. else local, ``short_prompt`` (the prefill hop costs more than the few chunks it would
      keep off D);
4. P's queue above `prefill_queue_max_tokens` -> local, ``prefill_busy`` (the prompt would wait
   longer for P than it costs D);
5. otherwise remote, ``long_prompt``.

The threshold can move online: with `max_local_prefill_max_tokens` set and the ratio
controller on, the controller (`router.ratio.threshold`) moves it between the bounds; the live
value has one owner, a `LiveThreshold`, which the request path reads once per request and only
the controller's driver sets.

Why short prompts stay local: their KV move, the Reserve round trip and the second hop cost
about as much as their prefill, while a long prompt's prefill inside D's batches raises every
decoding request's TPOT; long ones go to P, which is what disaggregation is for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from router.prefix_index.base import PrefixMatch

PrefillPath = Literal["local", "remote"]
PathReason = Literal["off", "decode_busy", "spill", "short_prompt", "prefill_busy", "long_prompt"]
PATHS: tuple[PrefillPath, ...] = ("local", "remote")
REASONS: dict[PrefillPath, tuple[PathReason, ...]] = {
    "local": ("short_prompt", "prefill_busy"),
    "remote": ("off", "decode_busy", "spill", "long_prompt"),
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
    spill_to_prefill: bool = Field(
        default=True,
        description="Send a short prompt through the prefill worker anyway when the decode "
        "worker has more work than the prefill worker (queued prefill tokens, plus one per "
        "decoding request on D; rule 3a): a local prefill shares D's decode steps while P "
        "may sit idle.",
    )
    spill_margin_tokens: int = Field(
        default=0,
        ge=0,
        description="With spill_to_prefill: how much more work (in prefill tokens) D must "
        "have than P before a short prompt spills: what the prefill hop (Reserve, KV push, "
        "second call) costs.",
    )

    min_local_prefill_max_tokens: int = Field(
        default=1,
        ge=1,
        description="Online threshold control: the least the ratio controller lowers "
        "local_prefill_max_tokens to (it never turns the local path off).",
    )
    max_local_prefill_max_tokens: int = Field(
        default=0,
        ge=0,
        description="Online threshold control: the most the ratio controller raises "
        "local_prefill_max_tokens to; 0 = the threshold stays fixed. Moves only when "
        "`[router.ratio]` mode is 'adaptive' (or 'advisory': recorded, not applied), with the "
        "ratio controller's interval, cooldown, hysteresis and revert rules.",
    )
    threshold_step: float = Field(
        default=2.0,
        gt=1.0,
        description="Online threshold control: a raise multiplies the threshold by this, a "
        "lower divides it (at least one token either way), clamped to the bounds.",
    )

    @model_validator(mode="after")
    def _check(self) -> HybridConfig:
        if self.max_local_prefill_max_tokens and not (
            self.enabled
            and self.min_local_prefill_max_tokens
            <= self.local_prefill_max_tokens
            <= self.max_local_prefill_max_tokens
        ):
            raise ValueError(
                "online threshold control needs min_local_prefill_max_tokens <= "
                "local_prefill_max_tokens <= max_local_prefill_max_tokens and the threshold on "
                f"(> 0); got {self.min_local_prefill_max_tokens} <= "
                f"{self.local_prefill_max_tokens} <= {self.max_local_prefill_max_tokens}"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.local_prefill_max_tokens > 0

    @property
    def adaptive(self) -> bool:
        """Whether the threshold may move online (bounds set; the ratio controller moves it)."""
        return self.enabled and self.max_local_prefill_max_tokens > 0


class LiveThreshold:
    """The router's current `local_prefill_max_tokens` — its one owner. The request path reads
    `config()` once per request (a leg placed later in the same request uses that value too);
    only the ratio controller's driver calls `set`, inside the configured bounds."""

    def __init__(self, config: HybridConfig) -> None:
        assert config.enabled, "a live threshold needs hybrid on"
        self._base = config
        self._config = config
        self.changes = 0  # how many times `set` changed the value

    @property
    def value(self) -> int:
        return self._config.local_prefill_max_tokens

    @property
    def bounds(self) -> HybridConfig:
        """The configured section (bounds, step, the start value)."""
        return self._base

    def config(self) -> HybridConfig:
        """The section with the live threshold."""
        return self._config

    def set(self, tokens: int) -> None:
        """The controller's new threshold (an assert guards the bounds: the core clamps)."""
        b = self._base
        assert b.min_local_prefill_max_tokens <= tokens <= b.max_local_prefill_max_tokens, (
            tokens,
            b,
        )
        if tokens != self.value:
            self.changes += 1
        self._config = b.model_copy(update={"local_prefill_max_tokens": tokens})


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
    decode_running: int,
) -> PathChoice:
    """The path of one request (rule in the module docstring). Pure.

    `cached_on_decode` / `cached_on_prefill`: prompt tokens the chosen decode / prefill worker
    is expected to hold already (prefix index; 0 when unknown); `*_queued_tokens`: the
    workers' queued prefill tokens (`prefix_policy.load_tokens`); `decode_running`: requests
    decoding on the decode worker."""
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
        on_d = decode_queued_tokens + decode_running + local
        on_p = prefill_queued_tokens + remote + config.spill_margin_tokens
        if config.spill_to_prefill and on_d > on_p:
            return PathChoice("remote", "spill", remote)
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
