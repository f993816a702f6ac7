"""The simulator with the real ratio controller in the loop: predicts what `mode = "adaptive"`
does on a workload (e.g. a shifting one), with the same core (`router.ratio.controller.decide`)
and the same window arithmetic (`MetricsAggregator`) the router runs. Pure; runs in
`pdserve plan --adaptive` and the ratio benchmark.

Every `sample_interval_s` of simulated time the workers are sampled as `WorkerView`s (the
pool's view: role, draining, queued prompt tokens, running requests, free KV blocks); every
`interval_s` a window is built from the requests that ended (client TTFT/TPOT, as the
benchmark's sidecar observes them) and `decide` runs. A `switch` drains the worker in the
simulator — it takes no new work, finishes what it holds (decode: every request that reserved
blocks on it) — and flips its role when it holds nothing; the change then counts as complete
(`ControllerState.end`), which starts the cooldown. Scaling decisions are recorded but not
simulated (the simulated cluster has a fixed size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from router.policy import WorkerView
from router.ratio.config import RatioConfig
from router.ratio.controller import ControllerState, Decision, decide
from router.ratio.metrics import MetricsAggregator, samples_from_views
from tooling.planner.costs import CostModel
from tooling.planner.sim import ClusterSpec, SimOutcome, SimRequest, _Sim, _Worker


@dataclass
class AdaptiveResult:
    """Outcomes per request, and the ratio over time [(t, prefill, decode, what)]."""

    outcomes: list[SimOutcome]
    changes: list[tuple[float, int, int, str]] = field(default_factory=list)
    decisions: list[tuple[float, Decision]] = field(default_factory=list)


def _view(w: _Worker, spec: ClusterSpec) -> WorkerView:
    running = len(w.running) if w.kind == "decode" else len(w.step or ())
    return WorkerView(
        worker_id=f"w{w.index}",
        address=f"w{w.index}",
        role="prefill" if w.kind == "prefill" else "decode",
        healthy=True,
        draining=bool(w.drain_to),
        num_waiting=len(w.queue),
        num_running=running,
        waiting_tokens=w.queued_tokens() if w.kind == "prefill" else 0,
        free_blocks=w.free_blocks if w.kind == "decode" else spec.num_kv_blocks,
        total_blocks=spec.num_kv_blocks,
        block_size=spec.block_size,
    )


def simulate_adaptive(
    requests: Sequence[SimRequest], spec: ClusterSpec, cost: CostModel, config: RatioConfig
) -> AdaptiveResult:
    """Run `requests` on `spec` (its prefill:decode split is the starting ratio) with the
    controller of `config` (mode 'adaptive') switching roles (module docstring)."""
    if config.mode != "adaptive":
        raise ValueError(f"simulate_adaptive needs ratio mode 'adaptive', got {config.mode!r}")
    sim = _Sim(requests, spec, cost)
    agg = MetricsAggregator(config.window_s, config.slo_ttft_s, config.slo_tpot_s)
    state = ControllerState()
    res = AdaptiveResult(sim.out, [(0.0, spec.prefill, spec.decode, "start")])
    next_eval = config.interval_s
    moving: list[_Worker] = []

    def counts() -> tuple[int, int]:
        kinds = [w.kind for w in sim.workers]
        return kinds.count("prefill"), kinds.count("decode")

    def on_end(i: int, o: SimOutcome) -> None:
        agg.observe(sim.now, o.ttft_s, o.tpot_s, o.ok, sim.now - requests[i].arrival_s)

    def on_tick(s: _Sim) -> None:
        nonlocal next_eval
        now = s.now
        if moving and not moving[0].drain_to:  # the drained worker flipped: change complete
            w = moving.pop()
            state.end(now)
            res.changes.append((now, *counts(), f"w{w.index} -> {w.kind}"))
        agg.add_samples(now, samples_from_views([_view(w, spec) for w in s.workers], now))
        if now + 1e-9 < next_eval:
            return
        next_eval += config.interval_s
        window = agg.window(now, state.last_change_end)
        d = decide(window, state, now, config)
        if d.action == "hold":
            return
        res.decisions.append((now, d))
        state.begin(d, now, window)
        if d.action == "switch":
            assert d.address is not None and d.to_role is not None
            w = next(x for x in s.workers if f"w{x.index}" == d.address)
            s.switch(w, d.to_role)
            moving.append(w)
        else:  # scaling is not simulated: the change ends at once
            state.end(now, ok=False)

    sim.on_end = on_end
    sim.on_tick = on_tick
    sim.tick_s = config.sample_interval_s
    sim.run()
    return res
