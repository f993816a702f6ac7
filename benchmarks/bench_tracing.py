"""Tracing overhead (issue 44): TPOT and SLO goodput of a 1P1D cluster with tracing off, on
(sampler ratio 1.0, every request traced, a collector that answers), with the collector down
(nothing listens at its endpoint) and with it hanging (it takes the connection and never
answers). Standalone.

    python -m benchmarks.bench_tracing --out runs/tracing --duration 30 --repeats 3

One run:

1. an OTLP receiver in this process (`tracing.receiver`; one that answers, one held) and a
   closed port for the collector that is down;
2. four 1P1D clusters of the same model and sizing (router + prefill + decode worker, local
   processes), identical but for ``[tracing]``: off; on, exporting to the receiver; on,
   exporting to the closed port; on, exporting to the held receiver (`export_timeout_s` 10 s:
   each export hangs that long; its queue is 256 spans, so it fills and drops);
3. calibration on the 'off' cluster: `--calib` sequential requests give the unloaded TTFT and
   TPOT medians; the SLOs are `--slo-scale` times those (or `--slo-ttft-ms` / `--slo-tpot-ms`);
4. `--repeats` rounds; in each, every cluster in turn (the order rotates between rounds) gets
   Poisson arrivals at `--rate` for `--duration` seconds of fixed-length requests (greedy,
   ignore_eos) from a separate load-generator process; idle clusters only answer status polls;
5. per condition: mean TPOT (client side), SLO goodput (requests meeting both SLOs per second),
   failures and the CPU time the cluster's processes spent per request (router + workers,
   /proc: tracing's own cost, visible even where latency noise hides it), each the median
   over rounds, and the ratios to 'off'; each traced router's
   span counters (`pdserve:tracing_spans_exported_total`, `..._dropped_total{reason}`, from its
   /metrics) at the end.

JSON (every run's records) to `--out`/results.json and a Markdown summary, `summary.md`.
The issue's target: on / off >= 0.97 for TPOT (inverted: off / on) and goodput, and the
collector down or hanging costs < 2 % TPOT and no request.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc

from benchmarks.bench_decode_step import ensure_model
from deploy.tool_launchers import launch_cluster
from proto.pdserve.v1 import inference_pb2, inference_pb2_grpc
from tooling.cpu import pid_cpu_s
from tooling.goodput.analysis import SLO, slo_goodput_rps
from tooling.goodput.arrivals import arrival_times
from tooling.goodput.clusters import EngineSizing, cluster_settings
from tooling.goodput.loadgen import LoadJob, run_load_process
from tooling.goodput.records import RequestSpec, RunResult
from tracing.receiver import OtlpReceiver

CONDITIONS = ("off", "on", "down", "hang")


def say(msg: str) -> None:
    print(f"[bench_tracing] {msg}", file=sys.stderr, flush=True)


def closed_port() -> int:
    """A port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tracing_overrides(condition: str, up: OtlpReceiver, held: OtlpReceiver) -> dict[str, Any]:
    """The ``[tracing]`` keys of one condition (every traced one at sampler ratio 1.0)."""
    if condition == "off":
        return {"tracing.enabled": False, "router.http_port": 0}
    endpoint = {
        "on": up.grpc_endpoint,
        "down": f"http://127.0.0.1:{closed_port()}",
        "hang": held.grpc_endpoint,
    }[condition]
    hang = {"tracing.max_queue_size": 256} if condition == "hang" else {}  # drops show sooner
    return {
        **hang,
        "tracing.enabled": True,
        "tracing.endpoint": endpoint,
        "tracing.protocol": "grpc",
        "tracing.sampler": "traceidratio",
        "tracing.sampler_arg": 1.0,
        "tracing.export_timeout_s": 10.0,
        "router.http_port": 0,
    }


def span_counters(metrics_url: str) -> dict[str, float]:
    """The router's span counters from its /metrics (text format)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("pdserve:tracing_spans_"):
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("pdserve:tracing_spans_")] = float(value)
    return out


def calibrate(address: str, prompt_len: int, output_len: int, n: int) -> tuple[float, float]:
    """Median TTFT and TPOT (ms) of `n` sequential requests on an idle cluster."""
    ttft, tpot = [], []
    with grpc.insecure_channel(address) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)  # type: ignore[no-untyped-call]
        for i in range(n):
            req = inference_pb2.GenerateRequest(
                request_id=f"calib-{i}",
                token_ids=inference_pb2.TokenIds(
                    ids=[(i * 7 + j) % 900 + 5 for j in range(prompt_len)]
                ),
                sampling=inference_pb2.SamplingParams(max_tokens=output_len, ignore_eos=True),
            )
            t0 = time.perf_counter()
            first = last = None
            count = 0
            for resp in stub.Generate(req, timeout=120):
                if resp.token_ids:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    count += len(resp.token_ids)
            assert first is not None and last is not None and count == output_len
            ttft.append((first - t0) * 1e3)
            tpot.append((last - first) * 1e3 / max(1, count - 1))
    return statistics.median(ttft), statistics.median(tpot)


def summarize(run: RunResult, slo: SLO) -> dict[str, Any]:
    ok = [r for r in run.records if r.status == "OK" and r.num_tokens == r.output_len]
    tpots = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    return {
        "requests": len(run.records),
        "failed": len(run.records) - len(ok),
        "tpot_ms_mean": statistics.fmean(tpots) if tpots else None,
        "tpot_ms_p50": statistics.median(tpots) if tpots else None,
        "ttft_ms_p50": statistics.median([r.ttft_ms for r in ok if r.ttft_ms is not None])
        if ok
        else None,
        "goodput_rps": slo_goodput_rps(run, slo),
        "valid": run.valid,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="models/small", help="model folder (made if absent)")
    p.add_argument("--out", type=Path, default=Path("runs/tracing"))
    p.add_argument("--rate", type=float, default=2.0, help="offered load, requests/s")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="torch threads, split between P and D")
    p.add_argument("--calib", type=int, default=5, help="sequential requests for the SLOs")
    p.add_argument("--slo-scale", type=float, default=3.0)
    p.add_argument("--slo-ttft-ms", type=float, default=0.0)
    p.add_argument("--slo-tpot-ms", type=float, default=0.0)
    p.add_argument("--conditions", default=",".join(CONDITIONS))
    args = p.parse_args(argv)
    conditions = [c for c in args.conditions.split(",") if c]
    if "off" not in conditions or not set(conditions) <= set(CONDITIONS):
        p.error(f"--conditions: a subset of {CONDITIONS} including 'off'")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    ensure_model(args.model, "bfloat16")
    context = args.prompt_len + args.output_len
    sizing = EngineSizing(context=context)
    up, held = OtlpReceiver().start(), OtlpReceiver().start()
    held.hold()
    clusters = {}
    counters: dict[str, dict[str, float]] = {}
    try:
        for cond in conditions:
            settings = cluster_settings(
                "disagg",
                Path(args.model),
                sizing,
                args.threads,
                **tracing_overrides(cond, up, held),
            )
            say(f"starting the '{cond}' cluster")
            clusters[cond] = launch_cluster(settings, out / "logs" / cond)
        ttft0, tpot0 = calibrate(
            clusters["off"].address, args.prompt_len, args.output_len, args.calib
        )
        slo = SLO(
            args.slo_ttft_ms or args.slo_scale * ttft0, args.slo_tpot_ms or args.slo_scale * tpot0
        )
        say(f"unloaded TTFT {ttft0:.1f} ms, TPOT {tpot0:.2f} ms; SLO {slo.text()}")
        n = max(1, round(args.rate * args.duration))
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in conditions}
        records: list[dict[str, Any]] = []
        for rnd in range(args.repeats):
            order = conditions[rnd % len(conditions) :] + conditions[: rnd % len(conditions)]
            for cond in order:
                arrivals = arrival_times(n, args.rate, seed=rnd)
                specs = [
                    RequestSpec(i, t, args.prompt_len, args.output_len)
                    for i, t in enumerate(arrivals)
                ]
                job = LoadJob(
                    address=clusters[cond].address,
                    specs=specs,
                    config=cond,
                    rate=args.rate,
                    seed=rnd,
                    token_seed=1000 * rnd + conditions.index(cond),  # no prefix-cache hits
                    label=f"{cond}-r{rnd}",
                )
                pids = clusters[cond].labelled_pids()
                cpu0 = {k: pid_cpu_s(p) for k, p in pids.items()}
                run = run_load_process(job, out / "jobs")
                s = summarize(run, slo)
                # CPU the cluster's processes spent per request (ms): tracing's own cost shows
                # here even when latency noise hides it
                cpu = sum(pid_cpu_s(p) - cpu0[k] for k, p in pids.items())
                s["cpu_ms_per_request"] = 1e3 * cpu / max(1, s["requests"])
                runs[cond].append(s)
                records.append({"condition": cond, "round": rnd, "summary": s,
                                "records": [asdict(r) for r in run.records]})  # fmt: skip
                say(f"round {rnd} {cond}: {s}")
        for cond, c in clusters.items():
            url = c.http_url
            if cond != "off" and url is not None:
                counters[cond] = span_counters(url.removesuffix("/v1") + "/metrics")
    finally:
        for c in clusters.values():
            c.stop()
        spans = {"on": len(up.spans()), "hang": len(held.spans())}
        held.release()
        up.stop()
        held.stop()

    def med(cond: str, key: str) -> float:
        values = [r[key] for r in runs[cond] if r[key] is not None]
        return statistics.median(values) if values else float("nan")

    table = {}
    base_tpot, base_good = med("off", "tpot_ms_mean"), med("off", "goodput_rps")
    for cond in conditions:
        tpot, good = med(cond, "tpot_ms_mean"), med(cond, "goodput_rps")
        table[cond] = {
            "cpu_ms_per_request": med(cond, "cpu_ms_per_request"),
            "tpot_ms_mean": tpot,
            "goodput_rps": good,
            "failed": sum(r["failed"] for r in runs[cond]),
            "tpot_vs_off": base_tpot / tpot if tpot else float("nan"),  # >= 0.97: within 3 %
            "goodput_vs_off": good / base_good if base_good else float("nan"),
        }
    meta = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "slo": slo.to_json(),
        "unloaded": {"ttft_ms": ttft0, "tpot_ms": tpot0},
        "spans_received": spans,
        "router_span_counters": counters,
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "table": table, "runs": records}))
    lines = [
        f"# Tracing overhead ({args.repeats} rounds x {args.duration:g} s at {args.rate:g} req/s, "
        f"{args.prompt_len} in / {args.output_len} out; {slo.text()})",
        "",
        "| condition | TPOT mean ms | off/this TPOT | SLO goodput req/s | vs off | failed "
        "| cluster CPU ms/request |",
        "|---|---|---|---|---|---|---|",
    ]
    for cond, row in table.items():
        lines.append(
            f"| {cond} | {row['tpot_ms_mean']:.2f} | {row['tpot_vs_off']:.3f} | "
            f"{row['goodput_rps']:.2f} | {row['goodput_vs_off']:.3f} | {row['failed']} | "
            f"{row['cpu_ms_per_request']:.1f} |"
        )
    lines += ["", f"spans the receiver got: {spans}", "", "router span counters at the end:"]
    lines += [f"- {cond}: {c}" for cond, c in counters.items()]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
