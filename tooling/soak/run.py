"""`run_soak(config)`: one whole soak. Runs in the soak process (`pdserve soak`).

Steps:

1. plan (seeded: requests, bursts, probes, faults; `workload.make_plan`);
2. reference and cluster, side by side: the colocated engine runs every distinct request in
   this process (a thread) while the cluster starts (`cluster.SoakCluster`: redis-server,
   launcher, in-process router); then stop strings are cut from the references' own text
   (`workload.with_stop_strings`) and every worker's free blocks are read (the baseline);
3. load and faults together: `client.run_load` sends the plan open-loop while
   `faults.Injector` carries out the faults; both end (the load when every request ended);
4. quiesce and check (`check`): killed workers back, a few extra requests if a restarted worker
   served nothing yet, verdicts, every failure explained (`blast`), leaks, the router's
   in-flight counts, stale Redis entries;
5. write soak.json, requests.jsonl, report.md, timeline.png (`report`), stop the cluster.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from model_runtime.config import ModelConfig
from tooling.launch import LaunchWorkers
from tooling.soak.blast import classify
from tooling.soak.check import (
    Verdict,
    judge,
    judge_oversized,
    leaked_blocks,
    router_in_flight,
    served_after_rejoin,
    stale_index_entries,
    wait_rejoined,
)
from tooling.soak.client import Outcome, run_load
from tooling.soak.cluster import SoakCluster
from tooling.soak.config import SoakConfig
from tooling.soak.faults import FaultRecord, Injector
from tooling.soak.reference import Reference
from tooling.soak.report import summarize, write_outputs
from tooling.soak.workload import PlannedRequest, make_plan, with_stop_strings

log = logging.getLogger(__name__)
START_LEAD_S = 0.5
CHECK_ROUNDS = 3
CHECK_BATCH = 8


@dataclass(frozen=True)
class SoakResult:
    summary: dict[str, Any]
    report: str

    @property
    def passed(self) -> bool:
        return bool(self.summary["passed"])


def run_soak(config: SoakConfig, launch: LaunchWorkers) -> SoakResult:
    """Run one soak (see the module docstring) on workers started by `launch`
    (`tooling.launch`); never raises for what the soak finds."""
    return asyncio.run(run_soak_async(config, launch))


def _progress(msg: str) -> None:
    log.warning("soak: %s", msg)


async def run_soak_async(config: SoakConfig, launch: LaunchWorkers) -> SoakResult:
    t_start = time.monotonic()
    vocab = ModelConfig.from_model_dir(config.model).vocab_size
    plan = make_plan(config, vocab)
    _progress(f"{len(plan.requests)} requests, {len(plan.faults)} faults planned")
    ref = Reference(config.model)
    cluster = SoakCluster(config, launch)
    injector: Injector | None = None
    try:
        # the reference computes (torch, GIL released) while the workers load
        with_prompt = [r for r in plan.requests if r.kind != "oversized"]
        await asyncio.gather(asyncio.to_thread(ref.run, with_prompt), cluster.start())
        texts = {r.index: ref.expected(r).full_text for r in plan.requests if r.stop_at is not None}
        plan = with_stop_strings(plan, texts)
        _progress(f"reference and cluster ready after {time.monotonic() - t_start:.0f} s")
        baseline = {}
        for w in cluster.refs():
            st = await cluster.status(w.address, timeout_s=5.0)
            assert st is not None, f"worker {w.worker_id} does not answer GetStatus at start"
            baseline[w.worker_id] = st.free_blocks
        _progress(f"cluster up at {cluster.address}: {baseline}")
        t0 = time.monotonic() + START_LEAD_S
        injector = Injector(cluster, plan.faults, t0, config.seed)
        faults = asyncio.create_task(injector.run(), name="soak-faults")
        outcomes = await run_load(
            cluster.address,
            plan.requests,
            config.default_timeout_s,
            config.hang_grace_s,
            injector.on_sent,
            t0,
            http=cluster.http_front,
            oversized_mb=config.oversized_mb,
            router_admits=(config.max_inflight, config.max_queued),
        )
        _progress(f"load done after {time.monotonic() - t0:.0f} s; waiting for faults")
        try:
            await asyncio.wait_for(faults, config.quiesce_timeout_s + 120.0)
        except TimeoutError:
            log.error("fault injector still running after the load; cancelled")
        records = injector.records
        for rec in records:  # how each KV stall's probe ended tells whether the stall hit it
            if rec.probe is not None:
                o = outcomes[rec.probe]
                rec.detail += f"; probe ended {o.code} {o.details[:80]!r}"
        not_rejoined = await wait_rejoined(records, config.quiesce_timeout_s)
        requests = list(plan.requests)
        verdicts = [
            judge_oversized(r, o)
            if r.kind == "oversized"
            else judge(r, o, ref.expected(r), ref, config.hang_grace_s, config.stall_budget_s)
            for r, o in zip(requests, outcomes, strict=True)
        ]
        extra = await _serve_checks(
            cluster, config, t0, (requests, outcomes, verdicts), records, ref
        )
        # where the router placed each request, then: is every failure explained?
        ids = {w.address: w.worker_id for w in cluster.refs()}
        for r, o in zip(requests, outcomes, strict=True):
            o.workers = [ids.get(a, a) for a in cluster.placements.get(r.request_id, ())]
        roles = {w.worker_id: w.role for w in cluster.refs()}
        verdicts = classify(requests, outcomes, verdicts, records, roles)
        _progress("checking the cluster")
        checks = {
            "leaks_by_worker": await leaked_blocks(cluster, baseline, config.quiesce_timeout_s),
            "router_in_flight": await router_in_flight(cluster, config.quiesce_timeout_s),
            "stale_index_entries": await stale_index_entries(
                cluster, records, config.index_ttl_s, time.monotonic() - t0
            ),
            "not_rejoined": not_rejoined,
            "not_serving_after_rejoin": served_after_rejoin(records, outcomes, verdicts),
            "serve_check_requests": extra,
        }
    finally:
        if injector is not None:
            await injector.cancel()
        await cluster.stop()
    summary = summarize(
        config.model_dump(mode="json"),
        config.seed,
        verdicts,
        outcomes,
        records,
        checks,
        time.monotonic() - t_start,
    )
    report = write_outputs(config.out, summary, requests, outcomes, verdicts)
    return SoakResult(summary, str(report))


async def _serve_checks(
    cluster: SoakCluster,
    config: SoakConfig,
    t0: float,
    lists: tuple[list[PlannedRequest], list[Outcome], list[Verdict]],
    records: list[FaultRecord],
    ref: Reference,
) -> int:
    """While a restarted worker has served no exact request since it rejoined, send rounds of
    `CHECK_BATCH` concurrent plain greedy requests (copies of planned ones, so their
    references exist); they join `lists` (requests, outcomes, verdicts). Returns how many."""
    requests, outcomes, verdicts = lists
    plain = [
        r
        for r in requests
        if r.kind == "greedy" and r.timeout_s is None and r.cancel_after_s is None
        and r.cancel_after_tokens is None and not r.stop
    ]  # fmt: skip
    sent = 0
    for _ in range(CHECK_ROUNDS):
        if not served_after_rejoin(records, outcomes, verdicts) or not plain:
            break
        now = time.monotonic() - t0
        batch = [
            replace(plain[(sent + k) % len(plain)], index=len(requests) + k, at_s=now)
            for k in range(CHECK_BATCH)
        ]
        got = await run_load(
            cluster.address, batch, config.default_timeout_s, config.hang_grace_s, t0=t0
        )
        for r, o in zip(batch, got, strict=True):
            requests.append(r)
            outcomes.append(o)
            verdicts.append(
                judge(r, o, ref.expected(r), ref, config.hang_grace_s, config.stall_budget_s)
            )
        sent += len(batch)
    return sent
