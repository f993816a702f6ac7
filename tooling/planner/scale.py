"""The controller at cluster scale, in simulation: every fixed prefill:decode split against the
real ratio controller on one workload (`pdserve simulate`). Pure; runs in the CLI process.

`run_scale(setup)`:

1. draws the workload's requests (a built-in, `BUILTINS`, whose rates scale with the number of
   workers, or a phase spec ``WORKLOAD[@CONTEXT]:RATE:SECONDS,...`` with cluster rates);
2. simulates every fixed split 1:N-1 .. N-1:1 with the profile's costs (`sim.simulate`) and
   ranks them by goodput (requests meeting both SLOs per second of the run);
3. simulates the adaptive policy: the router's `RatioController` (`sim_adaptive`) starting
   from the best fixed split — where a planner would put a static cluster — so whatever it
   gains or loses against that split is the controller's own doing (`start`: another first
   split, e.g. to watch it converge);
4. returns a `ScaleResult` (`simulation.json`'s content); `scale_report` writes the Markdown
   report and its plots.

`hybrid` ("START:MIN:MAX"): every split is a hybrid cluster with threshold START, and the
adaptive run's controller also moves the threshold within MIN..MAX (`sim_adaptive`), its moves
in `thresholds`.

The controller's settings (`controller_config`) are the ones a cluster of this size would run:
bounds 1..N-1, a 10 s window (thousands of requests at this scale), a decision every 2 s,
a 5 s cooldown, a 30 s drain limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from router.hybrid import HybridConfig
from router.pair_scoring import PairScoringConfig
from router.ratio.config import RatioConfig
from tooling.planner.pairing import Links, pair_policy, policy_router, spread_nodes
from tooling.planner.planner import goodput_rps
from tooling.planner.profiles import Profile
from tooling.planner.sim import Router, Sim
from tooling.planner.sim_adaptive import AdaptiveResult, simulate_adaptive
from tooling.planner.sim_types import ClusterSpec, SimOutcome, SimRequest, attainment
from tooling.planner.workload import Phase, parse_phases, shifting, to_sim

CONTEXT = 4096  # length budget of phases that name none

# Built-in workloads: (workload[@context], requests/s per worker, seconds). Rates are ~85% of
# what the best split of the H100 profile serves per worker for that phase alone (16 workers:
# chat@8192 ~290 req/s at 4:12, summarize@2560 ~223 req/s at 14:2), so each phase needs its
# own split and none is idle.
BUILTINS: dict[str, list[Phase]] = {
    "shifting": [
        ("chat@8192", 13.0, 180.0),
        ("summarize@2560", 11.2, 180.0),
        ("chat@8192", 13.0, 180.0),
    ],
    "stationary": [("chat@8192", 13.0, 540.0)],
}
DEFAULT_SLO = (1.5, 0.05)  # TTFT, TPOT seconds: interactive on an H100-class GPU


@dataclass(frozen=True)
class ScaleSetup:
    """One `pdserve simulate` run."""

    profile: Profile
    workers: int
    workload: str  # a BUILTINS name or a phase spec
    slo_ttft_s: float = DEFAULT_SLO[0]
    slo_tpot_s: float = DEFAULT_SLO[1]
    target: float = 0.9
    seed: int = 0
    policy: str = "adaptive"  # or "fixed:P:D": the run the timeline shows beside the best fixed
    start: str = ""  # "P:D": the adaptive run's first split ("": the best fixed split)
    nodes: int = 1  # workers spread over this many nodes (pair-aware routing when > 1)
    cross_node_gbps: float | None = None  # link between nodes, GB/s (None: the profile's)
    hybrid: str = ""  # "START:MIN:MAX" local-prefill threshold ("": not hybrid)

    def hybrid_config(self) -> HybridConfig | None:
        """The `[router.hybrid]` section of `hybrid` (None: not hybrid). ValueError names the
        spelling."""
        if not self.hybrid:
            return None
        bits = self.hybrid.split(":")
        if len(bits) != 3 or not all(b.isdigit() for b in bits):
            raise ValueError(f"--hybrid must be START:MIN:MAX tokens, got {self.hybrid!r}")
        start, lo, hi = (int(b) for b in bits)
        if not 1 <= lo <= start <= hi:
            raise ValueError(f"--hybrid {self.hybrid}: need 1 <= MIN <= START <= MAX")
        return HybridConfig(
            local_prefill_max_tokens=start,
            min_local_prefill_max_tokens=lo,
            max_local_prefill_max_tokens=hi,
        )

    def link_gbps(self) -> float:
        gbps = self.cross_node_gbps or self.profile.cross_node_gbps
        if gbps is None:
            raise ValueError("--nodes > 1 needs --cross-node-gbps (the profile names no link)")
        return gbps

    def phases(self) -> list[Phase]:
        if self.workload in BUILTINS:
            return [(w, r * self.workers, d) for w, r, d in BUILTINS[self.workload]]
        return parse_phases(self.workload)


@dataclass
class SplitResult:
    """One simulated configuration over the whole run."""

    split: str
    prefill: int
    decode: int
    goodput_rps: float
    attainment: float
    ttft_attainment: float
    tpot_attainment: float
    phases: list[dict[str, float]] = field(default_factory=list)


@dataclass
class ScaleResult:
    """What `simulation.json` holds (plus, in memory, the outcomes the plots need)."""

    setup: dict[str, Any]
    adaptive_goodput: float
    best_fixed_goodput: float
    best_fixed_split: str
    adaptive_vs_best_fixed: float
    fixed: list[SplitResult]
    adaptive: SplitResult
    changes: list[tuple[float, int, int, str]]
    decisions: list[dict[str, Any]]
    subject: str
    pairing: dict[str, Any] = field(default_factory=dict)
    thresholds: list[tuple[float, int]] = field(default_factory=list)  # hybrid, adaptive run
    outcomes: dict[str, list[SimOutcome]] = field(default_factory=dict, repr=False)
    requests: list[SimRequest] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("outcomes", "requests")}
        out["fixed_goodput"] = {r.split: r.goodput_rps for r in self.fixed}
        return out


def base_spec(profile: Profile, workers: int) -> ClusterSpec:
    """The cluster of `workers` workers with the profile's engine settings; the router admits
    as many requests as the decode workers can batch (`max_num_seqs` each) and queues as many
    more, beyond which it sheds (RESOURCE_EXHAUSTED)."""
    e = profile.engine
    limit = e.max_num_seqs * workers
    return ClusterSpec(
        prefill=1,
        decode=workers - 1,
        chunk_tokens=e.chunk_tokens,
        max_num_seqs=e.max_num_seqs,
        num_kv_blocks=e.num_kv_blocks,
        block_size=e.block_size,
        max_inflight=limit,
        max_queued=limit,
        role_switch_s=profile.role_switch_s,
    )


def controller_config(setup: ScaleSetup) -> RatioConfig:
    """The ratio controller's settings for a cluster of `setup.workers` (module docstring)."""
    n = setup.workers
    return RatioConfig(
        mode="adaptive",
        slo_ttft_ms=setup.slo_ttft_s * 1e3,
        slo_tpot_ms=setup.slo_tpot_s * 1e3,
        attainment_target=setup.target,
        min_prefill=1,
        max_prefill=n - 1,
        min_decode=1,
        max_decode=n - 1,
        window_s=10.0,
        min_requests=20,
        interval_s=2.0,
        cooldown_s=5.0,
        drain_timeout_s=30.0,
        sample_interval_s=0.5,
        record_holds=False,
    )


@dataclass
class Topology:
    """How a run routes and moves KV: one node (least load, the profile's transfer cost) or
    several (the router's pair scoring, links between nodes: `pairing`)."""

    setup: ScaleSetup

    def pair_config(self) -> PairScoringConfig:
        prof, cost = self.setup.profile, self.setup.profile.cost(1)
        return PairScoringConfig(
            kv_bytes_per_token=prof.kv_bytes_per_token,
            num_layers=int(cost.meta.get("layers", 32)),
            cross_node_gbps=self.setup.link_gbps(),
            same_node_gbps=None,
            prefill_tokens_per_s=1.0 / max(cost.prefill.coef[1], 1e-12),
        )

    def spec(self, base: ClusterSpec, p: int, d: int) -> ClusterSpec:
        nodes = spread_nodes(p, d, self.setup.nodes) if self.setup.nodes > 1 else ()
        hybrid = self.setup.hybrid_config()
        threshold = None if hybrid is None else hybrid.local_prefill_max_tokens
        return replace(base, prefill=p, decode=d, nodes=nodes, hybrid_threshold=threshold)

    def wiring(self, blind: bool = False) -> tuple[Router | None, Links | None]:
        if self.setup.nodes <= 1:
            return None, None
        cfg = None if blind else self.pair_config()
        links = Links(
            self.setup.profile.kv_bytes_per_token,
            self.setup.link_gbps(),
            int(self.setup.profile.cost(1).meta.get("layers", 32)),
        )
        return policy_router(pair_policy(cfg)), links

    def run(
        self, reqs: Sequence[SimRequest], spec: ClusterSpec, blind: bool = False
    ) -> tuple[list[SimOutcome], Links | None]:
        router, links = self.wiring(blind)
        sim = Sim(reqs, spec, self.setup.profile.cost(1), router)
        sim.handoff = links
        return sim.run(), links


def _split_result(
    label: str,
    p: int,
    d: int,
    reqs: Sequence[SimRequest],
    outs: Sequence[SimOutcome],
    setup: ScaleSetup,
    starts: Sequence[tuple[float, float]],
) -> SplitResult:
    slo = (setup.slo_ttft_s, setup.slo_tpot_s)
    ttft, tpot, both = attainment(outs, *slo)
    phases = []
    for t0, t1 in starts:
        sub = [o for r, o in zip(reqs, outs, strict=True) if t0 <= r.arrival_s < t1]
        phases.append({"start_s": t0, "attainment": attainment(sub, *slo)[2], "requests": len(sub)})
    good = goodput_rps(reqs, outs, *slo)
    return SplitResult(label, p, d, good, both, ttft, tpot, phases)


def run_scale(setup: ScaleSetup) -> ScaleResult:
    """Every fixed split and the adaptive controller on the workload (module docstring)."""
    n = setup.workers
    if n < 2:
        raise ValueError(f"--workers must be >= 2, got {n}")
    policy = setup.policy
    subject_split: tuple[int, int] | None = None
    if policy != "adaptive":
        bits = policy.split(":")
        if len(bits) != 3 or bits[0] != "fixed":
            raise ValueError(f"policy must be 'adaptive' or 'fixed:P:D', got {policy!r}")
        subject_split = (int(bits[1]), int(bits[2]))
        if min(subject_split) < 1 or sum(subject_split) != n:
            raise ValueError(f"policy {policy}: P and D must be >= 1 and add up to {n} workers")
    chosen_start: tuple[int, int] | None = None
    if setup.start:
        p0, _, d0 = setup.start.partition(":")
        if not (p0.isdigit() and d0.isdigit()) or int(p0) < 1 or int(d0) < 1:
            raise ValueError(f"--start must be P:D with P, D >= 1, got {setup.start!r}")
        if int(p0) + int(d0) != n:
            raise ValueError(f"--start {setup.start}: P and D must add up to {n} workers")
        chosen_start = (int(p0), int(d0))
    phases = setup.phases()
    reqs = to_sim(shifting(phases, CONTEXT, setup.seed))
    cost = setup.profile.cost(1)
    base = base_spec(setup.profile, n)
    bounds, t = [], 0.0
    for _, _, duration in phases:
        bounds.append((t, t + duration))
        t += duration
    topo = Topology(setup)
    fixed, outcomes = [], {}
    for p in range(1, n):
        outs, _ = topo.run(reqs, topo.spec(base, p, n - p))
        fixed.append(_split_result(f"{p}:{n - p}", p, n - p, reqs, outs, setup, bounds))
        outcomes[f"{p}:{n - p}"] = outs
    best = max(fixed, key=lambda r: (r.goodput_rps, -r.prefill))
    first = chosen_start or (best.prefill, best.decode)
    start = topo.spec(base, *first)
    router, links = topo.wiring()
    res: AdaptiveResult = simulate_adaptive(
        reqs, start, cost, controller_config(setup), router, links, hybrid=setup.hybrid_config()
    )
    outcomes["adaptive"] = res.outcomes
    adaptive = _split_result("adaptive", *first, reqs, res.outcomes, setup, bounds)
    subject = "adaptive" if subject_split is None else f"{subject_split[0]}:{subject_split[1]}"
    pairing = _pairing(topo, reqs, start, setup, bounds) if setup.nodes > 1 else {}
    return ScaleResult(
        setup={
            "profile": setup.profile.name,
            "worker": setup.profile.worker,
            "workers": n,
            "workload": setup.workload,
            "phases": [list(ph) for ph in phases],
            "requests": len(reqs),
            "slo_ttft_s": setup.slo_ttft_s,
            "slo_tpot_s": setup.slo_tpot_s,
            "target": setup.target,
            "seed": setup.seed,
            "policy": policy,
            "controller": controller_config(setup).model_dump(mode="json"),
            "cluster": asdict(start),
            "nodes": setup.nodes,
            "cross_node_gbps": setup.link_gbps() if setup.nodes > 1 else None,
            "hybrid": setup.hybrid,
        },
        adaptive_goodput=adaptive.goodput_rps,
        best_fixed_goodput=best.goodput_rps,
        best_fixed_split=best.split,
        adaptive_vs_best_fixed=adaptive.goodput_rps / best.goodput_rps
        if best.goodput_rps > 0
        else 0.0,
        fixed=fixed,
        adaptive=adaptive,
        changes=res.changes,
        thresholds=res.thresholds,
        decisions=[r.to_json() | {"inputs": {}} for r in res.records],
        subject=subject,
        pairing=pairing,
        outcomes=outcomes,
        requests=list(reqs),
    )


def _pairing(
    topo: Topology,
    reqs: Sequence[SimRequest],
    spec: ClusterSpec,
    setup: ScaleSetup,
    bounds: Sequence[tuple[float, float]],
) -> dict[str, Any]:
    """At the best fixed split: node-blind least load vs pair scoring (goodput, TTFT p90,
    the share of pairs that crossed nodes)."""
    out: dict[str, Any] = {"split": f"{spec.prefill}:{spec.decode}", "nodes": list(spec.nodes)}
    for name, blind in (("node_blind", True), ("pair_aware", False)):
        outs, links = topo.run(reqs, spec, blind)
        assert links is not None
        r = _split_result(name, spec.prefill, spec.decode, reqs, outs, setup, bounds)
        ttfts = sorted(o.ttft_s for o in outs if o.ok and o.ttft_s is not None)
        out[name] = {
            "goodput_rps": r.goodput_rps,
            "attainment": r.attainment,
            "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else None,
            "cross_node_share": links.cross_share,
        }
    blind_g = out["node_blind"]["goodput_rps"]
    out["pair_vs_blind"] = out["pair_aware"]["goodput_rps"] / blind_g if blind_g > 0 else None
    return out
