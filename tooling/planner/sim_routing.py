"""How the simulated router picks a (prefill, decode) pair: the `Router` seam and the default
`least_load`. Pure; used by `sim.Sim` (and `pairing.policy_router`, which asks the router's own
policy code instead).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tooling.planner.costs import CostModel
from tooling.planner.sim_types import ClusterSpec, SimRequest
from tooling.planner.sim_workers import Worker


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
"""`router(sim, request, prefill workers, decode workers with room)` -> the pair and its KV
hand-off delay, or None (no capacity: the request fails). Default: `least_load`."""


def least_load(
    sim: SimView, r: SimRequest, prefills: list[Worker], room: list[Worker]
) -> Pick | None:
    """The router's `least_load` policy: decode with the fewest requests (then the most free
    blocks), prefill with the fewest queued prompt tokens; hand-off `cost.transfer`."""
    if not prefills or not room:
        return None
    d = min(room, key=lambda w: (w.held, -w.free_blocks, w.index))
    p = min(prefills, key=lambda w: (w.qtokens, len(w.queue), w.index))
    return p, d, max(0.0, sim.cost.transfer(r.input_len))
