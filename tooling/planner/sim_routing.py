"""How the simulated router routes: the router's own policy code on views of the simulated
workers, and the hybrid path decision. Pure; used by `sim.Sim`, `sim_adaptive` and `pairing`.

- `view(w, spec)`: a simulated worker as the router's pool shows it (`router.views.WorkerView`),
  read from its real scheduler: queued prompt tokens, running and waiting requests (reservations
  included), free KV blocks;
- `Router`: the seam that picks a (prefill, decode) pair; `policy_router(policy)` (a
  `PolicyRouter`) asks a real `router.policy.RoutingPolicy`, which the simulator also tells
  when a hybrid request prefills on its decode worker (`prefilled_elsewhere`) (default: the
  router's `least_load`;
  `sim_policy(name, clock)` builds any registered one, `prefix_aware` on the simulator's
  clock). A policy that `uses_prefix_matches` gets the prompt's block-hash chain and, as the
  prefix index would answer, how many leading blocks each candidate's pool holds; a private
  prompt (no token ids) has no chain to look up, so such a policy routes it by load;
- `colocated_pick`: the same policy's colocated choice;
- `Choose`: the hybrid decision, one pure function of four numbers; `hybrid_rule(config)` is
  the router's own `router.hybrid.choose_prefill_path` under a `[router.hybrid]` config,
  `live_rule(live)` the same under the router's live threshold (which the ratio controller
  moves: `sim_adaptive`), and `threshold_rule(t)` that rule with only the threshold set (the
  default).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, Protocol

from router.hybrid import HybridConfig, LiveThreshold, choose_prefill_path
from router.policies import make_policy
from router.policy import RouteRequest, RoutingPolicy, WorkerView
from router.prefix_index.base import PrefixMatch
from router.prefix_policy import PrefixAwarePolicy
from router.views import Role
from tooling.planner.costs import CostModel
from tooling.planner.sim_engine import block_hashes
from tooling.planner.sim_types import ClusterSpec, SimRequest
from tooling.planner.sim_workers import Worker

ROUTE_ID = "sim"  # the request id the simulated router gives its policy


class SimView(Protocol):
    """What a router may read of the simulator (`sim.Sim` is one): its clock, cluster and
    costs. Read-only; a router never changes the simulation."""

    @property
    def now(self) -> float: ...
    @property
    def spec(self) -> ClusterSpec: ...
    @property
    def cost(self) -> CostModel: ...


Pick = tuple[Worker, Worker, float]  # (prefill, decode, KV hand-off seconds)
Router = Callable[[SimView, SimRequest, list[Worker], list[Worker]], Pick | None]
"""`router(sim, request, prefill workers, decode workers)` (those taking new work) -> the pair
and its KV hand-off delay, or None (no capacity: the request fails, as RESOURCE_EXHAUSTED).
Default: `policy_router` of the simulator's policy (`sim_policy`)."""

Decision = Literal["local", "remote"]
Choose = Callable[[int, int, int, int], Decision]
"""`choose(uncached_tokens, prefill_queued_tokens, decode_queued_tokens, decode_running)` ->
"local" (prefill on the decode worker, chunked inside its decode batches) or "remote" (through
the prefill worker). `uncached_tokens`: the prompt's tokens the chosen decode worker's prefix
cache lacks; `*_queued_tokens`: prompt tokens still to prefill on the chosen prefill / decode
worker; `decode_running`: requests running on the decode worker."""


def hybrid_rule(config: HybridConfig) -> Choose:
    """The router's path decision (`router.hybrid.choose_prefill_path`) under `config`; the
    simulator has already subtracted the decode worker's cached prefix, and its prefix cache
    on the prefill side does not change the path."""

    def choose(
        uncached_tokens: int,
        prefill_queued_tokens: int,
        decode_queued_tokens: int,
        decode_running: int,
    ) -> Decision:
        return choose_prefill_path(
            config,
            prompt_tokens=max(1, uncached_tokens),
            cached_on_decode=0,
            cached_on_prefill=0,
            prefill_queued_tokens=prefill_queued_tokens,
            decode_queued_tokens=decode_queued_tokens,
            decode_running=decode_running,
        ).path

    return choose


def live_rule(live: LiveThreshold) -> Choose:
    """`hybrid_rule` under the router's live threshold (`router.hybrid.LiveThreshold`), read
    for every request as the router's request path reads it: the ratio controller moves it."""

    def choose(
        uncached_tokens: int,
        prefill_queued_tokens: int,
        decode_queued_tokens: int,
        decode_running: int,
    ) -> Decision:
        return hybrid_rule(live.config())(
            uncached_tokens, prefill_queued_tokens, decode_queued_tokens, decode_running
        )

    return choose


def threshold_rule(threshold: int) -> Choose:
    """Local when the uncached prompt is at most `threshold` tokens (llm-d's rule), unless
    the decode worker has more work than the prefill worker (the spill rule): the
    router's rule with `local_prefill_max_tokens` set and the section's other defaults (0:
    never local)."""
    return hybrid_rule(HybridConfig(local_prefill_max_tokens=threshold))


def address(w: Worker) -> str:
    return f"w{w.index}"


def view(w: Worker, spec: ClusterSpec) -> WorkerView:
    """`w` as the router's pool shows it (module docstring)."""
    role: Role = (
        "prefill" if w.kind == "prefill" else "colocated" if w.kind == "colocated" else "decode"
    )
    eng = w.eng
    return WorkerView(
        worker_id=address(w),
        address=address(w),
        role=role,
        healthy=True,
        draining=bool(w.drain_to),
        num_waiting=eng.num_waiting,
        num_receiving=eng.num_receiving,
        num_running=eng.num_running,
        waiting_tokens=eng.queued_tokens(),
        free_blocks=eng.free_blocks,
        total_blocks=spec.num_kv_blocks,
        block_size=spec.block_size,
        node=w.node,
    )


def route_request(
    policy: RoutingPolicy,
    spec: ClusterSpec,
    r: SimRequest,
    candidates: Sequence[Worker],
    colocated: bool = False,
) -> RouteRequest:
    """What the router's policy knows of `r`: lengths, and for a policy that reads prefix
    matches, the chain of a prompt with token ids and each candidate's matched blocks."""
    hashes: tuple[int, ...] = ()
    matches: tuple[PrefixMatch, ...] | None = None
    if policy.uses_prefix_matches and r.tokens:
        hashes = tuple(block_hashes(list(r.tokens), spec.block_size))
        matches = tuple(
            PrefixMatch(address(w), 0, n)
            for w in candidates
            if (n := w.eng.matched_blocks(list(hashes)))
        )
    return RouteRequest(
        ROUTE_ID,
        num_prompt_tokens=r.input_len,
        max_tokens=r.output_len,
        colocated=colocated,
        block_hashes=hashes,
        prefix_matches=matches,
    )


def sim_policy(name: str, clock: Callable[[], float]) -> RoutingPolicy:
    """The router's policy registered as `name`, on the simulator's `clock` where it keeps
    time (`prefix_aware`'s pending credit)."""
    if name == PrefixAwarePolicy.name:
        return PrefixAwarePolicy(clock=clock)
    return make_policy(name)


class PolicyRouter:
    """A simulator `Router` that asks a router policy (`policy`), with a same-node KV hand-off
    (`cost.transfer`). The simulator tells `policy` when it prefills a request on the
    decode worker instead (`prefilled_elsewhere`, as `router.flow` does)."""

    def __init__(self, policy: RoutingPolicy) -> None:
        self.policy = policy

    def __call__(
        self, sim: SimView, r: SimRequest, prefills: list[Worker], decodes: list[Worker]
    ) -> Pick | None:
        policy = self.policy
        by_addr = {address(w): w for w in [*prefills, *decodes]}
        decision = policy.choose(
            route_request(policy, sim.spec, r, prefills),
            [view(w, sim.spec) for w in prefills],
            [view(w, sim.spec) for w in decodes],
        )
        if decision is None or decision.prefill is None or decision.decode is None:
            return None
        p, d = by_addr[decision.prefill.address], by_addr[decision.decode.address]
        return p, d, max(0.0, sim.cost.transfer(r.input_len))


def policy_router(policy: RoutingPolicy) -> PolicyRouter:
    """A simulator router that asks `policy` (`PolicyRouter`)."""
    return PolicyRouter(policy)


def colocated_pick(
    policy: RoutingPolicy, spec: ClusterSpec, r: SimRequest, workers: Sequence[Worker]
) -> Worker | None:
    """The colocated worker `policy` picks for `r` (None: none has room)."""
    by_addr = {address(w): w for w in workers}
    request = route_request(policy, spec, r, workers, colocated=True)
    decision = policy.choose(request, [view(w, spec) for w in workers], [])
    if decision is None or decision.colocated is None:
        return None
    return by_addr[decision.colocated.address]
