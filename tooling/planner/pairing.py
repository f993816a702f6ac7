"""Prefill/decode pairs on a multi-node cluster, in simulation: the router's real policy picks
the pair, and the KV hand-off costs what the link between the two workers costs. Pure; runs
in `pdserve simulate --nodes K`.

- `spread_nodes(prefill, decode, k)`: node labels that put each role's workers round-robin
  over k nodes (every node holds both roles when there are enough workers);
- `pair_policy(config)`: the router's `least_load` policy, node-blind when every transfer is
  priced 0 or with pair scoring (`router.pair_scoring`); `sim_routing.policy_router` asks it
  with `WorkerView`s of the simulated workers;
- `Links`: the hand-off physics. A pair on one node moves KV at the profile's same-node cost
  (`cost.transfer`: shared memory / NVLink). A pair across nodes moves the prompt's KV bytes
  over the prefill worker's link at `cross_node_gbps`, layer by layer while the prefill
  computes: the push starts with the request's own prefill compute at the earliest and waits
  for the link's earlier transfers (one link per prefill worker, FIFO); what is left when the
  prefill ends is added to TTFT (at least one layer's share).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.pair_scoring import PairScoringConfig
from router.policy import LeastLoadPolicy
from tooling.planner.sim_routing import SimView, policy_router
from tooling.planner.sim_workers import Job

__all__ = ["Links", "pair_policy", "policy_router", "spread_nodes"]


def spread_nodes(prefill: int, decode: int, k: int) -> tuple[str, ...]:
    """Node labels n0..n{k-1} for prefill workers then decode workers, each role dealt out
    round-robin over the nodes."""
    if k < 1:
        raise ValueError(f"nodes must be >= 1, got {k}")
    return tuple(f"n{i % k}" for i in range(prefill)) + tuple(f"n{i % k}" for i in range(decode))


def pair_policy(config: PairScoringConfig | None) -> LeastLoadPolicy:
    """`least_load` with pair scoring (`config`), or node-blind (None: every move priced 0)."""
    blind = PairScoringConfig(kv_bytes_per_token=0.0)
    return LeastLoadPolicy(config if config is not None else blind)


@dataclass
class Links:
    """KV hand-off physics (module docstring). `kv_bytes_per_token`, `cross_node_gbps` GB/s,
    `layers`; counts the pairs it moved each way."""

    kv_bytes_per_token: float
    cross_node_gbps: float
    layers: int
    free_at: dict[int, float] = field(default_factory=dict)  # prefill worker -> link free
    same: int = 0
    cross: int = 0

    def __call__(self, sim: SimView, job: Job) -> float:
        assert job.prefill is not None
        n = job.req.input_len
        if job.prefill.node == job.decode.node:
            self.same += 1
            return max(0.0, sim.cost.transfer(n))
        self.cross += 1
        link = n * self.kv_bytes_per_token / (self.cross_node_gbps * 1e9)
        compute = sim.cost.prefill_s([(0, n)])
        start = max(sim.now - compute, self.free_at.get(job.prefill.index, 0.0))
        end = start + link
        self.free_at[job.prefill.index] = end
        return max(end - sim.now, link / max(self.layers, 1))

    @property
    def cross_share(self) -> float:
        total = self.same + self.cross
        return self.cross / total if total else 0.0
