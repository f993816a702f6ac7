"""Prefix-cache-aware routing vs round-robin on a shared-prefix workload, with the oracle.

Runs as its own process from the repository root::

    python -m benchmarks.bench_prefix_routing [--groups 16] [--per-group 16] [--prefix 512]
        [--suffix 64] [--rate 1 | --rate 0 --concurrency 4] [--prefill-blocks 384]
        [--preset small|medium] [--repeats 1] [--out FILE]

One run = for each policy (prefix_aware, round_robin): fresh worker processes (2 prefill +
1 decode, the random `small` benchmark model unless `--model`/`--preset`, CPU, empty prefix
caches), a redis-server on a free loopback port, the router in this process with the Redis
prefix index, then every request of the workload — `groups` x `per-group` prompts, each a group's
shared `prefix` tokens plus its own `suffix` tokens, in one seeded random order — sent by
Poisson arrivals at `--rate` per second (open loop; `--rate 0`: `--concurrency` closed-loop
clients) from a child process. Each prefill worker's KV cache (`--prefill-blocks`) holds about half
the groups' prefixes, so where a group is served matters.

Reported per policy: hit rate (cached prompt tokens / prompt tokens, from each response's
usage), mean and p90 TTFT (client side), failures, the router's prefix-lookup latency p50/p99
(Redis EVALSHA on loopback, as timed by the router around the call, under load; none under
round-robin, whose policy ignores prefixes, so the router skips the lookup) and, after the
run, the same lookups timed back to back on an idle loop. The oracle hit rate is what an
infinite cache shared by every worker would give for the same order. Targets: hit rate >= 90 %
of the oracle, mean TTFT <= 0.5x round-robin, lookup p99 <= 2 ms. Output: a table on stderr,
JSON on stdout (or `--out`). This process stays torch-free (the model is made in a child).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from benchmarks.output import write_json
from benchmarks.prefix_workload import BLOCK, REPO, make_model, oracle_hit_rate, workload
from proto.pdserve.v1 import inference_pb2 as ipb
from proto.pdserve.v1 import inference_pb2_grpc
from router.prefix_index.guard import reusable_chain
from tooling.goodput.records import TIMING_FIELDS


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))] if s else float("nan")


async def one(stub: Any, ids: list[int], max_tokens: int) -> dict[str, Any]:
    req = ipb.GenerateRequest(
        token_ids=ipb.TokenIds(ids=ids),
        sampling=ipb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )
    t0 = time.perf_counter()
    ttft = 0.0
    final = None
    async for r in stub.Generate(req, timeout=300):
        if not ttft and r.token_ids:
            ttft = time.perf_counter() - t0
        if r.HasField("final"):
            final = r.final
    assert final is not None
    return {
        "ttft_ms": ttft * 1e3,
        "parts": {f: getattr(final.timings, f) for f in TIMING_FIELDS},
        "cached": final.usage.cached_tokens,
        "prompt": final.usage.prompt_tokens,
        "prefill_worker": final.prefill_worker,
    }


async def client_loop(
    address: str, prompts: list[list[int]], concurrency: int, max_tokens: int, rate: float
) -> dict[str, Any]:
    """Send `prompts` in order: `concurrency` closed-loop clients, or (`rate` > 0) open loop
    with Poisson arrivals at `rate` requests/s (seeded). Results by index."""
    channel = grpc.aio.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)])
    stub = inference_pb2_grpc.InferenceStub(channel)  # type: ignore[no-untyped-call]
    queue = list(enumerate(prompts))
    results: list[dict[str, Any] | None] = [None] * len(prompts)
    failures: list[str] = []

    done = 0

    async def send(i: int, ids: list[int]) -> None:
        nonlocal done
        try:
            results[i] = await one(stub, ids, max_tokens)
        except grpc.aio.AioRpcError as exc:
            failures.append(f"{exc.code().name}: {exc.details()}")
        done += 1
        if done % 32 == 0 or done == len(prompts):  # progress, on the parent's stderr
            print(f"  {done}/{len(prompts)} requests ended", file=sys.stderr, flush=True)

    async def client() -> None:
        while queue:
            await send(*queue.pop(0))

    async def open_loop() -> None:
        rng = random.Random(1)
        loop = asyncio.get_running_loop()
        t, tasks = loop.time(), []
        for i, ids in queue:
            t += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, t - loop.time()))
            tasks.append(asyncio.create_task(send(i, ids)))
        await asyncio.gather(*tasks)

    try:
        if rate > 0:
            await open_loop()
        else:
            await asyncio.gather(*(client() for _ in range(concurrency)))
    finally:
        await channel.close()
    return {"results": results, "failures": failures}


async def run_client(address: str, prompts: list[list[int]], args: Any) -> dict[str, Any]:
    """`client_loop` in a child process (JSON in and out), so that the router's event loop in
    this process serves only the router."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.bench_prefix_routing", "--client", address,
        "--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens),
        "--rate", str(args.rate),
        cwd=REPO, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, _ = await proc.communicate(json.dumps(prompts).encode())
    if proc.returncode != 0:
        raise RuntimeError(f"client process failed with status {proc.returncode}")
    result: dict[str, Any] = json.loads(stdout)
    return result


def start_workers(model: Path, args: Any) -> list[Any]:
    """2 prefill workers with `prefill_blocks` KV blocks each, 1 decode worker with room for
    every concurrent request; `python -m worker_main` processes, one torch thread each."""
    from worker.process import WorkerProcess

    def argv(role: str, wid: str, blocks: int) -> list[str]:
        engine = json.dumps({"block_size": BLOCK, "num_kv_blocks": blocks})
        idle = ["--sched-idle"] if args.worker_sched_idle else []
        shm = "--kv-shared-memory" if args.kv_shared_memory else "--no-kv-shared-memory"
        return ["--model", str(model), "--role", role, "--worker-id", wid, "--torch-threads",
                "1", "--nice", str(args.worker_nice), "--engine-json", engine,
                "--log-level", "WARNING", shm, *idle]  # fmt: skip

    in_flight = max(args.concurrency, 32 if args.rate > 0 else 0)
    decode_blocks = 2 * in_flight * (args.prefix + args.suffix + args.max_tokens) // BLOCK
    specs = [("prefill", "prefill-0", args.prefill_blocks), ("prefill", "prefill-1",
             args.prefill_blocks), ("decode", "decode-0", max(decode_blocks, 256))]  # fmt: skip
    started: list[Any] = []
    try:
        for role, wid, blocks in specs:
            started.append(WorkerProcess.spawn(argv(role, wid, blocks)))
    except BaseException:
        for w in started:
            w.stop()
        raise
    return started


async def run_policy(
    policy: str, model: Path, redis_url: str, reqs: list[tuple[int, list[int]]], args: Any
) -> dict[str, Any]:
    from deploy.config import load_cluster_config
    from router.app import start_router
    from router.prefix_index.config import RedisIndexConfig
    from router.prefix_policy import PrefixRoutingConfig

    workers = await asyncio.to_thread(start_workers, model, args)
    config = load_cluster_config(None, {"model": str(model), "launcher": "process"})
    addresses = {
        "prefill": [w.address for w in workers[:2]],
        "decode": [w.address for w in workers[2:]],
    }
    weights = {
        k: v
        for k, v in (("cache_weight", args.cache_weight), ("load_weight", args.load_weight))
        if v is not None
    }
    rc = config.router_config(
        addresses,
        port=0,
        policy=policy,
        prefix_index=RedisIndexConfig(url=redis_url, key_prefix=f"bench-{policy}:"),
        prefix_routing=PrefixRoutingConfig(**weights),
    )
    handle = await start_router(rc)
    channel = grpc.aio.insecure_channel(handle.address, options=[("grpc.enable_http_proxy", 0)])
    stub = inference_pb2_grpc.InferenceStub(channel)  # type: ignore[no-untyped-call]
    try:
        while not all(i.resyncs for i in handle.indexers.by_address.values()):
            await asyncio.sleep(0.05)
        warm = [[5 + k, 6 + k, 7 + k] for k in range(4)]  # shorter than a block: caches nothing
        await asyncio.gather(*(one(stub, ids, 2) for ids in warm))
        handle.prefix_index.stats.lookup_latency_ms.clear()
        t0 = time.perf_counter()
        out = await run_client(handle.address, [ids for _, ids in reqs], args)
        wall = time.perf_counter() - t0
        results = {i: r for i, r in enumerate(out["results"]) if r is not None}
        failures = out["failures"]
        in_run = list(handle.prefix_index.stats.lookup_latency_ms)
        idle = []
        for _, ids in reqs[:200]:  # the same chains, back to back, nothing else running
            chain = reusable_chain(ids, BLOCK)
            t = time.perf_counter()
            await handle.prefix_index.lookup(chain)
            idle.append((time.perf_counter() - t) * 1e3)
    finally:
        await channel.close()
        await handle.stop(grace_s=1.0)
        await asyncio.to_thread(lambda: [w.stop() for w in workers])
    ttfts = [r["ttft_ms"] for r in results.values()]
    by_hit = {
        kind: [r for r in results.values() if (r["cached"] > 0) == (kind == "hit")]
        for kind in ("hit", "miss")
    }
    per_group: dict[int, set[str]] = {}
    for i, r in results.items():
        per_group.setdefault(reqs[i][0], set()).add(r["prefill_worker"])
    return {
        "policy": policy,
        "requests": len(results),
        "failures": len(failures),
        "failure_samples": failures[:3],
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "hit_rate": sum(r["cached"] for r in results.values())
        / max(1, sum(r["prompt"] for r in results.values())),
        "ttft_mean_ms": statistics.fmean(ttfts) if ttfts else float("nan"),
        "ttft_p90_ms": quantile(ttfts, 0.9),
        # Where the mean comes from: requests with some cached tokens vs none, each with its
        # count, mean TTFT and mean server-side parts.
        "ttft_by_cache": {
            kind: {
                "requests": len(rs),
                "ttft_mean_ms": statistics.fmean([r["ttft_ms"] for r in rs] or [float("nan")]),
                "parts_mean_ms": {
                    f: statistics.fmean([r["parts"][f] for r in rs] or [float("nan")])
                    for f in TIMING_FIELDS
                },
            }
            for kind, rs in by_hit.items()
        },
        "ttft_parts_mean_ms": {
            f: statistics.fmean([r["parts"][f] for r in results.values()] or [float("nan")])
            for f in TIMING_FIELDS
        },
        "workers_per_group_mean": statistics.fmean([len(s) for s in per_group.values()] or [0]),
        "lookup_in_run_p50_ms": quantile(in_run, 0.5),
        "lookup_in_run_p99_ms": quantile(in_run, 0.99),
        "lookup_idle_p50_ms": quantile(idle, 0.5),
        "lookup_idle_p99_ms": quantile(idle, 0.99),
        "lookups": len(in_run),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from tooling.redis_server import RedisServer

    tmp = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    model = Path(args.model) if args.model else make_model(tmp / "model", args.preset)
    reqs = workload(args)
    redis = RedisServer(tmp / "redis")
    redis.start()
    runs: list[dict[str, Any]] = []
    try:
        for rep in range(args.repeats):  # policies alternate, so slow phases of a shared host
            for policy in args.policies:  # hit each of them alike
                n_runs = args.repeats * len(args.policies)
                what = f"{policy} (repeat {rep + 1}), {len(reqs)} requests"
                print(f"run {len(runs) + 1}/{n_runs}: {what}", file=sys.stderr, flush=True)
                runs.append(await run_policy(policy, model, redis.url, reqs, args))
    finally:
        redis.stop()
    oracle = oracle_hit_rate(reqs)

    def median(policy: str, key: str) -> float:
        value: float = statistics.median(r[key] for r in runs if r["policy"] == policy)
        return value

    summary: dict[str, Any] = {"oracle_hit_rate": oracle}
    if "prefix_aware" in args.policies:
        summary["hit_rate_vs_oracle"] = median("prefix_aware", "hit_rate") / oracle
        summary["lookup_p99_ms"] = median("prefix_aware", "lookup_in_run_p99_ms")
        summary["lookup_idle_p99_ms"] = median("prefix_aware", "lookup_idle_p99_ms")
        if "round_robin" in args.policies:
            ratios = [
                a["ttft_mean_ms"] / b["ttft_mean_ms"]
                for a, b in zip(runs[0::2], runs[1::2], strict=True)
                if (a["policy"], b["policy"]) == ("prefix_aware", "round_robin")
            ]
            summary["ttft_mean_vs_round_robin"] = statistics.median(ratios)
    return {"args": vars(args), "runs": runs, "summary": summary}


def print_table(report: dict[str, Any]) -> None:
    out = sys.stderr
    s = report["summary"]
    print(f"oracle hit rate (infinite shared cache): {s['oracle_hit_rate']:.3f}", file=out)
    head = f"{'policy':<14}{'hit':>7}{'mean TTFT':>11}{'p90 TTFT':>10}{'fail':>6}"
    head += f"{'grp->P':>8}{'lookup p50/p99 run':>21}{'idle':>15}"
    print(head, file=out)
    for r in report["runs"]:
        print(
            f"{r['policy']:<14}{r['hit_rate']:>7.3f}{r['ttft_mean_ms']:>9.1f}ms"
            f"{r['ttft_p90_ms']:>8.1f}ms{r['failures']:>6}{r['workers_per_group_mean']:>8.2f}"
            f"{r['lookup_in_run_p50_ms']:>11.3f}/{r['lookup_in_run_p99_ms']:.3f}ms"
            f"{r['lookup_idle_p50_ms']:>8.3f}/{r['lookup_idle_p99_ms']:.3f}ms",
            file=out,
        )
    print("mean TTFT parts (server side), ms:", file=out)
    for r in report["runs"]:
        parts = " ".join(
            f"{k.removesuffix('_ms')}={v:.1f}" for k, v in r["ttft_parts_mean_ms"].items()
        )
        print(f"  {r['policy']:<14}{parts}", file=out)
    print("by cache outcome (some tokens cached / none): n, mean TTFT, compute", file=out)
    for r in report["runs"]:
        cells = [
            f"{kind} {c['requests']} {c['ttft_mean_ms']:.1f}ms "
            f"{c['parts_mean_ms']['prefill_compute_ms']:.1f}ms"
            for kind, c in r["ttft_by_cache"].items()
        ]
        print(f"  {r['policy']:<14}" + "  ".join(cells), file=out)
    print("(medians over repeats; TTFT ratio per back-to-back pair)", file=out)
    for key in (
        "hit_rate_vs_oracle",
        "ttft_mean_vs_round_robin",
        "lookup_p99_ms",
        "lookup_idle_p99_ms",
    ):
        if key in s:
            print(f"{key}: {s[key]:.3f}", file=out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_prefix_routing")
    p.add_argument("--model", help="model folder (default: make the --preset random model)")
    p.add_argument(
        "--preset",
        default="small",
        choices=["tiny", "medium", "small"],
        help="random model to build: small (the benchmark preset, default) or the 13M-parameter "
        "medium one, on which a 2-core host's fixed per-request costs outweigh the prefix cache",
    )
    p.add_argument("--cache-weight", type=float, default=None, help="prefix_routing override")
    p.add_argument("--load-weight", type=float, default=None, help="prefix_routing override")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--prefix", type=int, default=512, help="shared tokens per group")
    p.add_argument("--suffix", type=int, default=64, help="own tokens per request")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4, help="closed-loop clients")
    p.add_argument(
        "--rate",
        type=float,
        default=1.0,
        help="open loop: Poisson arrivals per second (small model on 2 CPU cores: at 1 req/s "
        "round-robin's prefill queue averaged 44 ms, at 2 its compute tripled under contention; "
        "medium model: use ~5); 0: closed loop with --concurrency clients",
    )
    p.add_argument("--prefill-blocks", type=int, default=384, help="KV blocks per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--worker-nice",
        type=int,
        default=0,
        help="workers' niceness (0-19); above 0 the router (this process) and Redis go first",
    )
    p.add_argument(
        "--worker-sched-idle",
        action="store_true",
        help="workers run under SCHED_IDLE: they get a CPU only when the router, Redis and the "
        "client leave one (what separate machines would give the router on a 2-core host)",
    )
    p.add_argument("--kv-shared-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="same-host shared-memory KV data plane (else gloo bytes)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1, help="runs per policy, alternating")
    p.add_argument("--policies", nargs="+", default=["prefix_aware", "round_robin"])
    p.add_argument(
        "--out",
        default="runs/bench/prefix_routing.json",
        help="write the JSON report here (- for stdout)",
    )
    p.add_argument("--client", metavar="ADDRESS", help=argparse.SUPPRESS)  # the child's role
    args = p.parse_args(argv)
    if args.client:
        prompts = json.loads(sys.stdin.read())
        out = asyncio.run(
            client_loop(args.client, prompts, args.concurrency, args.max_tokens, args.rate)
        )
        print(json.dumps(out))
        return 0
    report = asyncio.run(main_async(args))
    print_table(report)
    write_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
