"""Overload: a burst of N x the cluster's capacity at once. How fast is the excess refused, and
do the admitted requests keep their SLOs?

Runs as its own process: ``python -m benchmarks.bench_overload [--topology 1p1d] [--factor 5]
[--repeats 3] [--out runs/bench/overload]`` from the repository root. The cluster is started with
the product launcher (`deploy.launcher.launch_local_cluster`: worker processes on the tiny random
model and a router process); this process is the client, on its own event loop.

Capacity = what the router admits at once: `max_inflight` running + `max_queued` waiting
(`--max-inflight`, `--max-queued`). Each repeat runs, back to back:

1. at capacity: exactly `capacity` requests at once (none should be refused); their p90 TTFT
   and TPOT, times `--slo-slack` (1.5), are the SLOs unless `--ttft-slo-ms` / `--tpot-slo-ms`
   set them: "what the cluster gives a full admission window";
2. overload: `factor x capacity` requests at once. Reported: how many were admitted (OK) and
   refused (RESOURCE_EXHAUSTED) and anything else; the refusal latency (client-side, from the
   call to the status) p50/p99/max; the admitted requests' TTFT/TPOT and SLO attainment.

Targets (issue 20): refusal p99 <= 50 ms; admitted attainment >= 90 %. Output: a table on
stderr and JSON (`--out DIR/overload.json`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from deploy.config import load_cluster_config
from deploy.launcher import launch_local_cluster
from proto.pdserve.v1 import inference_pb2, inference_pb2_grpc

REJECT_P99_TARGET_MS = 50.0
ATTAINMENT_TARGET = 0.9


@dataclass
class Call:
    code: str
    latency_ms: float  # call -> status (or last message)
    ttft_ms: float | None
    tpot_ms: float | None


def _q(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


async def _one(stub: Any, req: inference_pb2.GenerateRequest) -> Call:
    t0 = time.perf_counter()
    first = last = None
    n = 0
    try:
        async for resp in stub.Generate(req, timeout=120.0):
            now = time.perf_counter()
            if resp.token_ids:
                first = first or now
                last = now
                n += len(resp.token_ids)
        code = "OK"
    except grpc.aio.AioRpcError as exc:
        code = exc.code().name
    end = time.perf_counter()
    ttft = None if first is None else (first - t0) * 1e3
    tpot = None if first is None or last is None or n < 2 else (last - first) * 1e3 / (n - 1)
    return Call(code, (end - t0) * 1e3, ttft, tpot)


async def _burst(
    stubs: list[Any], n: int, prompt_len: int, max_tokens: int, tag: str
) -> list[Call]:
    reqs = [
        inference_pb2.GenerateRequest(
            request_id=f"{tag}-{i}",
            token_ids=inference_pb2.TokenIds(
                ids=[4 + (i * 31 + k * 7) % 1000 for k in range(prompt_len)]
            ),
            sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        for i in range(n)
    ]
    return list(await asyncio.gather(*(_one(stubs[i % len(stubs)], r) for i, r in enumerate(reqs))))


def _stats(calls: list[Call], ttft_slo: float | None, tpot_slo: float | None) -> dict[str, Any]:
    ok = [c for c in calls if c.code == "OK"]
    shed = [c.latency_ms for c in calls if c.code == "RESOURCE_EXHAUSTED"]
    codes: dict[str, int] = {}
    for c in calls:
        codes[c.code] = codes.get(c.code, 0) + 1
    out: dict[str, Any] = {
        "sent": len(calls),
        "codes": codes,
        "reject_ms": {"p50": _q(shed, 0.5), "p99": _q(shed, 0.99), "max": max(shed, default=None)},
        "ttft_ms": {"p50": _q([c.ttft_ms for c in ok if c.ttft_ms], 0.5),
                    "p90": _q([c.ttft_ms for c in ok if c.ttft_ms], 0.9)},
        "tpot_ms": {"p50": _q([c.tpot_ms for c in ok if c.tpot_ms], 0.5),
                    "p90": _q([c.tpot_ms for c in ok if c.tpot_ms], 0.9)},
    }  # fmt: skip
    if ttft_slo is not None and tpot_slo is not None and ok:
        met = [
            c for c in ok
            if (c.ttft_ms or 1e9) <= ttft_slo and (c.tpot_ms is None or c.tpot_ms <= tpot_slo)
        ]  # fmt: skip
        out["attainment"] = len(met) / len(ok)
    return out


async def _run(args: argparse.Namespace, address: str) -> dict[str, Any]:
    capacity = args.max_inflight + args.max_queued
    chans = [grpc.aio.insecure_channel(address, [("grpc.enable_http_proxy", 0)]) for _ in range(8)]
    stubs = [inference_pb2_grpc.InferenceStub(c) for c in chans]  # type: ignore[no-untyped-call]
    try:
        await _burst(stubs, 4, args.prompt_len, args.max_tokens, "warm")
        repeats = []
        for rep in range(args.repeats):
            at_cap = await _burst(stubs, capacity, args.prompt_len, args.max_tokens, f"cap{rep}")
            cap = _stats(at_cap, None, None)
            ttft_slo = args.ttft_slo_ms or args.slo_slack * (cap["ttft_ms"]["p90"] or 0)
            tpot_slo = args.tpot_slo_ms or args.slo_slack * (cap["tpot_ms"]["p90"] or 0)
            n = args.factor * capacity
            over = await _burst(stubs, n, args.prompt_len, args.max_tokens, f"over{rep}")
            stats = _stats(over, ttft_slo, tpot_slo)
            repeats.append({"at_capacity": cap, "overload": stats,
                            "slo_ms": {"ttft": ttft_slo, "tpot": tpot_slo}})  # fmt: skip
            r = stats["reject_ms"]
            print(
                f"repeat {rep}: {n} at once -> {stats['codes']}; reject p50 {r['p50']:.1f} ms "
                f"p99 {r['p99']:.1f} ms; admitted attainment {stats.get('attainment', 0):.1%} "
                f"(SLO TTFT {ttft_slo:.0f} ms, TPOT {tpot_slo:.1f} ms)",
                file=sys.stderr,
            )
        return {"repeats": repeats}
    finally:
        for c in chans:
            await c.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: a fresh tiny random model)")
    p.add_argument("--topology", default="1p1d", choices=["1p1d", "2p2d"])
    p.add_argument("--max-inflight", type=int, default=16)
    p.add_argument("--max-queued", type=int, default=16)
    p.add_argument("--factor", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--slo-slack", type=float, default=1.5)
    p.add_argument("--ttft-slo-ms", type=float)
    p.add_argument("--tpot-slo-ms", type=float)
    p.add_argument("--out", default="runs/bench/overload")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else None
    if model is None:
        from tooling.models.random_model import make_random_model

        model = make_random_model(Path(tempfile.mkdtemp(prefix="overload-")), "tiny")
    n = int(args.topology[0])
    config = load_cluster_config(None, {
        "model": str(model), "mode": "disagg", "launcher": "process",
        "workers.prefill": n, "workers.decode": n,
        "router.max_inflight": args.max_inflight, "router.max_queued": args.max_queued,
        "router.port": 0, "engine": {"block_size": 16, "num_kv_blocks": 1024},
    })  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="overload-logs-") as logs:
        cluster = launch_local_cluster(config, logs, port=0)
        try:
            result = asyncio.run(_run(args, cluster.address))
        finally:
            cluster.stop()
    reps = result["repeats"]
    p99 = [r["overload"]["reject_ms"]["p99"] for r in reps if r["overload"]["reject_ms"]["p99"]]
    att = [r["overload"].get("attainment", 0.0) for r in reps]
    result |= {
        "args": vars(args),
        "capacity": args.max_inflight + args.max_queued,
        "reject_p99_ms_worst": max(p99, default=None),
        "attainment_worst": min(att, default=None),
        "targets": {"reject_p99_ms": REJECT_P99_TARGET_MS, "attainment": ATTAINMENT_TARGET},
    }
    result["meets_targets"] = bool(
        p99 and max(p99) <= REJECT_P99_TARGET_MS and min(att) >= ATTAINMENT_TARGET
    )
    (out / "overload.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps({k: result[k] for k in ("capacity", "reject_p99_ms_worst",
                                             "attainment_worst", "meets_targets")}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
