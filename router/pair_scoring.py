"""Prefill/decode pair scoring with KV transfer cost. Router process; pure and synchronous.

A disaggregated request needs a prefill worker P and a decode worker D, and its KV moves from P
to D. Where both run on one node the move is nearly free (shared memory on a CPU host, NVLink
between GPUs); across nodes it is the prompt's KV bytes over the link. So the router scores
*pairs*, not each role alone:

    score(P, D) = prefill_score(P) - load_weight * transfer_tokens(P, D)
    transfer_tokens = exposed_transfer_s(P, D) * prefill_tokens_per_s

`prefill_score` is the policy's own (least load: minus queued prompt tokens; prefix-aware:
cached tokens weighed against queued ones), in prompt-token units; the transfer is converted to
the same units by how many prompt tokens a prefill worker computes in that time. The exposed
transfer time is what the layer-by-layer push leaves after the prefill itself:

    bytes = prompt_tokens * kv_bytes_per_token;  link = bytes / bandwidth
    exposed = max(link / layers, link - compute),  compute = uncached tokens / prefill_tokens_per_s

with bandwidth `same_node_gbps` (None: free) or `cross_node_gbps`. Decode candidates are those
with KV room whose load (running + waiting + in flight) is within `decode_balance_rel` x the
least + `decode_balance_abs`: a pair on one node wins unless the queues say otherwise — a
shorter prefill queue elsewhere worth more than the move, or a decode on this node busier than
the balance allows. Ties: the policy's prefill order, then the decode with the least load, the
most free blocks, the lower address. With every worker on one node (all labels equal) the
choice is exactly the policy's old independent choice.

Node labels come from each worker's status (`WorkerView.node`: Ray's node id under the Ray
launcher, or the worker's configured label; '' = unlabelled, all one node).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from router.views import RouteRequest, WorkerView


class PairScoringConfig(BaseModel):
    """How the router prices moving a prompt's KV between a prefill and a decode worker."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kv_bytes_per_token: float = Field(
        default=0.0,
        ge=0,
        description="K + V bytes of one token over all layers (0: the router derives it from "
        "the model's config.json, float32 on CPU workers).",
    )
    num_layers: int = Field(
        default=0, ge=0, description="Layers the KV is pushed in (0: from the model's config)."
    )
    cross_node_gbps: float = Field(
        default=1.25, gt=0, description="Link bandwidth between nodes, GB/s (1.25 = 10 Gb/s)."
    )
    same_node_gbps: float | None = Field(
        default=None,
        gt=0,
        description="Bandwidth within a node, GB/s (None: shared memory / NVLink, priced 0).",
    )
    prefill_tokens_per_s: float = Field(
        default=2000.0,
        gt=0,
        description="Prompt tokens a prefill worker computes per second: converts transfer "
        "time into queued-token units (profile it: `pdserve profile`).",
    )
    decode_balance_rel: float = Field(
        default=1.25, ge=1.0, description="Decode candidates: load <= rel * least load + abs."
    )
    decode_balance_abs: float = Field(
        default=4.0, ge=0, description="Absolute part of the decode balance (requests)."
    )


@dataclass(frozen=True)
class PrefillCandidate:
    """A usable prefill worker as a policy scored it (higher is better), the prompt tokens it
    is expected to hold already, and the policy's tie-break key (lower first)."""

    view: WorkerView
    score: float
    cached: int
    order: tuple[object, ...]


def same_node(a: WorkerView, b: WorkerView) -> bool:
    return a.node == b.node


def exposed_transfer_s(
    prompt_tokens: int, cached_tokens: int, same: bool, config: PairScoringConfig
) -> float:
    """Seconds the KV hand-off adds after the prefill (module docstring)."""
    gbps = config.same_node_gbps if same else config.cross_node_gbps
    if gbps is None or config.kv_bytes_per_token <= 0:
        return 0.0
    link = prompt_tokens * config.kv_bytes_per_token / (gbps * 1e9)
    compute = max(0, prompt_tokens - cached_tokens) / config.prefill_tokens_per_s
    return max(link / max(config.num_layers, 1), link - compute)


def decode_load(view: WorkerView) -> int:
    """Requests a decode worker holds or is about to (running + waiting + this router's)."""
    return view.num_running + view.num_waiting + view.in_flight


def choose_pair(
    request: RouteRequest,
    prefills: Sequence[PrefillCandidate],
    decodes: Sequence[WorkerView],
    config: PairScoringConfig,
    load_weight: float = 1.0,
) -> tuple[PrefillCandidate, WorkerView] | None:
    """The best (P, D) pair (module docstring), or None without candidates on either side.
    `decodes` must already be the usable decode workers with room for the request."""
    if not prefills or not decodes:
        return None
    least = min(decode_load(d) for d in decodes)
    limit = config.decode_balance_rel * least + config.decode_balance_abs
    fair = [d for d in decodes if decode_load(d) <= limit]
    best: tuple[object, ...] | None = None
    chosen: tuple[PrefillCandidate, WorkerView] | None = None
    for p in prefills:
        for d in fair:
            moved = exposed_transfer_s(
                request.num_prompt_tokens, p.cached, same_node(p.view, d), config
            )
            score = p.score - load_weight * moved * config.prefill_tokens_per_s
            key = (-score, *p.order, decode_load(d), -d.free_blocks, d.address)
            if best is None or key < best:
                best, chosen = key, (p, d)
    return chosen
