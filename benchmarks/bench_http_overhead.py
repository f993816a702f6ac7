"""Latency the OpenAI HTTP front adds over the gRPC API, on the same prompts and the same router.

Runs as its own process: ``python -m benchmarks.bench_http_overhead [--requests 200]`` from the
repository root. A real cluster of the tiny random model (one prefill and one decode worker
process, ``python -m router --http-port 0``; about 1 M parameters, so a token costs little next
to the hops) serves both APIs from one router process; this process is the client, one request
at a time (unloaded), with a fresh random token-id prompt per pair:

- gRPC: `Generate` (grpc.aio), streamed;
- HTTP: ``POST /v1/completions`` with ``stream: true`` (aiohttp), the same token ids,
  ``max_tokens``, greedy, ``ignore_eos``; the SSE body is read chunk by chunk.

Both ask for ``logprobs: 0`` (each token's own logprob; ``--no-logprobs`` turns it off): the HTTP
front, like OpenAI and vLLM, sends no chunk for a token whose text is still incomplete (a
random token id is often a lone UTF-8 byte), so without logprobs its first chunk can come a
token later than gRPC's first message for reasons that are not the transport's.

Each pair runs back to back in random order (interleaved), so a worker's varying speed hits
both sides alike. TTFT = send -> the first message with a token (gRPC) / the first SSE chunk
with a token (HTTP); end to end = send -> the stream's end (the final message / ``[DONE]``).
Reported: p50/p99 of each, the overhead (HTTP - gRPC) at each quantile, and the median and p99
of the per-pair differences. Output: a table on stderr and JSON in
``runs/bench/http_overhead.json`` (``--out FILE``; ``--out -`` for stdout).
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

import aiohttp
import grpc

from benchmarks.bench_router_overhead import _make_model, _quantile
from benchmarks.output import write_json
from deploy.config import load_cluster_config
from deploy.launcher import launch_local_cluster
from proto.pdserve.v1 import inference_pb2, inference_pb2_grpc
from tooling.goodput.openai_load import completion_body


async def _grpc(
    stub: Any, prompt: list[int], max_tokens: int, logprobs: bool
) -> tuple[float, float, int]:
    req = inference_pb2.GenerateRequest(
        sampling=inference_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
    )
    if logprobs:
        req.sampling.logprobs = 0
    req.token_ids.ids.extend(prompt)
    t0 = time.perf_counter()
    ttft = None
    n = 0
    async for resp in stub.Generate(req, timeout=30):
        if resp.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        n += len(resp.token_ids)
    end = time.perf_counter() - t0
    assert ttft is not None
    return ttft, end, n


async def _http(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    logprobs: bool,
) -> tuple[float, float, int]:
    body = completion_body(model, prompt, max_tokens)
    if logprobs:
        body["logprobs"] = 0
    t0 = time.perf_counter()
    ttft = None
    n = 0
    async with session.post(f"{url}/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            if not raw.startswith(b"data: "):
                continue
            data = raw[6:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            choice = chunk["choices"][0] if chunk["choices"] else {}
            has_token = choice.get("text") or (choice.get("logprobs") or {}).get("tokens")
            if has_token and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    end = time.perf_counter() - t0
    assert ttft is not None
    return ttft, end, n


async def measure(
    grpc_addr: str,
    http_url: str,
    model: str,
    n: int,
    prompt_len: int,
    max_tokens: int,
    seed: int,
    logprobs: bool = True,
) -> dict[str, list[float]]:
    """`n` interleaved pairs (after 10 discarded warm-up pairs); seconds per request."""
    rng = random.Random(seed)
    out: dict[str, list[float]] = {
        k: [] for k in ("grpc_ttft", "grpc_e2e", "http_ttft", "http_e2e")
    }
    async with grpc.aio.insecure_channel(grpc_addr, [("grpc.enable_http_proxy", 0)]) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)  # type: ignore[no-untyped-call]
        async with aiohttp.ClientSession() as session:
            for i in range(n + 10):
                prompt = [rng.randrange(4, 1000) for _ in range(prompt_len)]
                sides = ["grpc", "http"]
                rng.shuffle(sides)
                for side in sides:
                    if side == "grpc":
                        ttft, e2e, got = await _grpc(stub, prompt, max_tokens, logprobs)
                    else:
                        ttft, e2e, got = await _http(
                            session, http_url, model, prompt, max_tokens, logprobs
                        )
                    assert got == max_tokens, (side, got)
                    if i >= 10:
                        out[f"{side}_ttft"].append(ttft)
                        out[f"{side}_e2e"].append(e2e)
    return out


def summarize(samples: dict[str, list[float]]) -> dict[str, Any]:
    """p50/p99 per API and metric (ms), overhead at each quantile, per-pair differences."""
    ms = {k: [x * 1e3 for x in v] for k, v in samples.items()}
    out: dict[str, Any] = {}
    for metric in ("ttft", "e2e"):
        g, h = ms[f"grpc_{metric}"], ms[f"http_{metric}"]
        diffs = [b - a for a, b in zip(g, h, strict=True)]
        row = {}
        for q in (0.5, 0.99):
            tag = f"p{round(q * 100)}"
            row[f"grpc_{tag}_ms"] = round(_quantile(g, q), 3)
            row[f"http_{tag}_ms"] = round(_quantile(h, q), 3)
            row[f"overhead_{tag}_ms"] = round(_quantile(h, q) - _quantile(g, q), 3)
        row["pair_diff_median_ms"] = round(statistics.median(diffs), 3)
        row["pair_diff_p99_ms"] = round(_quantile(diffs, 0.99), 3)
        out[metric] = row
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200, help="pairs measured (after 10 warm-up)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--logprobs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask both APIs for logprobs=0, so every token is one message / chunk",
    )
    p.add_argument("--model", help="model folder (default: a fresh tiny random model)")
    p.add_argument(
        "--out", default="runs/bench/http_overhead.json", help="write the JSON here (- for stdout)"
    )
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
        model = Path(args.model) if args.model else _make_model(Path(tmp) / "tiny")
        config = load_cluster_config(
            None,
            {
                "model": str(model),
                "mode": "disagg",
                "launcher": "process",
                "engine": {"block_size": 16, "num_kv_blocks": 512},
            },
        )
        cluster = launch_local_cluster(config, Path(tmp) / "logs", port=0, http_port=0)
        try:
            url = cluster.router.http_url
            assert url is not None
            samples = asyncio.run(
                measure(
                    cluster.address, url, model.name, args.requests, args.prompt_len,
                    args.max_tokens, args.seed, args.logprobs,
                )
            )  # fmt: skip
        finally:
            cluster.stop()
    result = {
        "benchmark": "bench_http_overhead",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "logprobs": args.logprobs,
        "summary": summarize(samples),
    }
    for metric, row in result["summary"].items():
        print(
            f"{metric:>4}: gRPC p50 {row['grpc_p50_ms']:.2f} p99 {row['grpc_p99_ms']:.2f} ms | "
            f"HTTP p50 {row['http_p50_ms']:.2f} p99 {row['http_p99_ms']:.2f} ms | overhead "
            f"p50 {row['overhead_p50_ms']:+.2f} p99 {row['overhead_p99_ms']:+.2f} ms, per pair "
            f"median {row['pair_diff_median_ms']:+.2f} ms",
            file=sys.stderr,
        )
    write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
