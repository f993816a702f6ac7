"""Tracing overhead (issue 44): TPOT and SLO goodput of a 1P1D cluster with tracing off, on
(sampler ratio 1.0, every request traced, a collector that answers), with the collector down
(nothing listens at its endpoint) and with it hanging (it takes the connection and never
answers). Standalone.

    python -m benchmarks.bench_tracing --out runs/tracing --duration 30 --repeats 3

One run:

0. the CPU cost of tracing itself, measured in this process without a cluster (`span_cpu`):
   the router's spans of one request and the workers' spans of its Reserve, Prefill and
   Decode (`--micro-tokens` chunks) through the real code (`router.request_trace`,
   `router.leg`'s client spans, `worker.tracing`) and the real SDK, each batch encoded to
   OTLP protobuf as the exporters do (only the socket write left out), as process CPU time
   (all threads: the export thread too) per request, on in the router or in the workers
   minus off everywhere. This number
   does not depend on what else runs on the machine, which the latencies below do;
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
   over rounds, and the ratios to 'off': of the medians, and paired (each round against its
   own 'off', median and range: the fairer reading on a shared host); each traced router's
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
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from benchmarks.bench_decode_step import ensure_model
from deploy.tool_launchers import launch_cluster
from model_runtime.sampling_params import SamplingParams
from model_runtime.tokenizer import Tokenizer
from proto.pdserve.v1 import inference_pb2, inference_pb2_grpc, worker_pb2
from router.request_trace import NEW_TRACE, RequestTrace, worker_call
from router.validation import ValidatedRequest
from tooling.cpu import pid_cpu_s
from tooling.goodput.analysis import SLO, slo_goodput_rps
from tooling.goodput.arrivals import arrival_times
from tooling.goodput.clusters import EngineSizing, cluster_settings
from tooling.goodput.loadgen import LoadJob, run_load_process
from tooling.goodput.records import RequestSpec, RunResult
from tracing import NO_TRACER, Tracer, TracingConfig
from tracing.receiver import OtlpReceiver
from worker.tracing import RpcSpans

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


class EncodingExporter(SpanExporter):
    """Encodes each batch to OTLP protobuf bytes, as the OTLP exporters do, and drops them: the
    CPU of an export less the socket write."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        encode_spans(spans).SerializeToString()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def _one_request(router: Tracer, worker: Tracer, tokenizer: Tokenizer, chunks: int) -> None:
    """The spans of one 1P1D request, router and both workers, through the product's code."""
    req = ValidatedRequest("r", tuple(range(128)), SamplingParams(max_tokens=chunks + 1), ())
    tr = RequestTrace(router, "small", NEW_TRACE)
    with tr.phase("pdserve.tokenize"):
        pass
    tr.validated(req, "r", tokenizer)
    with tr.phase("pdserve.admission_queue"):
        pass
    answers: list[tuple[str, Any]] = [
        ("Reserve", worker_pb2.ReserveResponse()),
        ("Prefill", worker_pb2.PrefillResponse(queue_ms=1, compute_ms=5, kv_total_ms=5)),
        ("Decode", None),
    ]
    for method, answer in answers:
        call = worker_call(tr.root, method, "127.0.0.1:1", "w")
        request = worker_pb2.PrefillRequest(request_id="r", prompt_token_ids=req.prompt_token_ids)
        rpc = RpcSpans(worker, method, request, call.headers(), time.monotonic(), "w")
        if answer is not None:
            rpc.answered(answer)
        else:
            for _ in range(chunks):
                rpc.chunk(worker_pb2.TokenChunk(token_ids=[1], admission_ms=1, first_step_ms=2))
        rpc.end()
        call.end()
    tr.finish("OK", "", 0.03, "length", False, tokenizer)


def span_cpu(model: str, n: int, chunks: int) -> dict[str, float]:
    """CPU microseconds per request that tracing costs (step 0 of the module docstring): one
    request's spans with tracing off everywhere, on in the router only, on in the workers only;
    `router_us` / `workers_us` are the differences to off."""
    from tracing.config import ExportSettings
    from tracing.sdk import OtelTracer

    settings = ExportSettings.resolve(TracingConfig(enabled=True, schedule_delay_ms=50), {})
    assert settings is not None
    tokenizer = Tokenizer.from_model_dir(model)
    cpu: dict[str, float] = {}
    spans = 0
    for label in ("off", "router", "workers"):
        on = OtelTracer(settings, label, label, EncodingExporter())
        router: Tracer = on if label == "router" else NO_TRACER
        worker: Tracer = on if label == "workers" else NO_TRACER
        for _ in range(50):  # warm-up
            _one_request(router, worker, tokenizer, chunks)
        t0 = time.process_time()
        for _ in range(n):
            _one_request(router, worker, tokenizer, chunks)
        on.force_flush()  # the export thread's encoding counts too
        cpu[label] = (time.process_time() - t0) / n * 1e6
        spans += on.counts()["exported"]
        on.shutdown()
    return {
        "spans_per_request": spans / (n + 50),
        "off_us": cpu["off"],
        "router_us": cpu["router"] - cpu["off"],
        "workers_us": cpu["workers"] - cpu["off"],
    }


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
    p.add_argument("--out", type=Path, default="runs/tracing")
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
    p.add_argument("--micro-requests", type=int, default=2000, help="step 0's requests")
    p.add_argument("--micro-tokens", type=int, default=64, help="step 0's decode chunks")
    p.add_argument("--micro-only", action="store_true", help="step 0 only (no cluster)")
    args = p.parse_args(argv)
    conditions = [c for c in args.conditions.split(",") if c]
    if "off" not in conditions or not set(conditions) <= set(CONDITIONS):
        p.error(f"--conditions: a subset of {CONDITIONS} including 'off'")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    ensure_model(args.model, "bfloat16")
    micro = span_cpu(args.model, args.micro_requests, args.micro_tokens)
    say(f"tracing's own CPU per request (step 0): {micro}")
    if args.micro_only:
        (out / "micro.json").write_text(json.dumps(micro))
        return 0
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

    def paired(cond: str, key: str, invert: bool) -> list[float]:
        """Per round (the same round's 'off' beside it): this / off, or off / this."""
        out = []
        for mine, off in zip(runs[cond], runs["off"], strict=True):
            a, b = mine[key], off[key]
            if a is None or b is None:
                continue
            num, den = (b, a) if invert else (a, b)
            if den:  # a round with zero goodput beside a live 'off' counts as 0, not skipped
                out.append(num / den)
        return out

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
            # the fairer reading on a noisy host: each round against its own 'off'
            "tpot_vs_off_paired": paired(cond, "tpot_ms_mean", invert=True),
            "goodput_vs_off_paired": paired(cond, "goodput_rps", invert=False),
        }
    meta = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "slo": slo.to_json(),
        "unloaded": {"ttft_ms": ttft0, "tpot_ms": tpot0},
        "spans_received": spans,
        "router_span_counters": counters,
        "span_cpu": micro,
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "table": table, "runs": records}))
    lines = [
        f"Tracing's own CPU per request (router + workers, {args.micro_tokens} decode chunks, "
        f"{micro['spans_per_request']:.0f} spans, OTLP-encoded): router "
        f"{micro['router_us']:.0f} us, prefill + decode worker {micro['workers_us']:.0f} us",
        "",
        f"# Tracing overhead ({args.repeats} rounds x {args.duration:g} s at {args.rate:g} req/s, "
        f"{args.prompt_len} in / {args.output_len} out; {slo.text()})",
        "",
        "| condition | TPOT mean ms | off/this TPOT | paired: median (range) | SLO goodput "
        "req/s | vs off | paired: median (range) | failed | cluster CPU ms/request |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def spread(values: list[float]) -> str:
        if not values:
            return "-"
        return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

    for cond, row in table.items():
        lines.append(
            f"| {cond} | {row['tpot_ms_mean']:.2f} | {row['tpot_vs_off']:.3f} | "
            f"{spread(row['tpot_vs_off_paired'])} | {row['goodput_rps']:.2f} | "
            f"{row['goodput_vs_off']:.3f} | {spread(row['goodput_vs_off_paired'])} | "
            f"{row['failed']} | {row['cpu_ms_per_request']:.1f} |"
        )
    lines += ["", f"spans the receiver got: {spans}", "", "router span counters at the end:"]
    lines += [f"- {cond}: {c}" for cond, c in counters.items()]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
