"""Speculative decoding, single stream: TPOT with and without it through a real cluster, the
acceptance it got, and llama.cpp's `llama-server` on the same weights. Standalone.

    python -m benchmarks.bench_speculative [--model DIR] [--dtype bfloat16] [--threads 2]
        [--topologies colocated,disagg] [--workloads quoting,random] [--method ngram] [--k 4]
        [--draft DIR] [--requests 8] [--max-tokens 128] [--llamacpp] [--llamacpp-threads 1,2]
        [--out runs/spec-YYYYmmdd-HHMMSS]

One run, in order, one server at a time (the machine's memory is shared):

1. per topology (`colocated`: one worker with `--threads` torch threads; `disagg`: 1P1D,
   `--threads` / 2 each; `tooling.goodput.clusters`), one cluster whose engines speculate
   (`[engine.speculative]` from `--method`, `--k`, `--draft`) with `--dtype` weights;
2. per workload, `--requests` pairs of requests one at a time over the router's OpenAI HTTP
   front, streamed: the same request with speculation (the cluster's) and without (the
   per-request opt-out `speculative: false`, whose steps are plain decode steps), in
   alternating order, so each pair sees the same machine. Workloads:
   - `quoting` (`benchmarks/quoting.py`): chat requests that edit, copy or summarize a given
     paragraph, greedy, to the end of the answer or `--max-tokens`;
   - `random`: `--prompt-len` random token ids, `--max-tokens` tokens with `ignore_eos`,
     sampled at temperature 1 with a seed per request: nothing to quote in the prompt, and no
     repetition in the answer (greedy decoding of random ids falls into loops, which the
     n-gram proposer predicts perfectly; seeded sampling keeps both answers equal);
   TPOT of one request = (last token's arrival - first token's arrival) / (tokens - 1), as
   the goodput tools measure it (tokens verified in one step arrive in one message); the
   answer with and without speculation must be the same text (greedy or seeded), counted;
   prefix caching is off, so both requests of a pair prefill the same way;
   the decoding worker's `pdserve:spec_decode_*` counters before and after give the
   workload's acceptance rate and mean acceptance length (tokens per verified step);
3. with `--llamacpp`, llama-server (`bench_llamacpp`'s build, the model as F16 GGUF) at each of
   `--llamacpp-threads` threads with each of `--llamacpp-spec` (its `--spec-type`: none, or
   its own prompt-lookup proposers `ngram-simple`, `ngram-mod`), the quoting requests once
   each: its best TPOT over those settings is the comparison's.

Per topology and workload: median TPOT with / without speculation and the median of the
per-pair ratios; acceptance rate; mean acceptance length; identical answers. JSON to
`--out/result.json`, Markdown to `--out/result.md`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.quoting import quoting_messages

SPEC_COUNTERS = (
    "pdserve:spec_decode_num_drafts_total",
    "pdserve:spec_decode_num_draft_tokens_total",
    "pdserve:spec_decode_num_accepted_tokens_total",
)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def stream(url: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    """POST a streaming OpenAI request; its TTFT, TPOT (ms), tokens, text and messages."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    first = last = None
    text: list[str] = []
    chunks = 0
    usage: dict[str, Any] | None = None
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            msg = json.loads(line[5:])
            usage = msg.get("usage") or usage
            for choice in msg.get("choices", ()):
                piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                if piece:
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    chunks += 1
                    text.append(piece)
    n = int(usage["completion_tokens"]) if usage else chunks
    assert first is not None and last is not None, f"no tokens from {url}"
    return {
        "ttft_ms": (first - t0) * 1e3,
        "tpot_ms": (last - first) * 1e3 / max(n - 1, 1),
        "tokens": n,
        "messages": chunks,
        "text": "".join(text),
    }


def served_model(url: str) -> str:
    """The first model id an OpenAI server at `url` (its /v1 base) serves."""
    with urllib.request.urlopen(f"{url}/models", timeout=10) as resp:
        return str(json.load(resp)["data"][0]["id"])


def spec_counters(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        families = text_string_to_metric_families(resp.read().decode())
        return {s.name: s.value for f in families for s in f.samples if s.name in SPEC_COUNTERS}


def decoding_metrics_url(cluster: Any) -> str:
    """The metrics URL of the cluster's decoding worker (colocated or decode role)."""
    from deploy.client import CHANNEL_OPTIONS
    from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc

    (w,) = [w for w in cluster.workers.workers if w.role in ("colocated", "decode")]
    internal = cluster.workers.internal
    with internal.channel(w.address, CHANNEL_OPTIONS) as ch:
        stub = internal.stub(worker_pb2_grpc.WorkerStub(ch))  # type: ignore[no-untyped-call]
        port = stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=10.0).metrics_port
    return f"http://127.0.0.1:{port}/metrics"


def bodies(workload: str, args: argparse.Namespace, vocab: int) -> list[tuple[str, dict[str, Any]]]:
    """(endpoint, body) of each request of `workload` (model name filled in by the caller)."""
    if workload == "quoting":
        return [
            ("chat/completions", {"messages": m, "max_tokens": args.max_tokens, "temperature": 0})
            for m in quoting_messages(args.requests)
        ]
    rng = random.Random(args.seed)
    return [
        (
            "completions",
            {
                "prompt": [rng.randrange(4, vocab) for _ in range(args.prompt_len)],
                "max_tokens": args.max_tokens,
                "temperature": 1.0,
                "seed": args.seed + i,
                "ignore_eos": True,
            },
        )
        for i in range(args.requests)
    ]


def speculative_table(args: argparse.Namespace) -> dict[str, Any]:
    spec: dict[str, Any] = {"method": args.method, "num_speculative_tokens": args.k}
    if args.method == "draft":
        spec["model"] = str(Path(args.draft).resolve())
    return spec


def run_topology(name: str, args: argparse.Namespace, model: Path, out: Path) -> dict[str, Any]:
    """Step 2 of the module docstring on one cluster of configuration `name`."""
    from deploy.config import load_cluster_config
    from deploy.launcher import launch_local_cluster
    from tooling.goodput.clusters import EngineSizing, cluster_settings

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    sizing = EngineSizing(context=2048, num_kv_blocks=512, max_num_seqs=8)
    extra = {
        "router.http_port": 0,
        "router.default_timeout_s": 600.0,
        "engine.dtype": args.dtype,
        # both requests of a pair prefill the whole prompt: no cached prefix decides the first
        # tokens' numerics for one of them (bfloat16 chunk boundaries move near-ties)
        "engine.enable_prefix_caching": False,
        "engine.speculative": speculative_table(args),
    }
    cfg = load_cluster_config(None, cluster_settings(name, model, sizing, args.threads, **extra))
    cluster = launch_local_cluster(cfg, out / f"logs-{name}", port=0)
    try:
        url = cluster.http_url
        assert url is not None
        served = served_model(url)
        metrics = decoding_metrics_url(cluster)
        result: dict[str, Any] = {}
        for workload in args.workloads:
            reqs = bodies(workload, args, vocab)
            stream(f"{url}/{reqs[0][0]}", {**reqs[0][1], "model": served, "max_tokens": 4})  # warm
            before = spec_counters(metrics)
            pairs = []
            for i, (endpoint, body) in enumerate(reqs):
                got: dict[bool, dict[str, Any]] = {}
                for on in (True, False) if i % 2 == 0 else (False, True):
                    got[on] = stream(
                        f"{url}/{endpoint}", {**body, "model": served, "speculative": on}
                    )
                pairs.append({"spec": got[True], "off": got[False]})
                say(
                    f"{name} {workload} {i}: TPOT {got[True]['tpot_ms']:.1f} / "
                    f"{got[False]['tpot_ms']:.1f} ms, {got[True]['tokens']} tokens in "
                    f"{got[True]['messages']} / {got[False]['messages']} messages"
                )
            after = spec_counters(metrics)
            result[workload] = summarize(pairs, before, after)
            say(f"{name} {workload}: {json.dumps(result[workload])}")
        return result
    finally:
        cluster.stop()


def summarize(
    pairs: list[dict[str, dict[str, Any]]], before: dict[str, float], after: dict[str, float]
) -> dict[str, Any]:
    d = {k.split("num_")[-1].removesuffix("_total"): after[k] - before.get(k, 0.0) for k in after}
    spec = [p["spec"]["tpot_ms"] for p in pairs]
    off = [p["off"]["tpot_ms"] for p in pairs]
    return {
        "requests": len(pairs),
        "tokens": sum(p["spec"]["tokens"] for p in pairs),
        "tpot_spec_ms": statistics.median(spec),
        "tpot_off_ms": statistics.median(off),
        "ratio_of_medians": statistics.median(spec) / statistics.median(off),
        "median_pair_ratio": statistics.median(s / o for s, o in zip(spec, off, strict=True)),
        "acceptance_rate": d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else 0,
        "mean_acceptance_length": 1 + d["accepted_tokens"] / d["drafts"] if d["drafts"] else 1,
        "drafts": d["drafts"],
        "draft_tokens": d["draft_tokens"],
        "accepted_tokens": d["accepted_tokens"],
        "identical_answers": sum(p["spec"]["text"] == p["off"]["text"] for p in pairs),
        "pairs": [{k: {**v, "text": v["text"][:80]} for k, v in p.items()} for p in pairs],
    }


def run_llamacpp(args: argparse.Namespace, model: Path, out: Path) -> dict[str, Any]:
    """Step 3 of the module docstring: llama-server's quoting TPOT at each thread count and
    speculation setting (`--spec-type`: its own prompt-lookup proposers; "none": off)."""
    from benchmarks import bench_llamacpp as lc

    binary, gguf = lc.build_server(), lc.f16_gguf(model)
    result: dict[str, Any] = {}
    for threads in args.llamacpp_threads:
        for spec in args.llamacpp_spec:
            name = f"{threads} thread(s), spec-type {spec}"
            extra = [] if spec == "none" else ["--spec-type", spec]
            server, url = lc.start_server(
                binary, gguf, threads, 1, 4096, out / f"llama-server-{threads}-{spec}.log", extra
            )
            try:
                reqs = bodies("quoting", args, 0)
                warm = {**reqs[0][1], "model": "smollm2", "max_tokens": 4}
                stream(f"{url}/v1/{reqs[0][0]}", warm)
                runs = [stream(f"{url}/v1/{e}", {**b, "model": "smollm2"}) for e, b in reqs]
            finally:
                server.terminate()
                server.wait(timeout=30)
            tpot = statistics.median(r["tpot_ms"] for r in runs)
            result[name] = {"tpot_ms": tpot, "tokens": sum(r["tokens"] for r in runs)}
            say(f"llama.cpp, {name}: quoting TPOT {tpot:.1f} ms")
    return result


def render(result: dict[str, Any]) -> str:
    lines = [
        f"Speculative decoding ({result['speculative']}), single stream, {result['dtype']}, "
        f"{result['threads']} threads per target, {result['started']}",
        "",
        "| topology | workload | TPOT spec ms | TPOT off ms | spec / off (median of pairs) "
        "| acceptance rate | mean acceptance length | drafts / tokens | identical answers |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for topo, per in result["topologies"].items():
        for wl, r in per.items():
            lines.append(
                f"| {topo} | {wl} | {r['tpot_spec_ms']:.1f} | {r['tpot_off_ms']:.1f} | "
                f"{r['ratio_of_medians']:.2f}x ({r['median_pair_ratio']:.2f}x) | "
                f"{r['acceptance_rate']:.2f} | {r['mean_acceptance_length']:.2f} | "
                f"{r['drafts']:.0f} / {r['tokens']} | {r['identical_answers']}/{r['requests']} |"
            )
    lc = result.get("llamacpp")
    if lc:
        best = min(v["tpot_ms"] for v in lc.values())
        lines += ["", "llama.cpp quoting TPOT: " + ", ".join(
            f"{t} {v['tpot_ms']:.1f} ms" for t, v in lc.items()
        ) + f"; best {best:.1f} ms"]  # fmt: skip
        for topo, per in result["topologies"].items():
            if "quoting" in per:
                ratio = per["quoting"]["tpot_spec_ms"] / best
                lines.append(f"- pdserve {topo} with speculation / llama.cpp best: {ratio:.2f}x")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2, help="total torch threads per target")
    ap.add_argument("--topologies", default="colocated,disagg", type=lambda s: s.split(","))
    ap.add_argument("--workloads", default="quoting,random", type=lambda s: s.split(","))
    ap.add_argument("--method", default="ngram", choices=["ngram", "draft"])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--draft", help="draft model folder (--method draft)")
    ap.add_argument("--requests", type=int, default=8, help="request pairs per workload")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128, help="random workload's prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llamacpp", action="store_true", help="also llama-server (F16 GGUF)")
    ap.add_argument(
        "--llamacpp-threads", default="1,2", type=lambda s: [int(x) for x in s.split(",")]
    )
    ap.add_argument(
        "--llamacpp-spec",
        default="none,ngram-simple,ngram-mod",
        type=lambda s: s.split(","),
        help="llama-server --spec-type values to try (none: no speculation)",
    )
    ap.add_argument(
        "--out",
        default=f"runs/spec-{time.strftime('%Y%m%d-%H%M%S')}",
        help="run folder (default: runs/spec-YYYYmmdd-HHMMSS)",
    )
    args = ap.parse_args(argv)
    if args.method == "draft" and not args.draft:
        ap.error("--method draft needs --draft DIR")
    model = Path(args.model).resolve()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "benchmark": "speculative",
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": str(model),
        "dtype": args.dtype,
        "threads": args.threads,
        "speculative": speculative_table(args),
        "max_tokens": args.max_tokens,
        "topologies": {},
    }
    for name in args.topologies:
        result["topologies"][name] = run_topology(name, args, model, out)
    if args.llamacpp:
        result["llamacpp"] = run_llamacpp(args, model, out)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    table = render(result)
    (out / "result.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
