"""Routing-policy seam: which prefill and decode worker (or colocated worker) serves a request.

Runs in the router process, on the event loop, once per routing attempt. Policies are pure and
synchronous: they see frozen `WorkerView` snapshots (the last polled `WorkerStatus` plus the
router's own in-flight count) and do no I/O. Returning `None` means "no capacity now"; the caller
turns that into RESOURCE_EXHAUSTED (or UNAVAILABLE when no worker of a role is usable at all).

The views a policy reads (`WorkerView`, `RouteRequest`) live in `router.views`, below both this
module and `router.pair_scoring`; they are re-exported here. Implementations are registered by
name in `router.policies.POLICIES`; `make_policy(name)` there builds one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from router.pair_scoring import PairScoringConfig, PrefillCandidate, choose_pair
from router.views import ROLE_NAMES, Role, RouteRequest, WorkerView

__all__ = [
    "ROLE_NAMES",
    "LeastLoadPolicy",
    "Role",
    "RoundRobinPolicy",
    "RouteRequest",
    "RoutingDecision",
    "RoutingPolicy",
    "WorkerView",
    "with_room",
]


@dataclass(frozen=True)
class RoutingDecision:
    """Disagg: `prefill` and `decode` set. Colocated: only `colocated` set.

    `cached_tokens` is the prompt prefix the policy expects the chosen prefill (or colocated)
    worker to have cached already (0 when it does not know).
    """

    prefill: WorkerView | None = None
    decode: WorkerView | None = None
    colocated: WorkerView | None = None
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        disagg = self.prefill is not None and self.decode is not None
        assert disagg != (self.colocated is not None), f"inconsistent decision: {self}"
        assert self.colocated is None or (self.prefill is None and self.decode is None), self


class RoutingPolicy(Protocol):
    """Chooses workers for one request. Pure, synchronous, no I/O; may keep counters.

    Disagg (`request.colocated` false): choose one of `prefill_views` and one of `decode_views`.
    Colocated: `prefill_views` holds the colocated workers, `decode_views` is empty; the decision
    sets `colocated`. Views that are not `usable` must never be chosen. Return `None` when no
    choice has capacity (the views are hints: the worker still checks, e.g. `Reserve`).

    `uses_prefix_matches`: whether `choose` reads `request.prefix_matches` /
    `request.block_hashes`; when false the router skips the prefix-index lookup (a round trip
    to Redis) for its requests.
    """

    name: str
    uses_prefix_matches: bool

    def choose(
        self,
        request: RouteRequest,
        prefill_views: Sequence[WorkerView],
        decode_views: Sequence[WorkerView],
    ) -> RoutingDecision | None: ...

    def prefilled_elsewhere(self, request_id: str, worker: WorkerView) -> None:
        """Called right after `choose` answered for `request_id` (no other `choose` between)
        when the router prefills it on `worker` instead of the decision's prefill worker
        (hybrid local path: the decode worker). A policy that credited the prefill worker
        with the prompt's blocks moves that credit to `worker`; others do nothing."""
        ...


class RoundRobinPolicy:
    """Next usable worker in address order, per role; ignores load and free blocks."""

    name = "round_robin"
    uses_prefix_matches = False

    def __init__(self) -> None:
        self._next: dict[str, int] = {"prefill": 0, "decode": 0, "colocated": 0}

    def _pick(self, key: str, views: Sequence[WorkerView]) -> WorkerView | None:
        usable = sorted((v for v in views if v.usable), key=lambda v: v.address)
        if not usable:
            return None
        chosen = usable[self._next[key] % len(usable)]
        self._next[key] += 1
        return chosen

    def choose(
        self,
        request: RouteRequest,
        prefill_views: Sequence[WorkerView],
        decode_views: Sequence[WorkerView],
    ) -> RoutingDecision | None:
        if request.colocated:
            worker = self._pick("colocated", prefill_views)
            return None if worker is None else RoutingDecision(colocated=worker)
        if not any(v.usable for v in prefill_views) or not any(v.usable for v in decode_views):
            return None  # do not advance one role's counter when the other has no worker
        prefill = self._pick("prefill", prefill_views)
        decode = self._pick("decode", decode_views)
        assert prefill is not None and decode is not None
        return RoutingDecision(prefill=prefill, decode=decode)

    def prefilled_elsewhere(self, request_id: str, worker: WorkerView) -> None:
        """Nothing to move: no cache credit."""


def _prefill_load(view: WorkerView, request: RouteRequest) -> int:
    """Queued prompt tokens, counting each router in-flight request as one more such prompt."""
    return view.waiting_tokens + view.in_flight * request.num_prompt_tokens


class LeastLoadPolicy:
    """Load-aware choice (ties broken by address, so results are deterministic).

    - prefill: fewest `waiting_tokens + in_flight * prompt_tokens`, then fewest running;
    - decode: only workers with free blocks for prompt + max_tokens; among them the fewest
      `num_running + num_waiting + in_flight`, then the most free blocks;
    - the pair: scored together with its KV transfer cost when workers sit on different nodes
      (`router.pair_scoring`; on one node this is the choice above);
    - colocated: free blocks as for decode, then the prefill rule, then the most free blocks.
    """

    name = "least_load"
    uses_prefix_matches = False

    def __init__(self, pair: PairScoringConfig | None = None) -> None:
        self.pair = pair or PairScoringConfig()

    def choose(
        self,
        request: RouteRequest,
        prefill_views: Sequence[WorkerView],
        decode_views: Sequence[WorkerView],
    ) -> RoutingDecision | None:
        if request.colocated:
            fits = with_room(request, prefill_views)
            if not fits:
                return None
            best = min(
                fits,
                key=lambda v: (
                    _prefill_load(v, request),
                    v.num_running + v.in_flight,
                    -v.free_blocks,
                    v.address,
                ),
            )
            return RoutingDecision(colocated=best)
        prefills = [
            PrefillCandidate(
                v,
                -float(_prefill_load(v, request)),
                0,
                (_prefill_load(v, request), v.num_running, v.address),
            )
            for v in prefill_views
            if v.usable
        ]
        pair = choose_pair(request, prefills, with_room(request, decode_views), self.pair)
        if pair is None:
            return None
        return RoutingDecision(prefill=pair[0].view, decode=pair[1])

    def prefilled_elsewhere(self, request_id: str, worker: WorkerView) -> None:
        """Nothing to move: no cache credit."""


def with_room(request: RouteRequest, views: Sequence[WorkerView]) -> list[WorkerView]:
    """The usable views with free KV blocks for the request's prompt + max_tokens."""
    return [v for v in views if v.usable and v.free_blocks >= v.blocks_needed(request.total_tokens)]
