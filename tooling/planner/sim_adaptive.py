"""The simulator with the real ratio controller in the loop: what `mode = "adaptive"` does on a
workload, with the router's own controller code (`router.ratio.driver.RatioController`: its
sampling, windows, decisions, hysteresis, cooldown, reverts and decision log) running on the
simulator's clock. Pure (asyncio, no I/O, no sleeping); runs in `pdserve simulate`,
`pdserve plan --adaptive` and the ratio benchmark.

How the two are joined:

- the controller's clock is the simulator's (`clock=lambda: sim.now`), and the simulator calls
  `controller.tick()` every `sample_interval_s` of simulated time — what the driver's own
  `run` loop does every `sample_interval_s` of wall time;
- `SimPool.views()` shows the simulated workers as the router's pool would (`WorkerView`:
  role, draining, queued prompt tokens, running and waiting requests, free KV blocks);
- the router reports every request's end (`observe(ttft, tpot, ok, e2e)`), here from the
  simulator's per-request outcome, at the simulated time it ends;
- `SimActuator.switch_role` is the `Actuator` contract on the simulator: the worker drains
  (takes no new work, finishes what it holds; past `drain_timeout_s` what is left is aborted),
  comes back in its new role `ClusterSpec.role_switch_s` later, and only then does the call
  return — so the change completes, and the cooldown starts, at the simulated time it would.
  The simulator stops at each flip so the controller's change task finishes at that instant;
- on a hybrid cluster with threshold bounds (`hybrid`: a `[router.hybrid]` section with
  `max_local_prefill_max_tokens` set), the controller gets the router's `LiveThreshold` and
  decides with `router.ratio.threshold.decide_with_threshold`, as the driver does in the
  router; the simulator's path decision reads the live threshold for every request
  (`sim_routing.live_rule`), and each request's end is observed with the path it took, so a
  move takes effect with the next request and is judged, kept or reverted as in the router.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.hybrid import HybridConfig, LiveThreshold
from router.policy import Role, WorkerView
from router.ratio.actuator import ActuationError
from router.ratio.config import RatioConfig
from router.ratio.driver import DecisionRecord, RatioController
from tooling.planner.costs import CostModel
from tooling.planner.sim import Router, Sim
from tooling.planner.sim_routing import Choose, address, live_rule, view
from tooling.planner.sim_types import ClusterSpec, SimOutcome, SimRequest
from tooling.planner.sim_workers import Job, Worker


@dataclass
class AdaptiveResult:
    """Outcomes per request; the ratio over time [(t, prefill, decode, what)]; every record
    of the controller's decision log (changes and their `done` / `failed` records)."""

    outcomes: list[SimOutcome]
    changes: list[tuple[float, int, int, str]] = field(default_factory=list)
    records: list[DecisionRecord] = field(default_factory=list)
    thresholds: list[tuple[float, int]] = field(default_factory=list)
    """The hybrid threshold over time [(t, tokens)] (empty: not controlled)."""

    @property
    def decisions(self) -> list[DecisionRecord]:
        """The change decisions (not their completions)."""
        return [r for r in self.records if r.event == "decision" and r.action != "hold"]


class SimPool:
    """The controller's `ViewSource` over the simulator."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim

    def views(self) -> list[WorkerView]:
        return [view(w, self.sim.spec) for w in self.sim.workers]


class SimActuator:
    """The `Actuator` contract on the simulator (module docstring)."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self._waiting: dict[int, asyncio.Future[None]] = {}

    async def switch_role(self, addr: str, role: Role, drain_timeout_s: float) -> None:
        w = next((x for x in self.sim.workers if address(x) == addr), None)
        if w is None or role not in ("prefill", "decode") or w.kind == role or w.drain_to:
            raise ActuationError(f"switch {addr} -> {role}: not a worker that can switch now")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[w.index] = fut
        self.sim.switch(w, role, drain_timeout_s)
        await fut

    def flipped(self, w: Worker) -> None:
        """The simulator flipped `w`: its `switch_role` call returns."""
        fut = self._waiting.pop(w.index, None)
        if fut is not None and not fut.done():
            fut.set_result(None)


async def _settle() -> None:
    """Let the controller's tasks run up to their next wait (no time passes)."""
    for _ in range(8):
        await asyncio.sleep(0)


async def run_adaptive(
    requests: Sequence[SimRequest],
    spec: ClusterSpec,
    cost: CostModel,
    config: RatioConfig,
    router: Router | None = None,
    handoff: Callable[[Sim, Job], float] | None = None,
    choose: Choose | None = None,
    hybrid: HybridConfig | None = None,
) -> AdaptiveResult:
    """`simulate_adaptive` on the running event loop."""
    if config.mode != "adaptive":
        raise ValueError(
            f"simulating the controller needs ratio mode 'adaptive', got {config.mode!r}"
        )
    if spec.colocated:
        raise ValueError("the ratio controller runs on disaggregated clusters only")
    live: LiveThreshold | None = None
    if hybrid is not None:
        if choose is not None:
            raise ValueError("a controlled hybrid threshold decides the path: no `choose`")
        live = LiveThreshold(hybrid)  # ValueError from the controller without bounds
        choose = live_rule(live)
    sim = Sim(requests, spec, cost, router, choose=choose)
    sim.handoff = handoff
    actuator = SimActuator(sim)
    ctrl = RatioController(
        config,
        SimPool(sim),
        actuator,
        clock=lambda: sim.now,
        wall_clock=lambda: sim.now,
        threshold=live,
    )

    def on_end(i: int, o: SimOutcome) -> None:
        path = o.path if live is not None and o.path in ("local", "remote") else ""
        ctrl.observe(o.ttft_s, o.tpot_s, o.ok, sim.now - requests[i].arrival_s, path)

    sim.on_end = on_end
    records: list[DecisionRecord] = []

    def harvest() -> None:  # the controller keeps its last 1000 records; keep them all
        last = records[-1].seq if records else 0
        records.extend(r for r in ctrl.records if r.seq > last)

    step = config.sample_interval_s
    t_next = step
    while True:
        done = sim.run_until(t_next)
        if sim.flipped:
            for w in sim.flipped:
                actuator.flipped(w)
            sim.flipped.clear()
            await _settle()
            harvest()
            if not done:
                continue
        if done:
            break
        await ctrl.tick()
        await _settle()
        harvest()
        t_next += step
    await ctrl.stop()
    harvest()
    changes = [(0.0, spec.prefill, spec.decode, "start")]
    for r in records:
        if r.event == "done":
            changes.append(
                (r.t, r.prefill_workers, r.decode_workers, f"{r.address} -> {r.to_role}")
            )
    thresholds = [] if live is None else [(0.0, live.bounds.local_prefill_max_tokens)]
    for r in records:
        if live is not None and r.event == "done" and r.threshold_to is not None:
            thresholds.append((r.t, r.threshold_to))
    return AdaptiveResult(sim.out, changes, records, thresholds)


def simulate_adaptive(
    requests: Sequence[SimRequest],
    spec: ClusterSpec,
    cost: CostModel,
    config: RatioConfig,
    router: Router | None = None,
    handoff: Callable[[Sim, Job], float] | None = None,
    choose: Choose | None = None,
    hybrid: HybridConfig | None = None,
) -> AdaptiveResult:
    """Run `requests` on `spec` (its prefill:decode split is the starting ratio) with the
    controller of `config` (mode 'adaptive') switching roles (module docstring); `router` /
    `handoff` / `choose`: the simulator's routing, KV hand-off and hybrid decision (defaults:
    least load, `cost`, the spec's `hybrid_threshold` rule); `hybrid`: a `[router.hybrid]`
    section with threshold bounds — the controller moves the threshold too."""
    return asyncio.run(run_adaptive(requests, spec, cost, config, router, handoff, choose, hybrid))


def records_json(res: AdaptiveResult) -> list[dict[str, Any]]:
    """The decision log of a simulated run (changes and completions; holds if recorded)."""
    return [r.to_json() for r in res.records]
