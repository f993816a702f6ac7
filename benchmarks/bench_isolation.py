"""Blast radius of a deadline storm: how many *normal* requests fail when other clients send
requests with deadlines too short to finish (issue 26, defect 1).

Runs as its own process: ``python -m benchmarks.bench_isolation [--topology 1p1d|1p2d]
[--rounds 3] [--out runs/bench/isolation]`` from the repository root. The cluster is started
with the product launcher (`deploy.launcher.launch_local_cluster`, worker processes without
Ray, on the tiny random model unless `--model`); this process is the client.

Each round sends, all at once on the router's gRPC port:

- 10 normal `Generate` calls: prompt ``"The river flows " * 30``, ``max_tokens=100``,
  ``ignore_eos``, no deadline of their own (a 120 s client timeout);
- 10 storm calls, the same prompt, with deadlines of 5, 15, ..., 95 ms.

Reported per round: the normal calls that did not complete with all 100 tokens (and their
status codes), the storm calls' codes, the router log's "marked unhealthy" lines for a
decode worker during the round, and whether every worker's free KV blocks came back to their
start values within 15 s. The blast radius is the failed normal calls per storm. Output: a line
per round on stderr and JSON (`--out DIR/isolation-<topology>[-<label>].json`, the cluster's logs in
`DIR/logs-<topology>[-<label>]/`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from deploy.client import CHANNEL_OPTIONS, build_request
from deploy.config import load_cluster_config
from deploy.launcher import LocalCluster, launch_local_cluster
from proto.pdserve.v1 import inference_pb2_grpc, worker_pb2, worker_pb2_grpc

PROMPT = "The river flows " * 30
NORMAL, STORM = 10, 10
MAX_TOKENS = 100


async def _call(stub: Any, tag: str, timeout_s: float) -> tuple[str, int]:
    """(status code name with its details when not OK, tokens received) of one call."""
    req = build_request(prompt=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, request_id=tag)
    n = 0
    try:
        async for resp in stub.Generate(req, timeout=timeout_s):
            n += len(resp.token_ids)
    except grpc.aio.AioRpcError as exc:
        return f"{exc.code().name}: {exc.details()}", n
    return "OK", n


async def _round(address: str, rnd: int) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(address, CHANNEL_OPTIONS) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)  # type: ignore[no-untyped-call]
        normal = [_call(stub, f"n{rnd}-{i}", 120.0) for i in range(NORMAL)]
        storm = [_call(stub, f"s{rnd}-{i}", (5 + 10 * i) / 1000) for i in range(STORM)]
        got = await asyncio.gather(*normal, *storm)
    normal_got, storm_got = got[:NORMAL], got[NORMAL:]
    failed = [(code, n) for code, n in normal_got if code != "OK" or n != MAX_TOKENS]
    storm_codes: dict[str, int] = {}
    for code, _ in storm_got:
        name = code.split(":")[0]
        storm_codes[name] = storm_codes.get(name, 0) + 1
    return {
        "normal_failed": len(failed),
        "normal_failures": [f"{code} after {n} tokens" for code, n in failed],
        "storm_codes": storm_codes,
    }


def _free_blocks(cluster: LocalCluster) -> dict[str, int]:
    internal = cluster.workers.internal
    out = {}
    for w in cluster.workers.workers:
        with internal.channel(w.address, CHANNEL_OPTIONS) as ch:
            stub = internal.stub(worker_pb2_grpc.WorkerStub(ch))  # type: ignore[no-untyped-call]
            out[w.address] = stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5.0).free_blocks
    return out


def _blocks_back(cluster: LocalCluster, start: dict[str, int], within_s: float) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if _free_blocks(cluster) == start:
            return True
        time.sleep(0.2)
    return False


def _unhealthy_lines(log_dir: Path) -> list[str]:
    return [
        line.strip()
        for log in sorted(log_dir.glob("router*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if "marked unhealthy" in line
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: a fresh tiny random model)")
    p.add_argument("--topology", default="1p1d", choices=["1p1d", "1p2d"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--label", default="", help="free text stored with the result (e.g. before)")
    p.add_argument("--out", default="runs/bench/isolation")
    args = p.parse_args(argv)
    model = Path(args.model) if args.model else None
    if model is None:
        from tooling.models.random_model import make_random_model

        model = make_random_model(Path(tempfile.mkdtemp(prefix="isolation-")), "tiny", seed=0)
    config = load_cluster_config(None, {
        "model": str(model), "mode": "disagg", "launcher": "process",
        "workers.prefill": 1, "workers.decode": int(args.topology[2]),
        "router.port": 0, "engine": {"block_size": 16, "num_kv_blocks": 512},
    })  # fmt: skip
    rounds = []
    out = Path(args.out)
    logs = out / f"logs-{args.topology}{'-' + args.label if args.label else ''}"
    logs.mkdir(parents=True, exist_ok=True)
    # The cluster's logs stay beside the result.
    cluster = launch_local_cluster(config, logs, port=0)
    try:
        start = _free_blocks(cluster)
        for rnd in range(args.rounds):
            seen = len(_unhealthy_lines(Path(logs)))
            r = asyncio.run(_round(cluster.address, rnd))
            r["blocks_back"] = _blocks_back(cluster, start, 15.0)
            r["unhealthy"] = _unhealthy_lines(Path(logs))[seen:]
            rounds.append(r)
            print(
                f"round {rnd}: normal failed {r['normal_failed']}/{NORMAL} "
                f"{r['normal_failures'][:2]}; storm {r['storm_codes']}; unhealthy marks "
                f"{len(r['unhealthy'])}; blocks back {r['blocks_back']}",
                file=sys.stderr,
            )
    finally:
        cluster.stop()
    result = {
        "args": vars(args),
        "rounds": rounds,
        "normal_failed_per_storm": [r["normal_failed"] for r in rounds],
        "unhealthy_marks": sum(len(r["unhealthy"]) for r in rounds),
        "blocks_back": all(r["blocks_back"] for r in rounds),
    }
    name = f"isolation-{args.topology}{'-' + args.label if args.label else ''}.json"
    (out / name).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("normal_failed_per_storm", "unhealthy_marks",
                                             "blocks_back")}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
