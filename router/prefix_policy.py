"""Prefix-cache-aware routing: send a request to the prefill worker that already holds its
prompt prefix, unless that worker is too busy. Runs in the router process; pure and synchronous
(the prefix-index lookup happens before, in `flow`; its answer arrives in `RouteRequest`).

Prefill (or colocated) choice, for each usable worker `w`:

    cached(w) = block_size * max(index blocks of w, pending blocks of w)   (capped: prompt - 1)
    load(w)   = in_flight_tokens(w) + max(0, waiting_tokens(w) - in_flight_prompt_tokens(w))
    score(w)  = cache_weight * cached(w) - load_weight * load(w)

The default weights value a cached token at four queued ones: an engine batches queued
prompts (chunked prefill) rather than running them one after another, so queued work delays a
newcomer less than its own uncached prompt costs; a prefix that follows its requests to one
worker leaves the other workers' caches to other prefixes; and the balance threshold, not the
score, is what bounds the pile-up. On the shared-prefix benchmark (benchmarks/
bench_prefix_routing.py, 2 prefill workers) 1:1 split 3 of 4 groups over both workers (hit rate
86-88 % of the oracle); 2:1 and 4:1 kept (nearly) every group on one worker (93-99 %), 4:1 also
under a queue of 8 concurrent requests, where 2:1 started to split.

`in_flight_tokens` is what this router's own in-flight requests leave the worker to compute
(prompt minus expected hit); the worker's polled `waiting_tokens` counts whole prompts of every
router's queued work, so the part this router knows better is taken out of it. Index blocks
count only when the match's epoch equals the worker's current epoch (never a ghost's blocks).

Balance threshold: only workers with `load(w) <= balance_rel * min_load + balance_abs_tokens`
compete, so one hot prefix cannot pile every request onto one worker. The best score wins;
ties go to the lower load, then fewer running, then the worker this policy picked least
recently (so cold prefixes on an idle cluster spread over the workers' caches instead of all
filling the first), then the address — deterministic for a given sequence of calls.

Pending credit: the chosen worker is credited at once with the request's whole chain for
`pending_ttl_s`, so a burst of same-prefix requests follows the first before its blocks are
published (and spreads to a second worker only when the balance or the score says so). When
the router then prefills the request on its decode worker instead (hybrid local path), it
calls `prefilled_elsewhere` and the credit moves to the decode worker, where the blocks are.

With `prefix_matches` None (index down / slow / breaker open) the policy routes by load only.
Decode choice: room for prompt + max_tokens, then least busy — scored together with the prefill
choice and the KV transfer between them when workers sit on different nodes
(`router.pair_scoring`; on one node it is `policy.LeastLoadPolicy`'s decode rule).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from model_runtime.hashing import BlockHash
from router.pair_scoring import PairScoringConfig, PrefillCandidate, choose_pair
from router.policy import RouteRequest, RoutingDecision, WorkerView, with_room


class PrefixRoutingConfig(BaseModel):
    """Weights and limits of `PrefixAwarePolicy`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cache_weight: float = Field(
        default=4.0, ge=0, description="Score per prompt token the worker has cached already."
    )
    load_weight: float = Field(
        default=1.0, ge=0, description="Score penalty per token of queued prefill work."
    )
    balance_abs_tokens: int = Field(
        default=2048,
        ge=0,
        description="Balance threshold: a worker competes only while its load is at most "
        "balance_rel * (least load) + this many tokens.",
    )
    balance_rel: float = Field(
        default=1.5, ge=1.0, description="Relative part of the balance threshold (see above)."
    )
    pending_ttl_s: float = Field(
        default=5.0,
        gt=0,
        description="How long a routed request's prefix counts as cached on its worker before "
        "the worker publishes it.",
    )
    max_pending_blocks: int = Field(
        default=65536, ge=1, description="Pending-credit hashes kept per worker (oldest dropped)."
    )


class PendingPrefixes:
    """Chains just routed to a worker, credited until `ttl_s` passes. Pure (clock passed in).

    Per worker: hash -> expiry, oldest first (constant TTL, so insertion order is expiry order).
    """

    def __init__(self, ttl_s: float, max_blocks: int) -> None:
        self._ttl_s = ttl_s
        self._max = max_blocks
        self._by_worker: dict[str, OrderedDict[BlockHash, float]] = {}

    def add(
        self, worker_id: str, block_hashes: Sequence[BlockHash], now: float
    ) -> tuple[BlockHash, ...]:
        """Credit `worker_id` with `block_hashes` until `now + ttl_s`; returns the hashes it was
        not credited with before (what `retract` undoes)."""
        if not block_hashes:
            return ()
        table = self._by_worker.setdefault(worker_id, OrderedDict())
        expiry = now + self._ttl_s
        new = tuple(h for h in block_hashes if h not in table)
        for h in block_hashes:
            table[h] = expiry
            table.move_to_end(h)
        while len(table) > self._max:
            table.popitem(last=False)
        return new

    def retract(self, worker_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """Drop `worker_id`'s credit for `block_hashes` (those it holds; others are ignored)."""
        table = self._by_worker.get(worker_id)
        if table is None:
            return
        for h in block_hashes:
            table.pop(h, None)

    def credited(self, worker_id: str) -> int:
        """How many hashes `worker_id` is credited with (expired ones until the next lookup)."""
        return len(self._by_worker.get(worker_id, ()))

    def leading(self, worker_id: str, block_hashes: Sequence[BlockHash], now: float) -> int:
        """How many leading hashes of the chain are credited to `worker_id` at `now`."""
        table = self._by_worker.get(worker_id)
        if not table:
            return 0
        while table and next(iter(table.values())) <= now:
            table.popitem(last=False)
        n = 0
        for h in block_hashes:
            if h not in table:
                break
            n += 1
        return n


def load_tokens(view: WorkerView) -> int:
    """Prefill work queued on `view` (see the module docstring)."""
    others = max(0, view.waiting_tokens - view.in_flight_prompt_tokens)
    return view.in_flight_tokens + others


class PrefixAwarePolicy:
    """`RoutingPolicy` "prefix_aware" (see the module docstring). `clock`: monotonic seconds."""

    name = "prefix_aware"
    uses_prefix_matches = True

    def __init__(
        self,
        config: PrefixRoutingConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        pair: PairScoringConfig | None = None,
    ) -> None:
        self.config = config or PrefixRoutingConfig()
        self.pair = pair or PairScoringConfig()
        self._clock = clock
        self.pending = PendingPrefixes(self.config.pending_ttl_s, self.config.max_pending_blocks)
        self._picks = 0
        self._last_pick: dict[str, int] = {}  # address -> `_picks` when last chosen
        # the last `choose`'s credit: (request id, worker id, hashes new to it, the chain)
        self._credit: tuple[str, str, tuple[BlockHash, ...], tuple[BlockHash, ...]] | None = None

    def cached_tokens(self, request: RouteRequest, view: WorkerView, now: float) -> int:
        """Prompt tokens `view` is expected to hold for `request` (0 when the index is unknown)."""
        if request.prefix_matches is None or not request.block_hashes:
            return 0
        blocks = 0
        for m in request.prefix_matches:
            if m.worker_id == view.worker_id and m.epoch == view.epoch:
                blocks = m.num_blocks
        blocks = max(blocks, self.pending.leading(view.worker_id, request.block_hashes, now))
        blocks = min(blocks, len(request.block_hashes))
        return max(0, min(blocks * view.block_size, request.num_prompt_tokens - 1))

    def choose(
        self,
        request: RouteRequest,
        prefill_views: Sequence[WorkerView],
        decode_views: Sequence[WorkerView],
    ) -> RoutingDecision | None:
        if request.colocated:
            candidates = with_room(request, prefill_views)
        else:
            candidates = [v for v in prefill_views if v.usable]
        decodes = [] if request.colocated else with_room(request, decode_views)
        if not candidates or (not request.colocated and not decodes):
            return None
        now = self._clock()
        scored = self._score_prefills(request, candidates, now)
        decode: WorkerView | None = None
        if request.colocated:
            best = min(scored, key=lambda c: (-c.score, *c.order))
        else:
            pair = choose_pair(request, scored, decodes, self.pair, self.config.load_weight)
            assert pair is not None  # both sides have candidates
            best, decode = pair
        chosen, cached = best.view, best.cached
        new = self.pending.add(chosen.worker_id, request.block_hashes, now)
        self._credit = (request.request_id, chosen.worker_id, new, request.block_hashes)
        self._picks += 1
        self._last_pick[chosen.address] = self._picks
        if decode is None:
            return RoutingDecision(colocated=chosen, cached_tokens=cached)
        return RoutingDecision(prefill=chosen, decode=decode, cached_tokens=cached)

    def prefilled_elsewhere(self, request_id: str, worker: WorkerView) -> None:
        """The router prefills `request_id` on `worker` (hybrid local path: its decode worker),
        not on the prefill worker `choose` credited: that credit moves to `worker` (hashes the
        prefill worker was already credited with before stay; its blocks may be there)."""
        assert self._credit is not None and self._credit[0] == request_id, (
            request_id,
            self._credit,
        )
        _, credited, new, chain = self._credit
        self._credit = None
        self.pending.retract(credited, new)
        self.pending.add(worker.worker_id, chain, self._clock())

    def _score_prefills(
        self, request: RouteRequest, candidates: list[WorkerView], now: float
    ) -> list[PrefillCandidate]:
        """The candidates inside the balance threshold, scored; tie-break order: min load,
        min running, least recently picked, min address."""
        cfg = self.config
        loads = {v.address: load_tokens(v) for v in candidates}
        limit = cfg.balance_rel * min(loads.values()) + cfg.balance_abs_tokens
        out = []
        for v in candidates:
            load = loads[v.address]
            if load > limit:
                continue
            cached = self.cached_tokens(request, v, now)
            score = cfg.cache_weight * cached - cfg.load_weight * load
            recency = self._last_pick.get(v.address, 0)
            order = (load, v.num_running + v.in_flight, recency, v.address)
            out.append(PrefillCandidate(v, score, cached, order))
        assert out, (limit, loads)  # the least-loaded worker is always in
        return out
