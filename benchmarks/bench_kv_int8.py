"""The int8 KV cache against bfloat16's: issue 40's int8-KV targets in one command.

    python -m benchmarks.bench_kv_int8 --out runs/bench/kv_int8.json

Model: the `small` preset in bfloat16 (12 layers, 4 KV heads, head_dim 64; made in
`models/small-bf16` if missing): a bfloat16 cache is the baseline the targets name. Both
caches run on the same weights in this process.

1. **Bytes per transferred prompt** (target: int8 <= 0.55x bfloat16): the KV bytes the
   transport reports for a prompt of each `--sizes` length (`TransferResult.nbytes`).
2. **The transfer part of TTFT** (target <= 0.6x): as in `bench_kvtransfer`, this process is
   the prefill worker (model, cache, `TorchDistTransport`) and a spawned process the decode
   worker (`kvtransfer_peer.Decode`), one pair per cache dtype, the two interleaved rep by rep:
   `transfer` is a prompt's KV (already computed) from `open` to the decode side holding every
   layer (the gloo bytes path: a view of the cache out, received in place), `shm` the same on
   the same-host memfd plane; `streaming` a real prefill pushing each layer as it finishes,
   whose `exposed` part (KV complete on the decode side minus forward done) is what the
   transfer adds to TTFT when layers stream. Ratios: int8 median / bfloat16 median, and the
   median of rep-by-rep ratios (`paired`, what the host's drift affects least).
3. **Decode-pool capacity** (target >= 1.8x at the same memory): an `LLMEngine` per cache dtype
   sized by `--memory-mb` (the engine derives `num_kv_blocks` from it), reserving each
   request's worst case (prompt + max_tokens - 1 tokens, as a decode worker's `Reserve` does)
   for `--capacity-prompt` / `--capacity-output` requests until the scheduler refuses.
4. **Decode step** (int8 must not slow it materially): one decode step (`ModelRunner.execute`,
   the default decode path: the fused C step) of `--batches` sequences at `--contexts` tokens,
   both caches on the same weights, interleaved rounds of `--steps` steps, the best round's
   mean; int8 / bfloat16.

Writes JSON and a table (`.md` beside it). Speed numbers from a shared host are noisy: the
table says which host and load they came from.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_engine import prompts_for
from benchmarks.bench_kvtransfer import bench_prefill, finish
from benchmarks.kvtransfer_peer import BLOCK, Decode
from kvtransfer.torch_dist import TorchDistTransport
from kvtransfer.types import blocks_needed
from model_runtime.attention.select import get_backend
from model_runtime.engine import LLMEngine
from model_runtime.engine_config import EngineConfig
from model_runtime.kv_cache import KVCache, KVCacheDtype
from model_runtime.model_runner import ModelRunner, StepInput

CACHES: tuple[KVCacheDtype, ...] = ("auto", "int8")  # "auto" on a bf16 model: the bf16 cache
TARGETS = {"bytes": 0.55, "transfer": 0.6, "capacity": 1.8}


def _say(msg: str) -> None:
    print(msg, flush=True)


def model_dir(path: str) -> str:
    if not (Path(path) / "config.json").is_file():
        from tooling.models.random_model import make_random_model

        _say(f"making the small model (bfloat16) in {path} ...")
        make_random_model(path, "small", seed=0, dtype="bfloat16")
    return path


def runners(path: str, num_blocks: int) -> dict[str, ModelRunner]:
    """A bfloat16 runner per cache dtype on one set of weights."""
    base = ModelRunner.from_model_dir(path, num_blocks, BLOCK, dtype="bfloat16")
    out = {"auto": base}
    cache = KVCache(
        base.config,
        num_blocks,
        BLOCK,
        torch.bfloat16,
        model_name=Path(path).name,
        cache_dtype="int8",
    )
    backend = get_backend("auto", cache.device)
    out["int8"] = ModelRunner(base.config, base.model, cache, backend, base.linear_kernel)
    return out


def transfer_once(p: TorchDistTransport, d: Decode, n_tokens: int) -> tuple[float, int]:
    """(seconds from open to the decode side holding every layer, KV bytes moved) for a prompt
    of `n_tokens` whose KV is in blocks 0.. of the sender's cache."""
    ticket = d.ticket(n_tokens)
    t0 = time.monotonic()
    p.open(ticket, list(range(ticket.num_blocks)))
    for layer in range(ticket.layout.num_layers):
        p.send_layer(ticket.transfer_id, layer)
    done, result = finish(p, d, ticket.transfer_id)
    return done - t0, result.nbytes


def _ratio(int8: list[float], base: list[float]) -> dict[str, float | None]:
    """int8 / bfloat16, of the medians and rep by rep (None where bfloat16's is 0: a streamed
    transfer entirely hidden behind the forward)."""
    paired = [a / b for a, b in zip(int8, base, strict=True) if b > 0]
    mid, low = statistics.median(base), min(base)
    return {
        "median": statistics.median(int8) / mid if mid > 0 else None,
        "paired": statistics.median(paired) if paired else None,
        "best": min(int8) / low if low > 0 else None,
    }


def measure_transfers(path: str, sizes: list[int], reps: int, stream_reps: int) -> dict[str, Any]:
    """Parts 1 and 2: bytes and transfer times per prompt size, both caches interleaved."""
    blocks = blocks_needed(max(sizes), BLOCK) + 8
    run = runners(path, blocks)
    peers: dict[str, Decode] = {}
    senders: dict[str, dict[str, TorchDistTransport]] = {}
    try:
        for kv in CACHES:
            peers[kv] = Decode(path, blocks, "bfloat16", kv)
            cache = run[kv].kv_cache
            senders[kv] = {
                "gloo": TorchDistTransport(cache, f"p-{kv}", serve=False, connect_timeout_s=60.0),
                "shm": TorchDistTransport(
                    cache, f"p-{kv}-shm", serve=False, connect_timeout_s=60.0, shared_memory=True
                ),
            }
        vocab = run["auto"].config.vocab_size
        gen = torch.Generator().manual_seed(0)
        prompts = {n: torch.randint(3, vocab, (n,), generator=gen).tolist() for n in sizes}
        for kv in CACHES:  # fill the caches (real K/V), join both pairs
            bench_prefill(run[kv], prompts[max(sizes)], None, None)
            for plane in ("gloo", "shm"):
                transfer_once(senders[kv][plane], peers[kv], 32)
            if senders[kv]["shm"].shared_memory_peers() != ["bench-d"]:
                raise RuntimeError(f"{kv}: the shared-memory sender fell back to gloo")
        out: list[dict[str, Any]] = []
        for n in sizes:
            times: dict[str, dict[str, list[float]]] = {kv: {} for kv in CACHES}
            nbytes: dict[str, int] = {}
            for _ in range(reps):
                for kv in CACHES:
                    for plane in ("gloo", "shm"):
                        s, nbytes[kv] = transfer_once(senders[kv][plane], peers[kv], n)
                        times[kv].setdefault(plane, []).append(s)
            for _ in range(stream_reps):
                for kv in CACHES:
                    fwd, ready, _ = bench_prefill(
                        run[kv], prompts[n], senders[kv]["gloo"], peers[kv]
                    )
                    times[kv].setdefault("forward", []).append(fwd)
                    times[kv].setdefault("exposed", []).append(max(ready - fwd, 0.0))
                    times[kv].setdefault("ttft", []).append(max(fwd, ready))
            row: dict[str, Any] = {
                "tokens": n,
                "bytes": nbytes,
                "bytes_ratio": nbytes["int8"] / nbytes["auto"],
                "seconds": times,
            }
            for key in ("gloo", "shm", "exposed", "ttft"):
                row[f"{key}_ratio"] = _ratio(times["int8"][key], times["auto"][key])
            out.append(row)
            _say(
                f"{n} tokens: bytes {row['bytes_ratio']:.3f}x, transfer gloo "
                f"{_x(row['gloo_ratio']['median'])}, shm {_x(row['shm_ratio']['median'])}"
            )
        return {"sizes": out}
    finally:
        for group in senders.values():
            for sender in group.values():
                sender.close()
        for d in peers.values():
            d.stop()


def measure_capacity(path: str, memory_mb: float, prompt: int, output: int) -> dict[str, Any]:
    """Part 3: requests a decode engine of each cache dtype reserves in `memory_mb`."""
    per_request = blocks_needed(prompt + output - 1, BLOCK)
    out: dict[str, Any] = {"memory_mb": memory_mb, "prompt": prompt, "output": output}
    for kv in CACHES:
        config = EngineConfig(
            kv_cache_memory_mb=memory_mb, dtype="bfloat16", kv_cache_dtype=kv, block_size=BLOCK
        )
        engine = LLMEngine.from_model_dir(path, config)
        held = 0
        while engine.scheduler.reserve_remote(f"r{held}", f"t{held}", per_request) is not None:
            held += 1
        out[kv] = {"blocks": engine.num_kv_blocks, "requests": held}
        del engine
    out["ratio"] = out["int8"]["requests"] / out["auto"]["requests"]
    _say(f"capacity at {memory_mb} MiB: {out['auto']} -> {out['int8']} ({out['ratio']:.3f}x)")
    return out


def measure_decode(
    path: str, batches: list[int], contexts: list[int], steps: int, rounds: int
) -> list[dict[str, Any]]:
    """Part 4: one decode step of B sequences at each context, both caches on the same weights
    (the runner's default decode path: the fused C step), interleaved: per round and cache
    the mean of `steps` steps, the best round counting (a shared host's bursts hit both)."""
    out = []
    for ctx in contexts:
        for b in batches:
            per_seq = blocks_needed(ctx + 1, BLOCK)
            run = runners(path, b * per_seq)
            tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
            vocab = run["auto"].config.vocab_size
            prompts = prompts_for(b, ctx, vocab, seed=b)
            for r in run.values():
                for prompt, table in zip(prompts, tables, strict=True):
                    r.execute([StepInput(prompt, 0, table)])
            items = [StepInput([p[-1]], ctx, t) for p, t in zip(prompts, tables, strict=True)]
            best = {kv: float("inf") for kv in CACHES}
            for _ in range(rounds):
                for kv in CACHES:
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        run[kv].execute(items)  # rewrites position ctx each time
                    best[kv] = min(best[kv], (time.perf_counter() - t0) / steps)
            op_ms = {kv: _op_ms(r, items, steps) for kv, r in run.items()}
            row = {
                "context": ctx,
                "batch": b,
                "decode_path": {kv: r.decode_path for kv, r in run.items()},
                "step_ms": {kv: best[kv] * 1e3 for kv in CACHES},
                "ratio": best["int8"] / best["auto"],
                "op_ms": op_ms,
            }
            out.append(row)
            ops = {
                kv: {k: round(v, 3) for k, v in op_ms[kv].items() if k in KV_OPS} for kv in CACHES
            }
            _say(f"decode ctx {ctx} batch {b}: {row['step_ms']} ({row['ratio']:.3f}x); {ops}")
            del run
    return out


KV_OPS = ("rope + kv write", "attention")  # the fused step's ops the cache dtype changes


def _op_ms(runner: ModelRunner, items: list[StepInput], steps: int) -> dict[str, float]:
    """ms per step of each op inside the fused C step (`FusedDecode.start_op_timing`), {} when
    the runner decodes on the torch path."""
    fused = runner.fused
    if fused is None:
        return {}
    fused.start_op_timing()
    for _ in range(steps):
        runner.execute(items)
    return {k: v * 1e3 / steps for k, v in fused.stop_op_timing().items()}


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def render(res: dict[str, Any]) -> str:
    lines = [
        f"int8 KV vs bfloat16 KV ({res['model']}, {res['torch_threads']} torch threads, "
        f"{res['cpu_count']} CPUs, load {res['load_avg_1m']:.1f} at start; {res['host_note']})",
        "",
        "| prompt tokens | KV bytes bf16 | KV bytes int8 | bytes | transfer (gloo) "
        "| transfer (shm) | exposed (streamed) | TTFT (prefill + transfer) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["transfers"]["sizes"]:
        t = {k: r[f"{k}_ratio"] for k in ("gloo", "shm", "exposed", "ttft")}
        ms = {
            k: {kv: statistics.median(r["seconds"][kv][k]) * 1e3 for kv in CACHES}
            for k in ("gloo", "shm", "exposed", "ttft")
        }
        cells = [
            f"{ms[k]['auto']:.1f} -> {ms[k]['int8']:.1f} ms ({_x(t[k]['median'])}, paired "
            f"{_x(t[k]['paired'])}, best {_x(t[k]['best'])})"
            for k in ("gloo", "shm", "exposed", "ttft")
        ]
        lines.append(
            f"| {r['tokens']} | {r['bytes']['auto']} | {r['bytes']['int8']} | "
            f"{r['bytes_ratio']:.3f}x | " + " | ".join(cells) + " |"
        )
    c = res["capacity"]
    if c:
        lines += [
            "",
            f"Decode pool at {c['memory_mb']} MiB, requests of {c['prompt']} + {c['output']} "
            f"tokens: bf16 {c['auto']['blocks']} blocks / {c['auto']['requests']} requests, "
            f"int8 {c['int8']['blocks']} blocks / {c['int8']['requests']} requests "
            f"({c['ratio']:.3f}x).",
        ]
    lines += [
        "",
        "| context | batch | step bf16 KV | step int8 KV | int8 / bf16 | "
        + " | ".join(f"{op} bf16 / int8" for op in KV_OPS)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(KV_OPS),
    ]
    for r in res["decode"]:
        ops = [
            f"{r['op_ms']['auto'].get(op, 0.0):.2f} / {r['op_ms']['int8'].get(op, 0.0):.2f} ms"
            for op in KV_OPS
        ]
        lines.append(
            f"| {r['context']} | {r['batch']} | {r['step_ms']['auto']:.2f} ms | "
            f"{r['step_ms']['int8']:.2f} ms | {r['ratio']:.3f}x | " + " | ".join(ops) + " |"
        )
    m = res["meets"]
    verdict = {True: "met", False: "NOT met", None: "not measured"}
    lines += ["", "Targets: " + ", ".join(f"{k} {verdict[v]}" for k, v in m.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="models/small-bf16", help="bfloat16 small model (made)")
    ap.add_argument("--out", default="runs/bench/kv_int8.json")
    ap.add_argument("--sizes", default="512,1024,2048,4096", help="prompt tokens per transfer")
    ap.add_argument("--reps", type=int, default=7, help="transfers per size and cache dtype")
    ap.add_argument("--stream-reps", type=int, default=2, help="streamed prefills per size")
    ap.add_argument("--memory-mb", type=float, default=256.0, help="decode pool KV memory")
    ap.add_argument("--capacity-prompt", type=int, default=512)
    ap.add_argument("--capacity-output", type=int, default=128)
    ap.add_argument("--batches", default="1,8", help="decode step batch sizes")
    ap.add_argument("--contexts", default="128,1024", help="decode step prompt lengths")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--host-note", default="shared machine", help="said in the table")
    ap.add_argument("--parts", default="transfer,capacity,decode", help="which measurements to run")
    args = ap.parse_args(argv)
    path = model_dir(args.model)
    load = os.getloadavg()[0]
    sizes = [int(s) for s in args.sizes.split(",")]
    parts = set(args.parts.split(","))
    transfers: dict[str, Any] = {"sizes": []}
    if "transfer" in parts:
        transfers = measure_transfers(path, sizes, args.reps, args.stream_reps)
    capacity: dict[str, Any] = {}
    if "capacity" in parts:
        capacity = measure_capacity(
            path, args.memory_mb, args.capacity_prompt, args.capacity_output
        )
    decode: list[dict[str, Any]] = []
    if "decode" in parts:
        decode = measure_decode(
            path,
            [int(b) for b in args.batches.split(",")],
            [int(c) for c in args.contexts.split(",")],
            args.steps,
            args.rounds,
        )
    rows = transfers["sizes"]
    res: dict[str, Any] = {
        "model": path,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": load,
        "host_note": args.host_note,
        "transfers": transfers,
        "capacity": capacity,
        "decode": decode,
        "targets": TARGETS,
        "meets": {
            "bytes": all(r["bytes_ratio"] <= TARGETS["bytes"] for r in rows) if rows else None,
            "transfer": (
                all((r["gloo_ratio"]["median"] or 0.0) <= TARGETS["transfer"] for r in rows)
                if rows
                else None
            ),
            "capacity": capacity["ratio"] >= TARGETS["capacity"] if capacity else None,
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    text = render(res)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
