"""The simulator runs the engine's real scheduler: its steps are the ones a bare
`model_runtime.scheduler.Scheduler` composes for the same requests (chunking, preemption, prefix
hits), virtual time advances by the cost model's price of each step, the remote path holds
blocks on both sides until the hand-off lands, hybrid routing splits by the uncached prompt,
and the planner recommends the best predicted mode. Pure, about a second."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace

import pytest

from model_runtime.block_pool import BlockPool
from model_runtime.request import Request
from model_runtime.sampling_params import SamplingParams
from model_runtime.scheduler import Scheduler, SchedulerConfig
from tooling.planner.costs import CostModel, Linear
from tooling.planner.planner import (
    Alternative,
    alternatives,
    best_by_mode,
    plan_alternatives,
    threshold_grid,
)
from tooling.planner.sim import ClusterSpec, Sim, SimRequest
from tooling.planner.sim_engine import TOKEN, Step, prompt_tokens
from tooling.planner.sim_routing import Decision, threshold_rule
from tooling.planner.sim_workers import Route, Worker
from tooling.planner.workload import requests, to_sim

# prefill: 10 ms + 1 ms/token; decode: 5 ms + 1 ms/request; transfer 2 ms; overhead 1 ms
COST = CostModel(
    prefill=Linear((0.010, 0.001, 0.0)),
    decode=Linear((0.005, 0.001, 0.0)),
    transfer=Linear((0.002, 0.0)),
    ttft_overhead=Linear((0.001, 0.0)),
)

Shape = list[tuple[str, int, int, bool]]  # (request, start, tokens, samples) per item


def _shape(step: Step) -> tuple[Shape, list[str]]:
    out = step.out
    assert out is not None  # with `on_step` set every step is a real one
    items = [(i.request_id, i.start_pos, len(i.token_ids), i.samples) for i in out.items]
    return items, list(out.preempted_ids)


def _prompts() -> list[tuple[int, ...]]:
    shared = (7,) * 8  # two full blocks of 4 that later prompts find cached
    return [shared + (1, 2), shared + (3, 4), shared + (5, 6), (9,) * 10]


def _sim_steps(reqs: list[SimRequest], spec: ClusterSpec) -> list[tuple[Shape, list[str]]]:
    sim = Sim(reqs, spec, COST)
    seen: list[tuple[Shape, list[str]]] = []

    def on_step(w: Worker, step: Step) -> None:
        w.eng.check()
        seen.append(_shape(step))

    sim.on_step = on_step
    assert all(o.ok for o in sim.run())
    return seen


def _bare_steps(
    prompts: list[list[int]], outputs: list[int], cfg: SchedulerConfig, blocks: int
) -> tuple[list[tuple[Shape, list[str]]], int]:
    """The steps a bare scheduler composes for the same requests (all queued at once), one
    sampled token per sampling item; and how many admissions hit the prefix cache."""
    sched = Scheduler(cfg, BlockPool(blocks))
    for i, (prompt, n_out) in enumerate(zip(prompts, outputs, strict=True)):
        params = SamplingParams(max_tokens=n_out, ignore_eos=True)
        sched.add(Request(f"r{i}", list(prompt), params, arrival_time=0.0))
    bare: list[tuple[Shape, list[str]]] = []
    hits = 0
    while sched.has_unfinished():
        out = sched.schedule()
        shape = [(i.request_id, i.start_pos, len(i.token_ids), i.samples) for i in out.items]
        bare.append((shape, list(out.preempted_ids)))
        hits += sum(
            sched.requests[i.request_id].num_cached_tokens > 0
            for i in out.items
            if i.start_pos > 0 and sched.requests[i.request_id].num_output_tokens == 0
        )
        sched.update(out, [TOKEN if i.samples else None for i in out.items])
    return bare, hits


def test_steps_are_the_real_schedulers_with_chunks_preemption_and_prefix_hits() -> None:
    spec = ClusterSpec(0, 0, colocated=1, chunk_tokens=8, max_num_seqs=4, num_kv_blocks=12,
                       block_size=4)  # fmt: skip
    cfg = SchedulerConfig(block_size=4, max_num_batched_tokens=8, max_num_seqs=4,
                          max_model_len=1 << 30)  # fmt: skip
    reqs = [SimRequest(0.0, 10, 12, tokens=t) for t in _prompts()]
    bare, hits = _bare_steps([list(r.tokens) for r in reqs], [12] * 4, cfg, 12)
    assert _sim_steps(reqs, spec) == bare
    assert any(pre for _, pre in bare), "the scenario must preempt"
    assert any(not samples for shape, _ in bare for *_, samples in shape), "and chunk"
    assert hits > 0, "and hit the prefix cache"

    # private prompts (no token ids: unique block ids, no content hashing) schedule exactly
    # as the same prompts hashed by the engine
    private = [SimRequest(0.0, n, 9) for n in (10, 7, 13, 10)]
    prompts = [prompt_tokens(i + 1, r.input_len) for i, r in enumerate(private)]
    bare, _ = _bare_steps(prompts, [9] * 4, cfg, 12)
    assert _sim_steps(private, spec) == bare
    assert any(pre for _, pre in bare)


def test_virtual_time_advances_by_the_cost_of_each_composed_step() -> None:
    spec = ClusterSpec(0, 0, colocated=1, chunk_tokens=16, max_num_seqs=4)
    reqs = [SimRequest(0.0, 40, 6), SimRequest(0.0, 20, 4)]
    sim = Sim(reqs, spec, COST)
    starts: list[tuple[float, float]] = []

    def on_step(w: Worker, step: Step) -> None:
        b = step.batch
        starts.append((sim.now, COST.step_s(b.chunks, b.decode, b.context)))

    sim.on_step = on_step
    sim.run()
    assert len(starts) > 4
    for (t0, cost), (t1, _) in itertools.pairwise(starts):
        assert t1 == pytest.approx(t0 + cost)  # the worker is never idle in between
    assert starts[0][1] == pytest.approx(0.010 + 0.016)  # first: a 16-token prompt chunk


def test_remote_path_holds_blocks_on_both_sides_until_the_hand_off_lands() -> None:
    cost = CostModel(prefill=COST.prefill, decode=COST.decode, transfer=Linear((0.5, 0.0)))
    sim = Sim([SimRequest(0.0, 64, 3)], ClusterSpec(1, 1, block_size=16), cost)
    p, d = sim.workers
    sim.run_until(0.3)  # prefilled at 74 ms; the hand-off lands at 574 ms
    assert p.eng.free_blocks == 1024 - 4  # held: the transfer still reads them
    assert d.eng.free_blocks == 1024 - 5 and d.eng.num_waiting == 1  # reserved: 64 + 2 tokens
    assert d.eng.num_receiving == 1  # its KV is still to arrive: not a decode queue
    (o,) = sim.run()
    assert o.ok and o.ttft_s == pytest.approx(0.074 + 0.5)
    assert p.eng.free_blocks == 1024 and not p.eng.busy() and not d.eng.busy()


def test_hybrid_routes_by_the_uncached_prompt_through_the_injected_decision() -> None:
    spec = ClusterSpec(1, 1, hybrid_threshold=64)
    reqs = [SimRequest(0.1 * i, n, 4) for i, n in enumerate([32, 300, 64, 65, 10])]
    sim = Sim(reqs, spec, COST)
    prefill_steps: list[str] = []

    def on_step(w: Worker, step: Step) -> None:
        if w.kind == "prefill":
            assert step.out is not None
            prefill_steps.extend(i.request_id for i in step.out.items)

    sim.on_step = on_step
    outs = sim.run()
    assert all(o.ok for o in outs)
    assert sim.routes[Route.LOCAL] == 3 and sim.routes[Route.REMOTE] == 2
    assert sorted(set(prefill_steps)) == ["r1", "r3"]  # 300 and 65 tokens: above 64

    # the decode worker's own cache counts: the same 300-token prompt, once it is cached
    # there, has 300 - 288 uncached tokens and prefills locally
    same = tuple(range(300))
    asked: list[tuple[int, int, int, int]] = []
    rule = threshold_rule(64)

    def choose(uncached: int, prefill_queued: int, decode_queued: int, running: int) -> Decision:
        asked.append((uncached, prefill_queued, decode_queued, running))
        return rule(uncached, prefill_queued, decode_queued, running)

    twice = [SimRequest(0.0, 300, 3, tokens=same), SimRequest(5.0, 300, 3, tokens=same)]
    sim = Sim(twice, ClusterSpec(1, 1), COST, choose=choose)
    sim.run()
    assert [a[0] for a in asked] == [300, 12]
    assert sim.routes[Route.REMOTE] == 1 and sim.routes[Route.LOCAL] == 1


def test_threshold_grid_is_the_prompt_quartiles_and_longest_in_blocks() -> None:
    reqs = [SimRequest(0.0, n, 2) for n in (10, 20, 30, 40, 50, 60, 70, 90)]
    assert threshold_grid(reqs, 16) == [32, 64, 80, 96]  # 30, 50, 70, 90 rounded up to blocks
    assert threshold_grid([], 16) == []


def test_planner_recommends_the_mode_with_the_highest_predicted_goodput() -> None:
    # short turns beside a long prompt every 0.8 s: colocated, the long prompts' chunks stall
    # the short ones' decode steps (TPOT); disaggregated, short prompts queue behind long ones
    # on the prefill worker (TTFT); hybrid prefills the short ones on the decode worker
    reqs = [SimRequest(0.1 * i, 600 if i % 8 == 0 else 16, 16) for i in range(60)]
    base = ClusterSpec(1, 1, max_num_seqs=16)
    alts = alternatives(base, 2, 1, 1, (256,), 1024, hybrid_thresholds=(32,))
    rows = plan_alternatives(reqs, lambda t: COST, alts, slo_ttft_s=0.7, slo_tpot_s=0.03)
    modes = best_by_mode(rows)
    assert set(modes) == {"colocated", "disagg", "hybrid"}
    assert rows[0] is modes["hybrid"] and rows[0].hybrid_threshold == 32
    assert modes["hybrid"].attainment > modes["disagg"].attainment > modes["colocated"].attainment


def test_prefix_groups_hit_the_simulated_prefix_cache() -> None:
    """`to_sim` gives a prefix group's requests token ids: the engine's prefix cache hits, so
    TTFT drops against the same lengths with private prompts."""
    sim_reqs = to_sim(requests("prefix", 40, 2.0, 1024, 0, None))
    assert all(r.tokens for r in sim_reqs)
    private = [replace(r, tokens=()) for r in sim_reqs]
    spec = ClusterSpec(0, 0, colocated=1)

    def p50(reqs: list[SimRequest]) -> float:
        ttfts = sorted(o.ttft_s for o in Sim(reqs, spec, COST).run() if o.ttft_s is not None)
        return ttfts[len(ttfts) // 2]

    assert p50(sim_reqs) < 0.5 * p50(private)


def test_prefix_aware_policy_sees_each_workers_cache_through_its_pool() -> None:
    """The router's real `prefix_aware` keeps each prefix group on the worker that caches it
    (matches read from the simulated pools); `least_load` spreads them."""
    specs = requests("prefix", 40, 4.0, 1024, 0, None)
    reqs = to_sim(specs)

    def workers_per_group(policy: str, spec: ClusterSpec) -> list[int]:
        sim = Sim(reqs, spec, COST, policy=policy)
        where: dict[str, int] = {}

        def on_step(w: Worker, step: Step) -> None:
            if w.kind != "decode":
                assert step.out is not None
                for item in step.out.items:
                    where.setdefault(item.request_id, w.index)

        sim.on_step = on_step
        assert all(o.ok for o in sim.run())
        groups: dict[int | None, set[int]] = {}
        for i, s in enumerate(specs):
            groups.setdefault(s.prefix_group, set()).add(where[f"r{i}"])
        return sorted(len(v) for v in groups.values())

    for spec in (ClusterSpec(0, 0, colocated=2), ClusterSpec(2, 1)):
        assert set(workers_per_group("prefix_aware", spec)) == {1}
        assert max(workers_per_group("least_load", spec)) == 2


def test_the_simulated_path_decision_is_the_routers_rule() -> None:
    """`hybrid_rule` is `router.hybrid.choose_prefill_path`: the load rules apply too, and a
    bench cluster's `[router.hybrid]` threshold reaches the simulated cluster."""
    from router.hybrid import HybridConfig
    from tooling.planner.sim_routing import hybrid_rule, threshold_rule
    from tooling.planner.validate import spec_of

    rule = hybrid_rule(
        HybridConfig(
            local_prefill_max_tokens=64, prefill_queue_max_tokens=1000, decode_queue_max_tokens=500
        )
    )
    assert rule(64, 0, 0, 0) == "local" and rule(65, 0, 0, 0) == "remote"
    assert rule(400, 1001, 0, 0) == "local"  # the prefill worker is busy
    assert rule(64, 0, 437, 0) == "remote"  # the decode worker is busy
    assert rule(64, 0, 0, 1) == "remote"  # ... decoding: the idle prefill worker takes it
    assert threshold_rule(0)(1, 0, 0, 0) == "remote"
    cluster = {
        "mode": "disagg",
        "torch_threads": 1,
        "workers": {"prefill": 1, "decode": 1, "colocated": 0},
        "engine": {
            "max_num_batched_tokens": 256,
            "max_num_seqs": 8,
            "num_kv_blocks": 64,
            "block_size": 16,
            "enable_chunked_prefill": True,
        },
        "router": {"max_inflight": 8, "max_queued": 8, "hybrid": {"local_prefill_max_tokens": 96}},
    }
    assert spec_of(cluster)[0].hybrid_threshold == 96
    cluster["router"] = {"max_inflight": 8, "max_queued": 8}
    assert spec_of(cluster)[0].hybrid_threshold is None


def test_a_local_prefill_moves_the_policys_cache_credit_to_the_decode_worker() -> None:
    """As `router.flow` does, the simulator calls `prefilled_elsewhere` after a local choice:
    `prefix_aware`'s pending credit for the prompt's blocks leaves the prefill worker it picked
    and lands on the decode worker, so the next request with that prefix follows it there."""
    from router.prefix_policy import PrefixAwarePolicy

    prompt = (7,) * 16  # four full blocks of 4
    spec = ClusterSpec(1, 1, block_size=4, hybrid_threshold=64)
    reqs = [SimRequest(0.0, 16, 4, prompt)]
    sim = Sim(reqs, spec, COST, policy="prefix_aware")
    policy = sim.policy
    assert isinstance(policy, PrefixAwarePolicy)
    sim.run_until(0.0)  # the request arrives and is routed
    (p,) = sim.role("prefill")
    (d,) = sim.role("decode")
    assert sim.routes[Route.LOCAL] == 1
    assert policy.pending.credited(f"w{p.index}") == 0
    assert policy.pending.credited(f"w{d.index}") > 0
    # the remote path keeps the credit on the prefill worker
    sim = Sim(reqs, replace(spec, hybrid_threshold=0), COST, policy="prefix_aware")
    sim.run_until(0.0)
    policy = sim.policy
    assert isinstance(policy, PrefixAwarePolicy)
    assert sim.routes[Route.REMOTE] == 1
    assert policy.pending.credited(f"w{sim.role('prefill')[0].index}") > 0
    assert policy.pending.credited(f"w{sim.role('decode')[0].index}") == 0


def test_the_max_rate_is_the_median_over_the_trace_seeds() -> None:
    """Three request makers (trace seeds) whose prompts differ in length: each alone gives a
    different max rate, and the row keeps the middle one."""
    alt = Alternative(ClusterSpec(1, 1), threads=1)

    def maker(prompt: int) -> Callable[[float], list[SimRequest]]:
        return lambda rate: [SimRequest(i / rate, prompt, 8) for i in range(30)]

    makers = [maker(n) for n in (400, 50, 200)]
    alone = [
        plan_alternatives(m(1.0), lambda t: COST, [alt], 0.7, 0.03, rate_search=[m])[0].max_rate
        for m in makers
    ]
    assert len(set(alone)) == 3  # the seeds disagree: the median is a real choice
    (row,) = plan_alternatives(makers[0](1.0), lambda t: COST, [alt], 0.7, 0.03, rate_search=makers)
    assert row.max_rate == sorted(alone)[1]
