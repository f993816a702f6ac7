"""Step 5, transfer: a prefill and a decode worker on ONE GPU handing off KV through the
same-host plane (`kvtransfer.cuda_ipc`: NCCL cannot run two ranks on one device).

1. Plane throughput: this process makes a KV cache of the 1B model's layout, exports it
   (`kvtransfer.same_host.share_cache`), and a second process maps it (`map_offer`), copies
   half its blocks layer by layer with `copy_layer` (one run, then scattered blocks), checks
   the bytes (an integer checksum of the source blocks), and times a device memcpy of the same
   bytes. Reports GB/s of both. What is timed: whole transfers on the receiving side (every
   layer's `copy_layer`, with its per-layer stream synchronization), each into fresh
   destination blocks, after the mapping is open; not the process start, the handshake or
   the sender's per-layer notifications. `copy_*_GBps` is the best of the transfers after
   the first (steady state), `copy_*_first_GBps` the first.
2. Fidelity: a 1P1D cluster (`deploy.launcher`, plain processes, ``engine.device = "cuda"``,
   ``transfer.shared_memory = true``) on the `tiny` model in float32; greedy tokens through the
   router equal the colocated engine in this process on the same GPU (near-tie rule of
   tests/e2e: `E2E_TIE_TOL`).

Dry run: the same on the CPU — memfd instead of CUDA IPC, a CPU cluster, smaller caches.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpucheck.common import Ctx, StepReport, model_dir, sync, write_json
from benchmarks.gpucheck.engine import LENGTHS, MAX_TOKENS, prompts

E2E_TIE_TOL = 1e-3
CHILD_TIMEOUT_S = 90.0
REPEATS = 4  # timed transfers per case: the first (cold: mapping, stream) reported apart


def run(ctx: Ctx) -> StepReport:
    rep = StepReport()
    _plane(ctx, rep)
    _cluster(ctx, rep)
    if not ctx.dry_run:
        rep.note("NCCL between two GPUs (different devices) is not exercised: one GPU here")
    return rep


# ---- 1. the plane --------------------------------------------------------------------------


def _layout_config(ctx: Ctx) -> Path:
    """A config.json of the 1B layout (GPU) or a small one (dry run): KVCache needs only that."""
    from benchmarks.gpucheck.speed import DRY_SHAPE, GPU_SHAPE
    from tooling.models.random_model import RandomModelPreset, hf_config

    s = DRY_SHAPE if ctx.dry_run else GPU_SHAPE
    out = ctx.work / "models" / ("layout-dry" if ctx.dry_run else "layout-1b")
    out.mkdir(parents=True, exist_ok=True)
    p = RandomModelPreset(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.inter,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        corpus_words=0,
    )
    write_json(out / "config.json", hf_config(p, s.vocab, "bfloat16"))
    return out


def _cache(cfg_dir: Path, num_blocks: int, device: torch.device) -> Any:
    from model_runtime.config import ModelConfig
    from model_runtime.kv_cache import KVCache

    return KVCache(ModelConfig.from_model_dir(cfg_dir), num_blocks, 16, torch.bfloat16, device)


def _checksum(kv: torch.Tensor, ids: list[int]) -> int:
    """An exact integer checksum of blocks `ids` of every layer."""
    idx = torch.tensor(ids, device=kv.device)
    return int(kv.index_select(1, idx).contiguous().view(torch.int16).to(torch.int64).sum())


def _plane(ctx: Ctx, rep: StepReport) -> None:
    from kvtransfer.same_host import offer_kind, share_cache

    cfg_dir = _layout_config(ctx)
    num_blocks = 64 if ctx.dry_run else 1024
    cache = _cache(cfg_dir, num_blocks, ctx.device)
    gen = torch.Generator(device=ctx.device).manual_seed(5)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen, device=ctx.device))
    offer = share_cache(cache)
    exported = offer is not None
    why = "offer made" if exported else "no offer: the log says why"
    if not rep.check("cache exported", exported, why):
        return
    assert offer is not None
    record = offer.to_dict()
    rep.metric("plane", offer_kind(record))
    half = num_blocks // 2
    src_run = list(range(1, half + 1))
    src_scattered = [int(x) for x in torch.randperm(num_blocks - 1)[:half] + 1]
    # each timed transfer gets its own destination blocks (a new transfer: no plan reused)
    job = {
        "offer": record,
        "config": str(cfg_dir),
        "num_blocks": num_blocks,
        "device": str(ctx.device),
        "cases": {
            "run": [src_run, [list(range(half - r, 2 * half - r)) for r in range(REPEATS)]],
            "scattered": [
                src_scattered,
                [[int(x) for x in torch.randperm(num_blocks)[:half]] for _ in range(REPEATS)],
            ],
        },
        "checksums": {
            "run": _checksum(cache.kv, src_run),
            "scattered": _checksum(cache.kv, src_scattered),
        },
    }
    sync(ctx.device)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpucheck.transfer", "--child"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    print(proc.stderr[-3000:], flush=True)
    if not rep.check("receiver process", proc.returncode == 0, f"exit {proc.returncode}"):
        return
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if res.get("error"):
        rep.check("receiver mapped the cache", False, res["error"])
        return
    for name, r in res["cases"].items():
        rep.check(f"copy {name} bytes equal", r["checksum_ok"], f"{r['bytes'] / 1e6:.1f} MB")
        rep.metric(f"copy_{name}_GBps", _gbps(r["GBps"]))
        rep.metric(f"copy_{name}_first_GBps", _gbps(r["first_GBps"]))
    rep.metric("memcpy_same_bytes_GBps", _gbps(res["memcpy_GBps"]))
    for name, r in res["cases"].items():  # unrounded speeds: a slow CPU's memcpy is not 0
        rep.metric(f"plane_vs_memcpy_{name}", round(r["GBps"] / res["memcpy_GBps"], 3))


def _gbps(x: float) -> float:
    """GB/s for the report: one decimal, three significant digits below 1."""
    return round(x, 1) if x >= 1 else float(f"{x:.3g}")


def child_main() -> int:
    """The receiving process of `_plane`: map the offer, copy, check, time; one JSON line."""
    from kvtransfer.same_host import map_offer
    from kvtransfer.shm import ShmUnavailable

    job = json.loads(sys.stdin.read())
    dev = torch.device(job["device"])
    cache = _cache(Path(job["config"]), job["num_blocks"], dev)
    try:
        peer = map_offer(job["offer"], cache)
    except ShmUnavailable as exc:
        print(json.dumps({"error": f"map_offer: {exc}"}))
        return 0
    out: dict[str, Any] = {"cases": {}}
    layers = cache.num_layers
    nbytes = 0
    for name, (src, dsts) in job["cases"].items():
        times = []
        for dst in dsts:  # one transfer each: all layers, as `kvtransfer.dist_recv` copies them
            sync(dev)
            t0 = time.perf_counter()
            for layer in range(layers):
                peer.copy_layer(layer, src, cache, dst)
            times.append(time.perf_counter() - t0)
        per_block = cache.kv[0, 0].numel() * cache.kv.element_size()
        nbytes = layers * len(src) * per_block
        steady = max(min(times[1:]), 1e-9)  # a timer tick, not zero
        ok = _checksum(cache.kv, dsts[-1]) == job["checksums"][name]
        out["cases"][name] = {
            "GBps": nbytes / steady / 1e9,
            "first_GBps": nbytes / max(times[0], 1e-9) / 1e9,
            "bytes": nbytes,
            "checksum_ok": ok,
        }
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    times = []
    for _ in range(4):
        sync(dev)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(dev)
        times.append(time.perf_counter() - t0)
    out["memcpy_GBps"] = nbytes / max(min(times[1:]), 1e-9) / 1e9
    print(json.dumps(out))
    return 0


# ---- 2. a 1P1D cluster on the device -------------------------------------------------------


def _cluster(ctx: Ctx, rep: StepReport) -> None:
    import grpc

    from deploy.client import CHANNEL_OPTIONS, build_request
    from deploy.config import load_cluster_config
    from deploy.launcher import launch_local_cluster
    from model_runtime.config import ModelConfig
    from proto.pdserve.v1 import inference_pb2_grpc

    mdir = model_dir(ctx, "tiny")
    ps = prompts(ModelConfig.from_model_dir(mdir).vocab_size)
    engine = {
        "block_size": 16,
        "num_kv_blocks": 512,
        "max_num_batched_tokens": 512,
        "max_num_seqs": 64,
        "device": ctx.device.type,
        "dtype": "float32",
    }
    config = load_cluster_config(
        None,
        {
            "model": str(mdir),
            "mode": "disagg",
            "launcher": "process",
            "engine": engine,
            "router.port": 0,
            "router.default_timeout_s": 60.0,
            "transfer.timeout_s": 30.0,
            "transfer.shared_memory": True,
            "workers.prefill": 1,
            "workers.decode": 1,
        },
    )
    logs = Path(tempfile.mkdtemp(prefix="gpu-check-cluster-", dir=ctx.work))
    t0 = time.perf_counter()
    try:
        cluster = launch_local_cluster(config, logs, timeout_s=120.0, port=0)
    except Exception as exc:  # reported with the worker logs' tails
        rep.check("1P1D cluster started", False, f"{type(exc).__name__}: {exc}")
        _log_tails(logs)
        return
    rep.metric("cluster_start_s", round(time.perf_counter() - t0, 1))
    got: list[list[int]] = []
    try:
        with grpc.insecure_channel(cluster.address, CHANNEL_OPTIONS) as ch:
            stub = inference_pb2_grpc.InferenceStub(ch)  # type: ignore[no-untyped-call]
            t0 = time.perf_counter()
            for p in ps:
                req = build_request(token_ids=p, max_tokens=MAX_TOKENS, temperature=0.0)
                toks: list[int] = []
                for resp in stub.Generate(req, timeout=60.0):
                    toks.extend(resp.token_ids)
                got.append(toks)
            rep.metric("cluster_requests_s", round(time.perf_counter() - t0, 2))
    except grpc.RpcError as exc:
        rep.check("1P1D requests", False, f"{exc.code()}: {exc.details()}")
    finally:
        cluster.stop(grace_s=5.0)
        _log_tails(logs, grep=("same-host", "shared memory", "nccl", "NCCL", "Error"))
    if len(got) != len(ps):
        return
    _compare_colocated(ctx, rep, mdir, ps, got)


def _compare_colocated(
    ctx: Ctx, rep: StepReport, mdir: Path, ps: list[list[int]], got: list[list[int]]
) -> None:
    from model_runtime.engine import LLMEngine
    from model_runtime.engine_config import EngineConfig
    from model_runtime.model_runner import StepInput
    from model_runtime.sampling_params import SamplingParams

    cfg = EngineConfig(
        block_size=16,
        num_kv_blocks=512,
        device=ctx.device.type,
        dtype="float32",
        enable_prefix_caching=False,
    )
    engine = LLMEngine.from_model_dir(mdir, cfg)
    for i, p in enumerate(ps):
        (res,) = engine.generate([p], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        want = list(res.output_token_ids)
        have = got[i]
        if have == want:
            rep.check(f"1P1D len{LENGTHS[i]} vs colocated", True, "equal")
            continue
        k = next((j for j, (a, b) in enumerate(zip(have, want, strict=False)) if a != b), None)
        if k is None:
            rep.check(f"1P1D len{LENGTHS[i]} vs colocated", False, f"{have} vs {want}")
            continue
        seq = p + want[:k]
        table = list(range(-(-len(seq) // 16)))
        logits = engine.runner.execute([StepInput(seq, 0, table)])[0]
        gap = float((logits.max() - logits[have[k]]).item())
        rep.check(
            f"1P1D len{LENGTHS[i]} vs colocated",
            gap <= E2E_TIE_TOL,
            f"differs at {k}, gap {gap:.3g} (near-tie if <= {E2E_TIE_TOL})",
        )


def _log_tails(logs: Path, grep: tuple[str, ...] = ()) -> None:
    """Print the tail of every process log (and, with `grep`, the matching lines)."""
    for f in sorted(logs.glob("*.log")):
        lines = f.read_text(errors="replace").splitlines()
        hits = [ln for ln in lines if any(g in ln for g in grep)] if grep else []
        print(f"  --- {f.name}: {len(lines)} lines; matches: {len(hits)}", flush=True)
        for ln in hits[-8:] if grep else lines[-25:]:
            print(f"    {ln[:300]}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        sys.exit(child_main())
    sys.exit(f"usage: python -m {__spec__.name if __spec__ else 'transfer'} --child")
