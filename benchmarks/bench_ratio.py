"""Ratio benchmark: fixed prefill:decode ratios vs the adaptive controller on a shifting
workload, on one local cluster, in one run; and the planner's predictions vs the measurements.

    python -m benchmarks.bench_ratio --model models/small --workers 3 \
        --phases chat:2.5:60,summarize:1.2:90 --context 512 \
        --slo-ttft-ms 3000 --slo-tpot-ms 150 --profile runs/small.profile.json \
        --out runs/bench/ratio

Runs in its own process (the load generator and the controller sidecar share its event loop;
the router and the workers are separate processes). Steps:

1. start N workers + a router (`harness.start_cluster`) and a sidecar pool; warm up;
2. for each configuration in `--configs` (default: every fixed split P:D of N, then
   `adaptive`), in that order: set the ratio in place (Worker.SetRole; the adaptive run starts
   at floor(N/2):ceil(N/2)), send the *same* shifting request list (`workload.shifting`: same
   lengths and arrival times, fresh token ids), wait until every worker is idle. The adaptive
   run has a `RatioController` beside the router, fed by this load generator's outcomes;
3. per configuration: attainment (both SLOs), goodput = requests meeting both SLOs / run
   duration, and the same per phase; the adaptive run's decision log (`decisions.jsonl`);
4. with `--profile`: the simulator's prediction for every fixed split, per phase and overall;
5. write `results.json`, `report.md` and `timeline.png` (attainment over time vs ratio changes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from deploy.tool_launchers import launch_cluster
from proto.pdserve.v1.roles import ROLE_NAMES
from router.ratio.config import RatioConfig
from router.ratio.driver import RatioController
from tooling.cpu import CpuMeter
from tooling.goodput.analysis import SLO
from tooling.goodput.records import RequestRecord, RequestSpec
from tooling.planner.harness import (
    Sidecar,
    cluster_pids,
    meets_both,
    phase_summary,
    send_all,
    start_cluster,
    wait_quiet,
)
from tooling.planner.timeline import plot_timeline, ratio_steps
from tooling.planner.workload import parse_phases, phase_starts, shifting, to_sim


def predict(
    specs: list[RequestSpec],
    cost_path: Path,
    p: int,
    d: int,
    args: argparse.Namespace,
    cores: float | None,
    adaptive: RatioConfig | None = None,
) -> dict[str, Any]:
    """The simulator's attainment for split p:d on `cores` shared cores, overall and per
    phase; with `adaptive`, p:d is the start and that controller moves workers."""
    from tooling.planner.profiles import load_profile
    from tooling.planner.sim import ClusterSpec, simulate
    from tooling.planner.sim import attainment as sim_att

    cost = load_profile(cost_path).cost(args.threads)
    spec = ClusterSpec(
        prefill=p,
        decode=d,
        chunk_tokens=args.chunk_tokens,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=args.num_kv_blocks,
        cores=cores,
    )
    if adaptive is None:
        outs = simulate(to_sim(specs), spec, cost)
    else:
        from tooling.planner.sim_adaptive import simulate_adaptive

        outs = simulate_adaptive(to_sim(specs), spec, cost, adaptive).outcomes
    slo_s = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    res: dict[str, Any] = {"attainment": sim_att(outs, *slo_s)[2], "cores": cores, "phases": []}
    phases = parse_phases(args.phases)
    for (start, name), (_, _, length) in zip(phase_starts(phases), phases, strict=True):
        idx = [i for i, s in enumerate(specs) if start <= s.arrival_s < start + length]
        res["phases"].append(
            {"phase": name, "attainment": sim_att([outs[i] for i in idx], *slo_s)[2]}
        )
    return res


async def wait_idle(sc: Sidecar, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await sc.pool.poll_once()
        if all(v.num_running == 0 and v.num_waiting == 0 for v in sc.pool.views()):
            return
        await asyncio.sleep(0.25)
    raise RuntimeError("workers did not become idle between runs")


def controller_config(args: argparse.Namespace, out: Path) -> RatioConfig:
    n = args.workers
    return RatioConfig(
        mode="adaptive",
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        attainment_target=args.target,
        min_prefill=1,
        max_prefill=n - 1,
        min_decode=1,
        max_decode=n - 1,
        window_s=args.window_s,
        interval_s=1.0,
        cooldown_s=args.cooldown_s,
        min_requests=args.min_requests,
        hysteresis=0.05,
        drain_timeout_s=30.0,
        sample_interval_s=0.5,
        decisions_path=out / "decisions.jsonl",
    )


async def run_config(
    name: str, cluster: Any, sc: Sidecar, specs: list[RequestSpec], args: argparse.Namespace,
    out: Path, seed: int,
) -> dict[str, Any]:  # fmt: skip
    """One configuration over the whole request list (module docstring, step 2)."""
    n = args.workers
    adaptive = name == "adaptive"
    p = n // 2 if adaptive else int(name.split(":")[0])
    load = await wait_quiet(args.max_load, args.max_wait_s)
    await sc.set_ratio(p)
    await asyncio.sleep(1.0)  # the router's pool polls every 0.25 s
    controller = None
    observe = None
    if adaptive:
        cfg = controller_config(args, out)
        with contextlib.suppress(FileNotFoundError):
            cfg.decisions_path.unlink()  # type: ignore[union-attr]
        controller = RatioController(cfg, sc.pool, sc.actuator)

        def observe(rec: RequestRecord) -> None:
            ttft = rec.ttft_ms / 1e3 if rec.ttft_ms is not None else None
            tpot = rec.tpot_ms / 1e3 if rec.tpot_ms is not None else None
            e2e = rec.e2e_ms / 1e3 if rec.e2e_ms is not None else None
            controller.observe(ttft, tpot, rec.ok, e2e)

        controller.start()
    t0_wall = time.time() + 0.05  # send_all's t = 0
    print(f"[{name}] sending {len(specs)} requests (load {load:.1f})", file=sys.stderr, flush=True)
    meter = CpuMeter()
    meter.start(cluster_pids(cluster))
    try:
        records, duration = await send_all(
            cluster.address, specs, args.vocab_size, seed, f"ratio-{name}", observe
        )
    finally:
        if controller is not None:
            await controller.wait_idle()
            await controller.stop()
    cpu = meter.stop()
    await wait_idle(sc)
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    res = phase_summary(records, duration, slo, parse_phases(args.phases))
    res |= {"config": name, "initial_prefill": p, "t0_wall": t0_wall, "load_at_start": load}
    res["cpu"] = cpu
    res["records"] = [r.to_json() for r in records]
    if controller is not None:
        res["decisions"] = [r.to_json() for r in controller.records if r.action != "hold"]
        res["final_roles"] = sc.roles()
    print(
        f"[{name}] attainment {res['attainment']:.1%}, goodput {res['goodput_rps']:.3f} req/s, "
        f"external load {cpu['external_cores']:.2f} cores, "
        + ", ".join(f"{x['phase']} {x['attainment']:.1%}" for x in res["phases"]),
        file=sys.stderr,
        flush=True,
    )
    return res


def report(results: dict[str, Any], args: argparse.Namespace, out: Path) -> str:
    runs = results["runs"]
    fixed = [r for r in runs if r["config"] != "adaptive"]
    lines = [
        f"# Ratio benchmark: {args.workers} workers, phases {args.phases}",
        "",
        f"Model {args.model}, context {args.context}, SLOs TTFT {args.slo_ttft_ms:g} ms / "
        f"TPOT {args.slo_tpot_ms:g} ms, target {args.target:.0%}; {os.cpu_count()} CPUs; "
        f"load average at start {results['load_avg_start']:.1f}.",
        "",
        "Predicted: the simulator on the free machine's cores / on the cores left by the "
        "other processes during that run (measured from /proc).",
        "",
        "| config | load | ext. cores | attainment | goodput req/s | " + " | ".join(
            f"{p['phase']} att." for p in runs[0]["phases"]
        ) + " | pred. free | pred. shared | " + " | ".join(
            f"{p['phase']} pred." for p in runs[0]["phases"]
        ) + " |",
        "|---" * (7 + 2 * len(runs[0]["phases"])) + "|",
    ]  # fmt: skip
    for r in runs:
        pred = r.get("prediction")
        row = f"| {r['config']} | {r['load_at_start']:.1f} | {r['cpu']['external_cores']:.2f} | "
        row += f"{r['attainment']:.1%} | {r['goodput_rps']:.3f} | "
        row += " | ".join(f"{p['attainment']:.1%}" for p in r["phases"])
        if pred is None:
            row += " | – | – |" + " – |" * len(r["phases"])
        else:
            row += f" | {pred['free']['attainment']:.1%} | {pred['shared']['attainment']:.1%} | "
            row += " | ".join(f"{p['attainment']:.1%}" for p in pred["shared"]["phases"]) + " |"
        lines.append(row)
    adaptive = [r for r in runs if r["config"] == "adaptive"]
    if adaptive and fixed:
        # repeated configurations (e.g. A,B,C,C,B,A against drifting machine load): means
        mean: dict[str, list[float]] = {}
        for r in runs:
            mean.setdefault(r["config"], []).append(r["goodput_rps"])
        avg = {k: sum(v) / len(v) for k, v in mean.items()}
        best = max((k for k in avg if k != "adaptive"), key=lambda k: avg[k])
        ratio = avg["adaptive"] / avg[best] if avg[best] else 0.0
        lines += [
            "",
            "Mean goodput per configuration (req/s): "
            + ", ".join(f"{k} {v:.3f} ({len(mean[k])} runs)" for k, v in avg.items()),
            "",
            f"Adaptive goodput / best fixed ({best}): **{ratio:.2f}x** (target 1.2x).",
            "",
            "Controller changes:",
        ]
        lines += [
            f"- t={d['t']:.1f}s {d['event']} {d['action']} {d.get('address') or ''}: {d['reason']}"
            for d in adaptive[-1].get("decisions", [])
        ]
    for kind in ("free", "shared"):
        errs = [
            abs(r["attainment"] - r["prediction"][kind]["attainment"])
            for r in fixed
            if "prediction" in r
        ]
        if errs:
            lines += ["", f"Planner ({kind} cores): max |predicted - measured| attainment = "
                      f"{max(errs):.1%} (target <= 3 points)."]  # fmt: skip
    lines += ["", "![timeline](timeline.png)", ""]
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    return text


async def main_async(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    phases = parse_phases(args.phases)
    specs = shifting(phases, args.context, args.seed, args.output_len)
    configs = args.configs or [f"{p}:{args.workers - p}" for p in range(1, args.workers)] + [
        "adaptive"
    ]
    engine = {
        "block_size": 16,
        "num_kv_blocks": args.num_kv_blocks,
        "max_num_batched_tokens": max(args.chunk_tokens, args.max_num_seqs),
        "max_num_seqs": args.max_num_seqs,
    }
    results: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "load_avg_start": os.getloadavg()[0],
        "runs": [],
    }
    logs = out / "logs"
    cluster = start_cluster(
        Path(args.model), args.workers, engine, args.threads, logs, launch_cluster
    )
    with contextlib.suppress(PermissionError, OSError):
        os.nice(-10)  # after the children started: the load generator's sends are not delayed
    try:
        addresses = cluster.workers.addresses()
        roles = {a: r for r in ROLE_NAMES for a in addresses[r]}
        sc = Sidecar(roles, internal=cluster.workers.internal)
        await sc.start()
        warm = shifting([(phases[0][0], 1.0, 4.0), ("summarize", 1.0, 2.0)], args.context, 99)
        await send_all(cluster.address, warm, args.vocab_size, 1, "warmup")
        for k, name in enumerate(configs):
            results["runs"].append(await run_config(name, cluster, sc, specs, args, out, 100 + k))
            (out / "results.json").write_text(json.dumps(results, default=str) + "\n")
        await sc.stop()
    finally:
        cluster.stop()
    finish(results, args, out)
    return 0


def finish(results: dict[str, Any], args: argparse.Namespace, out: Path) -> None:
    """Predictions (with --profile), results.json, timeline.png and report.md from `results`
    (also what `--from-results` rebuilds from a saved run)."""
    phases = parse_phases(args.phases)
    specs = shifting(phases, args.context, args.seed, args.output_len)
    if args.profile:
        for r in results["runs"]:
            cfg = controller_config(args, out) if r["config"] == "adaptive" else None
            p = r["initial_prefill"]
            free = args.cores if args.cores > 0 else None
            shared = max(0.5, r["cpu"]["cpus"] - r["cpu"]["external_cores"])
            prof, d = Path(args.profile), args.workers - p
            r["prediction"] = {
                "free": predict(specs, prof, p, d, args, free, cfg),
                "shared": predict(specs, prof, p, d, args, shared, cfg),
            }
    (out / "results.json").write_text(json.dumps(results, default=str) + "\n")
    names = [r["config"] for r in results["runs"]]
    series = {
        (r["config"] if names.count(r["config"]) == 1 else f"{r['config']} #{k + 1}"): [
            (RequestRecord.from_json(x).end_s, meets_both(x, args.slo_ttft_ms, args.slo_tpot_ms))
            for x in r["records"]
        ]
        for k, r in enumerate(results["runs"])
    }
    changes = []
    adaptive = next((r for r in reversed(results["runs"]) if r["config"] == "adaptive"), None)
    if adaptive is not None:
        p0 = adaptive["initial_prefill"]
        changes = ratio_steps(adaptive["decisions"], adaptive["t0_wall"], (p0, args.workers - p0))
    plot_timeline(series, changes, out / "timeline.png", args.target, args.window_s,
                  phase_starts(phases), f"{args.workers} workers, {args.phases}")  # fmt: skip
    print(report(results, args, out))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/small")
    p.add_argument("--out", default="runs/bench/ratio")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--phases", default="chat:2.5:60,summarize:1.2:90")
    p.add_argument("--configs", type=lambda s: s.split(","), default=None)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--window-s", type=float, default=8.0)
    p.add_argument("--cooldown-s", type=float, default=6.0)
    p.add_argument("--min-requests", type=int, default=6)
    p.add_argument("--profile", default=None, help="cost profile for predictions")
    p.add_argument("--cores", type=float, default=float(os.cpu_count() or 1))
    p.add_argument("--max-load", type=float, default=3.0, help="wait for this load average")
    p.add_argument("--max-wait-s", type=float, default=300.0, help="... at most this long")
    p.add_argument("--from-results", help="rebuild predictions and report from this run folder")
    args = p.parse_args(argv)
    if args.from_results:
        results = json.loads((Path(args.from_results) / "results.json").read_text())
        for key in ("phases", "context", "seed", "output_len", "workers", "slo_ttft_ms"):
            setattr(args, key, results["args"][key])  # the run's own workload and cluster
        for key in ("slo_tpot_ms", "target", "window_s", "cooldown_s", "min_requests"):
            setattr(args, key, results["args"][key])
        for key in ("chunk_tokens", "max_num_seqs", "num_kv_blocks"):
            setattr(args, key, results["args"][key])
        finish(results, args, Path(args.from_results))
        return 0
    if args.slo_ttft_ms is None or args.slo_tpot_ms is None:
        p.error("--slo-ttft-ms and --slo-tpot-ms are required")
    # `kill PID` stops the cluster too: SIGTERM raises KeyboardInterrupt, the finally runs
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if args.vocab_size is None:
        from model_runtime.config import ModelConfig

        args.vocab_size = ModelConfig.from_model_dir(args.model).vocab_size
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
