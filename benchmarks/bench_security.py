"""What TLS and authentication cost a request: TTFT and a 64-token stream, secured vs plain.

Runs as its own process: ``python -m benchmarks.bench_security [--requests 200]`` from the
repository root. Three local clusters run side by side (`deploy.launcher`: router and worker
processes, 1 prefill + 1 decode on the tiny random model, where a token costs little next to
the hops, so the security work shows as much as it ever will):

- ``plain``:  plaintext API, no token, workers without a cluster secret;
- ``secure``: TLS + a bearer token on the API, the cluster secret on every worker call and
  every KV rendezvous record (workers over plaintext gRPC);
- ``mtls``:   ``secure`` plus mutual TLS between the router and the workers.

This process is the client (grpc.aio; TLS + token through `ClientSecurity`). Request i goes
to every cluster, in a random order per round, one at a time, so the clusters share the
machine's state round by round; each cluster's first `--warmup` rounds are dropped (TLS
handshakes, KV pair joins). Reported per cluster: TTFT and end-to-end p50/p99 (client clock),
and per secured cluster the median of the per-round differences against ``plain``.
Certificates are minted at start (`trustme`, a test dependency); output: a table on stderr
and JSON in `--out` (default runs/bench/security.json).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from proto.pdserve.v1 import inference_pb2, inference_pb2_grpc
from security.channels import ClientSecurity

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("plain", "secure", "mtls")
OPTIONS = [("grpc.enable_http_proxy", 0)]


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _certs(folder: Path) -> dict[str, Path]:
    """A CA, the router's certificate (127.0.0.1) and the cluster certificate."""
    try:
        import trustme
    except ImportError:  # a test dependency: `pip install -e ".[test]"`
        sys.exit("bench_security needs trustme (pip install -e '.[test]')")
    ca = trustme.CA()
    out = {"ca": folder / "ca.pem"}
    ca.cert_pem.write_to_path(str(out["ca"]))
    for name, hosts in (("server", ("127.0.0.1", "localhost")), ("cluster", ("pdserve-internal",))):
        cert = ca.issue_cert(*hosts)
        out[name] = folder / f"{name}.pem"
        out[f"{name}_key"] = folder / f"{name}.key"
        cert.cert_chain_pems[0].write_to_path(str(out[name]))
        cert.private_key_pem.write_to_path(str(out[f"{name}_key"]))
    return out


def _start(name: str, model: Path, certs: dict[str, Path], tokens: Path, logs: Path) -> Any:
    """One cluster (a `LocalCluster`) and how to dial it."""
    from deploy.config import load_cluster_config
    from deploy.launcher import launch_local_cluster

    overrides: dict[str, Any] = {
        "model": str(model),
        "mode": "disagg",
        "launcher": "process",
        "router.port": 0,
        "engine": {"block_size": 16, "num_kv_blocks": 256, "max_num_seqs": 8},
    }
    client = ClientSecurity()
    if name != "plain":
        overrides |= {
            "security.tls_cert": str(certs["server"]),
            "security.tls_key": str(certs["server_key"]),
            "security.auth_token_file": str(tokens),
        }
        client = ClientSecurity(tls_ca=certs["ca"], auth_token_file=tokens)
    if name == "mtls":
        overrides["security.internal"] = {
            "tls_cert": str(certs["cluster"]),
            "tls_key": str(certs["cluster_key"]),
            "tls_ca": str(certs["ca"]),
        }
    config = load_cluster_config(None, overrides)
    if name == "plain":
        return _start_plain(config, logs / name), client
    return launch_local_cluster(config, logs / name, client=client), client


class _PlainCluster:
    """The baseline as pdserve ran before it had security: workers started without a cluster
    secret (`launch_workers` always hands one), a plaintext router that sends none."""

    def __init__(self, workers: list[Any], router: Any) -> None:
        self.workers, self.router = workers, router
        self.address = router.address

    def stop(self) -> None:
        self.router.stop()
        for w in self.workers:
            w.stop()


def _start_plain(config: Any, logs: Path) -> _PlainCluster:
    from deploy.launcher import launch_router_process, write_document
    from worker.process import WorkerProcess

    workers: list[Any] = []
    try:
        addresses: dict[str, list[str]] = {"prefill": [], "decode": []}
        for wid, role in config.worker_roles():
            doc = config.worker_config(wid, role, "127.0.0.1").model_dump_json()
            path = write_document(logs, f"worker-{wid}", doc)
            workers.append(WorkerProcess.spawn(["--config", str(path), "--log-level", "WARNING"]))
            addresses[role].append(workers[-1].address)
        router = launch_router_process(config.router_config(addresses, port=0), logs)
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return _PlainCluster(workers, router)


async def _one(stub: Any, prompt: list[int], max_tokens: int, rid: str) -> tuple[float, float]:
    req = inference_pb2.GenerateRequest(request_id=rid)
    req.token_ids.ids.extend(prompt)
    req.sampling.max_tokens = max_tokens
    req.sampling.temperature = 0.0
    req.sampling.ignore_eos = True
    t0 = time.perf_counter()
    first = None
    n = 0
    async for resp in stub.Generate(req, timeout=120):
        if resp.token_ids and first is None:
            first = time.perf_counter()
        n += len(resp.token_ids)
    end = time.perf_counter()
    if first is None or n != max_tokens:
        raise RuntimeError(f"{rid}: {n} of {max_tokens} tokens")
    return first - t0, end - t0


async def measure(
    args: argparse.Namespace, targets: dict[str, tuple[str, ClientSecurity]]
) -> dict[str, Any]:
    """Interleaved rounds over every cluster; per-cluster samples in ms."""
    samples: dict[str, dict[str, list[float]]] = {n: {"ttft": [], "e2e": []} for n in targets}
    async with contextlib.AsyncExitStack() as stack:
        stubs = {}
        for name, (address, client) in targets.items():
            channel = client.aio_channel(address, OPTIONS)
            stack.push_async_callback(channel.close)
            stubs[name] = inference_pb2_grpc.InferenceStub(channel)  # type: ignore[no-untyped-call]
        prompt = list(range(10, 10 + args.prompt_tokens))
        rng = random.Random(0)
        for i in range(args.warmup + args.requests):
            order = list(targets)
            rng.shuffle(order)
            for name in order:
                ttft, e2e = await _one(stubs[name], prompt, args.max_tokens, f"{name}-{i}")
                if i >= args.warmup:
                    samples[name]["ttft"].append(ttft * 1e3)
                    samples[name]["e2e"].append(e2e * 1e3)
    out: dict[str, Any] = {}
    for name, s in samples.items():
        row: dict[str, float] = {}
        for metric, xs in s.items():
            row[f"{metric}_p50_ms"] = _quantile(xs, 0.5)
            row[f"{metric}_p99_ms"] = _quantile(xs, 0.99)
            if name != "plain":
                base = samples["plain"][metric]
                row[f"{metric}_paired_diff_median_ms"] = statistics.median(
                    a - b for a, b in zip(xs, base, strict=True)
                )
        out[name] = row
    return out


def _table(r: dict[str, Any]) -> str:
    lines = [
        f"TLS + auth cost ({r['requests']} rounds, {r['prompt_tokens']} prompt / "
        f"{r['max_tokens']} output tokens, tiny model, 1P+1D), ms",
        f"{'cluster':<8} {'TTFT p50':>9} {'p99':>8} {'diff':>7} {'E2E p50':>9} {'p99':>8} "
        f"{'diff':>7}",
    ]
    for name in CONFIGS:
        row = r["results"].get(name)
        if row is None:
            continue
        dt = row.get("ttft_paired_diff_median_ms", 0.0)
        de = row.get("e2e_paired_diff_median_ms", 0.0)
        lines.append(
            f"{name:<8} {row['ttft_p50_ms']:9.2f} {row['ttft_p99_ms']:8.2f} {dt:7.2f} "
            f"{row['e2e_p50_ms']:9.2f} {row['e2e_p99_ms']:8.2f} {de:7.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: build tiny)")
    ap.add_argument("--requests", type=int, default=200, help="measured rounds")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {CONFIGS}")
    ap.add_argument("--out", type=Path, default="runs/bench/security.json")
    args = ap.parse_args(argv)
    names = [n for n in args.configs.split(",") if n]
    if "plain" not in names or not set(names) <= set(CONFIGS):
        ap.error(f"--configs must include 'plain' and come from {CONFIGS}")
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.model is None:
            from tooling.models.random_model import make_random_model

            args.model = make_random_model(tmp / "tiny", "tiny", seed=0)
        certs = _certs(tmp)
        tokens = tmp / "tokens"
        tokens.write_text("bench-token\n")
        clusters = []
        try:
            targets = {}
            for name in names:
                cluster, client = _start(name, args.model, certs, tokens, tmp / "logs")
                clusters.append(cluster)
                targets[name] = (cluster.address, client)
            results = asyncio.run(measure(args, targets))
        finally:
            for c in clusters:
                c.stop()
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "requests": args.requests,
        "warmup": args.warmup,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "results": results,
    }
    print(_table(report), file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
