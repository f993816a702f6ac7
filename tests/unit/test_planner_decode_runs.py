"""The simulator's decode clock (`sim_engine`, `DecodeClock`) changes nothing it
predicts: on small scenarios — disaggregated with reservations, colocated under KV pressure
(preemptions), shared prefixes with the prefix-aware policy and hybrid routing, CPU sharing, a
drain that times out — every request's outcome (ok, TTFT, TPOT, end), the attainment and the
tokens are the same as with every step applied one by one. Pure, a few seconds."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from model_runtime.decode_clock import DecodeClock
from model_runtime.request import RequestOutput
from tooling.planner.costs import CostModel, Linear
from tooling.planner.sim import ClusterSpec, Sim, SimOutcome, SimRequest, attainment

COST = CostModel(
    prefill=Linear((0.004, 0.0002, 1e-8)),
    decode=Linear((0.006, 0.0004, 1e-6)),
    transfer=Linear((0.002, 1e-6)),
    ttft_overhead=Linear((0.001, 1e-6)),
    host_request_s=0.001,
    host_token_s=1e-4,
    decode_token_cpu_s=5e-5,
    prefill_request_s=5e-4,
)


def _requests(n: int, rate: float, seed: int, shared: bool = False) -> list[SimRequest]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(rate)
        length = rng.randint(8, 120)
        tokens: tuple[int, ...] = ()
        if shared:
            head = (1 + i % 3,) * 32
            tokens = head + tuple(100 + i for _ in range(length))
            length = len(tokens)
        out.append(SimRequest(t, length, rng.randint(1, 90), tokens))
    return out


def _run(
    reqs: list[SimRequest], spec: ClusterSpec, fast: bool, policy: str = "least_load"
) -> tuple[list[SimOutcome], int, dict[str, float]]:
    sim = Sim(reqs, spec, COST, policy=policy, fast=fast)
    outs = sim.run()
    return outs, sim.tokens, dict(sim.step_core_s)


BASE = ClusterSpec(
    prefill=1,
    decode=2,
    chunk_tokens=64,
    max_num_seqs=8,
    num_kv_blocks=200,
    block_size=4,
    max_inflight=40,
)

SCENARIOS = {
    "disagg": (BASE, False, "least_load"),
    "disagg-kv-pressure": (replace(BASE, num_kv_blocks=90), False, "least_load"),
    "colocated-preemption": (
        replace(BASE, prefill=0, decode=0, colocated=2, num_kv_blocks=60),
        False,
        "least_load",
    ),
    "colocated-whole-prompts": (
        replace(BASE, prefill=0, decode=0, colocated=2, chunk_tokens=256, chunked=False),
        False,
        "least_load",
    ),
    "hybrid-prefix": (replace(BASE, hybrid_threshold=60), True, "prefix_aware"),
    "cpu-sharing": (replace(BASE, cores=2.0, threads=1.0), False, "least_load"),
}


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the steps a `DecodeClock` applied (the fast path was taken)."""
    calls = [0]
    real = DecodeClock.end_step

    def end_step(self: DecodeClock) -> list[RequestOutput]:
        calls[0] += 1
        return real(self)

    monkeypatch.setattr(DecodeClock, "end_step", end_step)
    return calls


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_decode_runs_give_the_step_by_step_results(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, shared, policy = SCENARIOS[name]
    reqs = _requests(80, 30.0, seed=len(name), shared=shared)
    calls = _counting(monkeypatch)
    slow = _run(reqs, spec, fast=False, policy=policy)
    assert calls[0] == 0
    fast = _run(reqs, spec, fast=True, policy=policy)
    assert calls[0] > 100  # decode steps applied by the clock
    assert fast[0] == slow[0]  # every outcome: ok, TTFT, TPOT, end, to the bit
    assert fast[1:] == slow[1:]
    assert attainment(fast[0], 0.2, 0.03) == attainment(slow[0], 0.2, 0.03)
    assert sum(o.ok for o in slow[0]) > 20  # the scenario served requests


def test_a_drain_that_times_out_aborts_the_same_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _counting(monkeypatch)
    reqs = _requests(60, 40.0, seed=7)
    results = []
    for fast in (False, True):
        sim = Sim(reqs, replace(BASE, decode=2), COST, drain_timeout_s=0.05, fast=fast)
        sim.run_until(0.6)
        sim.flipped.clear()
        sim.switch(sim.role("decode")[0], "prefill")
        outs = sim.run()
        results.append((outs, sim.tokens, sim.aborted))
    assert results[0][2] >= 1  # the drain timed out with requests left
    assert results[0] == results[1]
    assert calls[0] > 0
