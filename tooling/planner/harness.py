"""Real-run harness of the ratio benchmark: one local cluster, ratios set in place, a load
generator that reports each request as it ends, and the controller as a sidecar.

Runs in the benchmark process (`benchmarks/bench_ratio.py`, the ratio integration test).

- `start_cluster(...)`: N workers + one router, local processes, started by the launch
  function it is given (`tooling.launch`; deploy's `tool_launchers.launch_cluster`); the
  router is its own process, as in production.
- `Sidecar`: a `WorkerPool` of this process over the same workers (its own status poll), used
  to read worker views, to `set_ratio` between runs (Worker.SetRole: the same processes and
  weights serve every configuration) and to run a `RatioController` *beside* the router: the
  controller sees the pool's views and this load generator's per-request outcomes, and acts
  through a `PoolActuator`. The router's own pool learns each new role at its next poll.
- `send_all(...)`: sends `RequestSpec`s at their times over the public API (greedy,
  `ignore_eos`, exact lengths: the goodput bench's `build_requests`), timestamps every token
  on the client, and calls `on_end(record)` as each request ends; returns the records and the
  run's duration (t = 0 to the last end).
- `phase_summary(...)`: attainment and goodput of a run, overall and per workload phase;
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from proto.pdserve.v1 import inference_pb2_grpc
from router.policy import Role
from router.pool import WorkerPool
from router.ratio.actuator import PoolActuator
from router.registry import InMemoryWorkerRegistry
from security.channels import InternalAuth
from tooling.goodput.analysis import SLO, attainment
from tooling.goodput.loadgen import CHANNEL_OPTIONS, LoadJob, build_requests, consume_stream
from tooling.goodput.records import RequestRecord, RequestSpec
from tooling.launch import C, Cluster, LaunchCluster
from tooling.planner.workload import Phase, phase_starts


def start_cluster(
    model: Path,
    workers: int,
    engine: dict[str, Any],
    threads: int,
    log_dir: Path,
    launch: LaunchCluster[C],
    mode: str = "disagg",
) -> C:
    """A running cluster of `workers` workers, started by `launch`: disagg (half prefill,
    rounded down, at start) or colocated; `threads` torch threads each."""
    prefill = max(1, workers // 2)
    roles: dict[str, Any] = {
        "mode": "disagg",
        "workers.prefill": prefill,
        "workers.decode": workers - prefill,
    }
    if mode == "colocated":
        roles = {"mode": "colocated", "workers.prefill": 0, "workers.decode": 0}
        roles["workers.colocated"] = workers
    overrides = {
        "model": str(model),
        **roles,
        "launcher": "process",
        "torch_threads": threads,
        "router.port": 0,
        "router.status_poll_interval_s": 0.25,
        "engine": engine,
    }
    log_dir.mkdir(parents=True, exist_ok=True)
    return launch(overrides, log_dir)


def cluster_pids(cluster: Cluster) -> dict[str, int]:
    """{label: pid} of a cluster's processes and this one ("client": the load generator and
    the sidecar): "router", and each worker by its launch id."""
    return {**cluster.labelled_pids(), "client": os.getpid()}


class Sidecar:
    """This process's own pool over the cluster's workers (module docstring); `internal`:
    the cluster's worker credentials (`ProcessWorkers.internal`)."""

    def __init__(
        self, roles: dict[str, Role], poll_s: float = 0.25, internal: InternalAuth | None = None
    ) -> None:
        self.initial = dict(roles)
        registry = InMemoryWorkerRegistry(ttl_s=10.0)
        self.pool = WorkerPool(registry, poll_s, 1.0, internal=internal)
        self.actuator = PoolActuator(self.pool)

    async def start(self) -> None:
        for address, role in self.initial.items():
            await self.pool.add(address, role)
        await self.pool.start()

    async def stop(self) -> None:
        await self.pool.stop()

    def roles(self) -> dict[str, str]:
        return {v.address: v.role for v in self.pool.views()}

    async def set_ratio(self, prefill: int, drain_timeout_s: float = 30.0) -> None:
        """Make the first `prefill` workers (by address) prefill and the rest decode."""
        addresses = sorted(self.initial)
        want = {a: ("prefill" if i < prefill else "decode") for i, a in enumerate(addresses)}
        now = self.roles()
        await asyncio.gather(
            *(
                self.actuator.switch_role(a, want[a], drain_timeout_s)  # type: ignore[arg-type]
                for a in addresses
                if now.get(a) != want[a]
            )
        )
        assert self.roles() == want, (self.roles(), want)


async def send_all(
    address: str,
    specs: Sequence[RequestSpec],
    vocab_size: int,
    token_seed: int,
    label: str,
    on_end: Callable[[RequestRecord], None] | None = None,
    timeout_s: float = 120.0,
    channels: int = 4,
) -> tuple[list[RequestRecord], float]:
    """Send every spec at its time; (records in spec order, duration s). Module docstring."""
    job = LoadJob(address=address, specs=list(specs), token_seed=token_seed, label=label)
    reqs = build_requests(job, vocab_size)
    chans = [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in range(channels)]
    stubs = [inference_pb2_grpc.InferenceStub(c) for c in chans]  # type: ignore[no-untyped-call]
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.05
    records: list[RequestRecord] = []
    tasks = []

    async def one(i: int, rec: RequestRecord) -> None:
        t_sent = loop.time()
        rec.sent_s = t_sent - t0
        call = stubs[i % channels].Generate(reqs[i], timeout=timeout_s)
        await consume_stream(call, rec, t_sent, loop)
        if on_end is not None:
            on_end(rec)

    try:
        for i, spec in enumerate(specs):
            delay = t0 + spec.arrival_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = RequestRecord(
                index=spec.index,
                request_id=reqs[i].request_id,
                scheduled_s=spec.arrival_s,
                sent_s=0.0,
                input_len=spec.input_len,
                output_len=spec.output_len,
            )
            records.append(rec)
            tasks.append(asyncio.create_task(one(i, rec)))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        for c in chans:
            with contextlib.suppress(Exception):
                await c.close()
    duration = max((r.end_s for r in records), default=0.0)
    return records, duration


async def wait_quiet(max_load: float, max_wait_s: float) -> float:
    """Wait (up to `max_wait_s`) until the 1-minute load average is <= `max_load`; return it."""
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        await asyncio.sleep(5.0)
    return os.getloadavg()[0]


def phase_summary(
    records: list[RequestRecord], duration: float, slo: SLO, phases: list[Phase]
) -> dict[str, Any]:
    """Overall and per-phase attainment (a request's phase: its scheduled arrival) and the
    run's goodput (requests meeting both SLOs / duration)."""
    att = attainment(records, slo)
    out: dict[str, Any] = {
        "requests": att.n,
        "errors": att.errors,
        "attainment": att.both,
        "ttft_attainment": att.ttft,
        "tpot_attainment": att.tpot,
        "good": att.good,
        "duration_s": duration,
        "goodput_rps": att.good / duration if duration > 0 else 0.0,
        "phases": [],
    }
    for (start, name), (_, _, length) in zip(phase_starts(phases), phases, strict=True):
        sub = [r for r in records if start <= r.scheduled_s < start + length]
        a = attainment(sub, slo)
        out["phases"].append(
            {"phase": name, "requests": a.n, "attainment": a.both, "ttft": a.ttft, "tpot": a.tpot}
        )
    return out


def meets_both(record: dict[str, Any], slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    """Whether a saved `RequestRecord` (JSON) met both SLOs."""
    r = RequestRecord.from_json(record)
    if not r.ok or r.ttft_ms is None:
        return False
    return r.ttft_ms <= slo_ttft_ms and (r.tpot_ms is None or r.tpot_ms <= slo_tpot_ms)
