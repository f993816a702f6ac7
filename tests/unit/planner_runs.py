"""Saved `pdserve bench` folders whose latencies come from the simulator, for the tests of
`plan --validate` and `--fit-contention`: replayed with the costs that made them, they must be
predicted exactly."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from deploy.plan_cli import add_plan_parser
from tooling.goodput.records import RequestRecord, RunResult
from tooling.planner.sim_types import SimOutcome, SimRequest


def cluster_json(
    mode: str, prefill: int, decode: int, colocated: int, threads: int
) -> dict[str, Any]:
    """A bench configuration's effective cluster JSON with the engine and router limits the
    simulator's defaults use."""
    return {
        "mode": mode,
        "workers": {"prefill": prefill, "decode": decode, "colocated": colocated},
        "torch_threads": threads,
        "engine": {
            "max_num_batched_tokens": 256,
            "max_num_seqs": 32,
            "num_kv_blocks": 1024,
            "block_size": 16,
            "enable_chunked_prefill": True,
        },
        "router": {"max_inflight": 64, "max_queued": 256},
    }


def simulated_bench(
    path: Path,
    reqs: list[SimRequest],
    outs: list[SimOutcome],
    config: str,
    cluster: dict[str, Any],
    rate: float,
    slo_ms: tuple[float, float],
    output_len: int,
    **meta: Any,
) -> Path:
    """Write `path`/results.json: one run of configuration `config` (its effective cluster
    JSON `cluster`) at `rate` whose records are `outs`, the simulation of `reqs`; SLOs
    (TTFT, TPOT) in ms; `meta`: more bench metadata (e.g. `unloaded`)."""
    records = []
    for i, (r, o) in enumerate(zip(reqs, outs, strict=True)):
        assert o.ok and o.ttft_s is not None and o.end_s is not None
        records.append(
            RequestRecord(
                index=i,
                request_id=f"r{i}",
                scheduled_s=r.arrival_s,
                sent_s=r.arrival_s,
                input_len=r.input_len,
                output_len=r.output_len,
                num_tokens=r.output_len,
                ttft_ms=o.ttft_s * 1e3,
                tpot_ms=(o.tpot_s or 0) * 1e3,
                e2e_ms=(o.end_s - r.arrival_s) * 1e3,
            )
        )
    run = RunResult(config, rate, "poisson", 0, 0, records, 5.0, 0.0, 0.0)
    doc = {
        "config": {"workload": "chat", "trace": None, "output_len": output_len},
        "context": 512,
        "slo": {"ttft_ms": slo_ms[0], "tpot_ms": slo_ms[1]},
        "clusters": {config: {"config": cluster}},
        **meta,
    }
    path.mkdir(parents=True)
    (path / "results.json").write_text(json.dumps({"meta": doc, "runs": [run.to_json()]}))
    return path


def plan_cli(*argv: str) -> int:
    """Run `pdserve plan` with `argv` in this process; its exit code."""
    p = argparse.ArgumentParser()
    add_plan_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["plan", *argv])
    return int(args.func(args))
