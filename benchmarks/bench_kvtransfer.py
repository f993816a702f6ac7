"""KV-transfer benchmark on the `small` preset: bandwidth, overlap with prefill, share of TTFT.

    python -m benchmarks.bench_kvtransfer --out runs/bench/kvtransfer.json

(`--model` defaults to models/small and builds the random `small` model there if missing.)

Two processes on this host: this one is the prefill worker (the model, its KV cache and a
`TorchDistTransport`), a spawned one the decode worker (a KV cache of the same layout and its
transport, polling like an engine loop). Timestamps are `time.monotonic()`, which is one clock
for every process on a Linux host. For each prompt length (default 512, 1024, 2048 tokens), in
one run:

- transfer: the prompt's KV (already in the cache) pushed layer by layer, from ``open`` on the
  prefill side to the decode side's ``poll()`` reporting every layer written (the header, GO
  handshake and the scatter into the paged cache are inside). Source blocks are consecutive,
  so each layer goes out straight from the cache (zero-copy); ``scattered`` repeats it with
  the same blocks in reverse order, which forces the copy-out path (`KVCache.gather_layer`);
- raw gloo: the same bytes (the prompt's layers, gathered beforehand) as the same number of
  messages, one per layer, over a bare 2-rank gloo group between the same processes, from the
  first send to the last receive — no gather, no scatter, no handshake;
- shm: the same transfer on the same-host shared-memory data plane (`kvtransfer.shm`: a
  notification per layer, the decode side copies the blocks straight out of the prefill
  worker's cache), from a second prefill transport on the same cache, interleaved with the rest;
- memcpy: the same source bytes (the prompt's blocks in the prefill cache, layer by layer)
  copied in-process into a buffer of the same size, interleaved with the transfers (so the
  source is in the same cache state as theirs); ``memcpy_hot`` is one copy of a buffer just
  copied (at 512 tokens source and destination fit in this host's 32 MB L3: a cache-speed
  reference, not a memory-speed one);
- streaming (both data planes): a real prefill with ``on_layer_done -> send_layer``;
  ``exposed`` is the time from the end of the forward pass to the KV being complete on the
  decode side (the part not hidden behind compute), ``hidden = 1 - exposed / transfer``, and
  ``ttft`` runs from the start of the prefill to the KV complete on the decode side (router
  and sampling excluded).

Medians over ``--reps``; ``paired`` ratios are the median of rep-by-rep ratios (each transfer
against the raw run right beside it), which the host's slow drift affects least. The targets
are judged on the paired ratio against raw gloo (best-against-best swings by +-30 % between
runs of the same code on this shared 2-core host: each side's best is its one luckiest rep)
and on the best shm transfer against the best like-for-like memcpy; one run of 25 reps still
moves by +-15 %, so `benchmarks.kvtransfer_pool` pools several runs. Writes JSON and prints
(and writes next to it, `.md`) a short table.
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

from benchmarks.kvtransfer_peer import BLOCK, Decode
from benchmarks.kvtransfer_report import table
from kvtransfer import rendezvous as rdv
from kvtransfer.torch_dist import TorchDistTransport
from kvtransfer.types import TransferResult, blocks_needed
from model_runtime.kv_cache import KVCache

TARGETS = {  # judged on: paired vs raw gloo, median hidden and share, best shm vs best memcpy
    "vs_raw_gloo": 0.90,
    "hidden": 0.75,
    "share_of_ttft_at_1k_plus": 0.05,
    "shm_vs_memcpy": 0.33,
}


def finish(p: TorchDistTransport, d: Decode, tid: str) -> tuple[float, TransferResult]:
    """Poll the sender until its result; (when the decode side completed the transfer, the
    sender's result)."""
    done = d.wait("result")
    if not done["ok"]:
        raise RuntimeError(f"transfer {tid} failed on the decode side: {done['error']}")
    results: list[TransferResult] = []
    end = time.monotonic() + 60.0
    while not results and time.monotonic() < end:
        results = p.poll()
        time.sleep(0.0005)
    if not results or not results[0].ok:
        raise RuntimeError(f"transfer {tid} failed on the prefill side: {results}")
    return float(done["t"]), results[0]


def bench_transfer(
    p: TorchDistTransport, d: Decode, n_tokens: int, scattered: bool = False
) -> float:
    """Seconds from open to the decode side holding every layer (KV already computed)."""
    ticket = d.ticket(n_tokens)
    src = list(range(ticket.num_blocks))
    if scattered:
        src.reverse()
    t0 = time.monotonic()
    p.open(ticket, src)
    for layer in range(ticket.layout.num_layers):
        p.send_layer(ticket.transfer_id, layer)
    return finish(p, d, ticket.transfer_id)[0] - t0


def bench_raw(raw: rdv.PairGroup, d: Decode, layers: list[torch.Tensor]) -> float:
    """Seconds to move `layers` (ready, contiguous), one message each, over a bare gloo pair."""
    d.conn.send(("raw_recv", layers[0].numel()))
    d.wait("raw_posted")
    t0 = time.monotonic()
    works = [raw.send([t], 0, 7) for t in layers]
    for w in works:
        w.wait()
    return float(d.wait("raw_done")) - t0


def bench_memcpy_hot(nbytes: int) -> float:
    """One copy of `nbytes` from a buffer that was just copied (cache-hot when it fits)."""
    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


def bench_memcpy(cache: KVCache, n_blocks: int, dst: torch.Tensor) -> float:
    """Copy blocks 0..n_blocks-1 of every layer of `cache` into `dst` (same shape, already
    faulted in): the bytes a transfer moves, from where it reads them."""
    t0 = time.perf_counter()
    for layer in range(cache.num_layers):
        dst[layer].copy_(cache.layer_slice(layer, 0, n_blocks))
    return time.perf_counter() - t0


def bench_prefill(
    runner: Any, tokens: list[int], p: TorchDistTransport | None, d: Decode | None
) -> tuple[float, float, float]:
    """Seconds from the start of a prefill to (forward done, KV complete on the decode side,
    last layer handed to the transport); only the first without a transport."""
    from model_runtime.model_runner import StepInput

    src = list(range(blocks_needed(len(tokens), BLOCK)))
    item = StepInput(tokens, 0, src)
    if p is None or d is None:
        t0 = time.monotonic()
        runner.execute([item])
        return time.monotonic() - t0, 0.0, 0.0
    ticket = d.ticket(len(tokens))
    last = [0.0]

    def on_layer_done(layer: int) -> None:
        last[0] = time.monotonic()
        p.send_layer(ticket.transfer_id, layer)

    t0 = time.monotonic()
    p.open(ticket, src)
    runner.execute([item], on_layer_done=on_layer_done)
    t1 = time.monotonic()
    return t1 - t0, finish(p, d, ticket.transfer_id)[0] - t0, last[0] - t0


def _stats(xs: list[float]) -> dict[str, Any]:
    return {"min": min(xs), "median": statistics.median(xs), "all": xs}


def measure_bandwidth(
    p: TorchDistTransport,
    p_shm: TorchDistTransport,
    d: Decode,
    raw: rdv.PairGroup,
    cache: KVCache,
    n: int,
    reps: int,
) -> dict[str, Any]:
    """Transfer (gloo bytes, shared memory) vs raw gloo (interleaved, so load drift hits every
    one) vs memcpy, for n tokens."""
    ids = list(range(blocks_needed(n, BLOCK)))
    layers = [cache.gather_layer(i, ids) for i in range(cache.num_layers)]  # the same bytes
    nbytes = sum(t.numel() * t.element_size() for t in layers)
    copy_dst = torch.zeros((cache.num_layers, *cache.message_shape(len(ids))), dtype=cache.dtype)
    xfer, rawt, scat, shm, shm_scat, memt = [], [], [], [], [], []
    for _ in range(reps):
        xfer.append(bench_transfer(p, d, n))
        rawt.append(bench_raw(raw, d, layers))
        scat.append(bench_transfer(p, d, n, scattered=True))
        shm.append(bench_transfer(p_shm, d, n))
        shm_scat.append(bench_transfer(p_shm, d, n, scattered=True))
        memt.append(bench_memcpy(cache, len(ids), copy_dst))
        # torch's 2-thread copy leaves its OpenMP threads spinning for a while; without the
        # pause the next transfer ran ~1.5x slower.
        time.sleep(0.05)
    mem, mem_hot = min(memt), min(bench_memcpy_hot(nbytes) for _ in range(reps))
    x, r, sc, sh, shs = _stats(xfer), _stats(rawt), _stats(scat), _stats(shm), _stats(shm_scat)
    return {
        "tokens": n,
        "bytes": nbytes,
        "transfer_s": x,
        "raw_gloo_s": r,
        "memcpy_s": mem,
        "memcpy_all_s": memt,
        "memcpy_hot_s": mem_hot,
        "transfer_gbs": nbytes / x["min"] / 1e9,
        "raw_gloo_gbs": nbytes / r["min"] / 1e9,
        "memcpy_gbs": nbytes / mem / 1e9,
        "vs_raw_gloo": r["min"] / x["min"],
        "vs_raw_gloo_median": r["median"] / x["median"],
        # rep by rep (each transfer beside its raw run): robust to the host's slow drift
        "vs_raw_gloo_paired": statistics.median(a / b for a, b in zip(rawt, xfer, strict=True)),
        "scattered_s": sc,
        "scattered_vs_raw_gloo": r["min"] / sc["min"],
        "scattered_vs_raw_gloo_median": r["median"] / sc["median"],
        "scattered_vs_raw_gloo_paired": statistics.median(
            a / b for a, b in zip(rawt, scat, strict=True)
        ),
        "vs_memcpy": mem / x["min"],
        "shm_s": sh,
        "shm_scattered_s": shs,
        "shm_gbs": nbytes / sh["min"] / 1e9,
        "shm_vs_raw_gloo": r["min"] / sh["min"],
        "shm_vs_raw_gloo_paired": statistics.median(a / b for a, b in zip(rawt, shm, strict=True)),
        "shm_vs_memcpy": mem / sh["min"],
        "shm_vs_memcpy_hot": mem_hot / sh["min"],
        "shm_scattered_vs_memcpy": mem / shs["min"],
    }


def measure_streaming(
    runner: Any,
    p: TorchDistTransport,
    d: Decode,
    tokens: list[int],
    transfer_s: float,
    reps: int,
) -> dict[str, Any]:
    """A real prefill pushing each layer as it finishes, vs the same prefill without it.

    `exposed` is what the transfer adds to TTFT: KV complete on the decode side minus forward
    done (the model's final norm and logits still run after the last layer). `tail` is KV
    complete minus last layer handed over: the transfer's own latency past the compute of its
    last layer, the upper bound on `exposed` for any model tail.
    """
    alone, fwd, ttft, exposed, tail = [], [], [], [], []
    for _ in range(reps):
        alone.append(bench_prefill(runner, tokens, None, None)[0])
        f, ready, last = bench_prefill(runner, tokens, p, d)
        fwd.append(f)
        ttft.append(max(f, ready))  # the first token needs the forward; decoding needs the KV
        exposed.append(max(ready - f, 0.0))
        tail.append(ready - last)
    e, t, tl = statistics.median(exposed), statistics.median(ttft), statistics.median(tail)
    return {
        "tokens": len(tokens),
        "prefill_alone_s": statistics.median(alone),
        "prefill_streaming_s": statistics.median(fwd),
        "transfer_s": transfer_s,
        "exposed_s": e,
        "hidden": 1.0 - e / transfer_s,
        "tail_s": tl,
        "hidden_by_tail": 1.0 - tl / transfer_s,
        "ttft_s": t,
        "exposed_share_of_ttft": e / t,
        "tail_share_of_ttft": tl / t,
        "transfer_share_of_ttft": transfer_s / t,
        "per_rep": {"forward_s": fwd, "ttft_s": ttft, "exposed_s": exposed, "tail_s": tail},
    }


def run(model_dir: str, sizes: list[int], reps: int, stream_reps: int) -> dict[str, Any]:
    from model_runtime.model_runner import ModelRunner

    max_blocks = blocks_needed(max(sizes), BLOCK)
    runner = ModelRunner.from_model_dir(model_dir, max_blocks + 8, BLOCK, dtype="float32")
    cache: KVCache = runner.kv_cache
    d = Decode(model_dir, max_blocks + 8)
    try:
        p = TorchDistTransport(cache, "bench-p", serve=False, connect_timeout_s=60.0)
        # Same cache (moved into shared memory), a second sender id: its pair reads in place.
        p_shm = TorchDistTransport(
            cache, "bench-p-shm", serve=False, connect_timeout_s=60.0, shared_memory=True
        )
    except BaseException:
        d.stop()
        raise
    try:
        raw_store = rdv.serve_store("127.0.0.1", 0, 60.0)
        d.conn.send(("raw_join", raw_store.port))
        raw = rdv.make_pair_group(raw_store, "raw", 0, 1, "gloo", "127.0.0.1", 60.0)
        d.wait("raw_ready")
        gen = torch.Generator().manual_seed(0)
        vocab = runner.config.vocab_size
        prompts = {n: torch.randint(3, vocab, (n,), generator=gen).tolist() for n in sizes}
        bench_prefill(runner, prompts[max(sizes)], None, None)  # warm-up; fills the cache
        bench_transfer(p, d, 32)  # warm-up: joins the pair
        bench_transfer(p_shm, d, 32)
        if p_shm.shared_memory_peers() != ["bench-d"]:
            raise RuntimeError("the shared-memory sender fell back to gloo (see the log)")
        bandwidth = [measure_bandwidth(p, p_shm, d, raw, cache, n, reps) for n in sizes]
        streaming = [
            measure_streaming(runner, p, d, prompts[n], b["transfer_s"]["median"], stream_reps)
            for n, b in zip(sizes, bandwidth, strict=True)
        ]
        streaming_shm = [
            measure_streaming(runner, p_shm, d, prompts[n], b["shm_s"]["median"], stream_reps)
            for n, b in zip(sizes, bandwidth, strict=True)
        ]
    finally:
        d.stop()
        p.close()
        p_shm.close()
    return {
        "preset": "small",
        "model_dir": model_dir,
        "block_size": BLOCK,
        "dtype": "float32",
        "reps": reps,
        "stream_reps": stream_reps,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "bandwidth": bandwidth,
        "streaming": streaming,
        "streaming_shm": streaming_shm,
        "targets": TARGETS,
        "meets": _meets(bandwidth, streaming),
    }


def _meets(bandwidth: list[dict[str, Any]], streaming: list[dict[str, Any]]) -> dict[str, bool]:
    return {
        "vs_raw_gloo": all(b["vs_raw_gloo_paired"] >= TARGETS["vs_raw_gloo"] for b in bandwidth),
        "hidden": all(s["hidden"] >= TARGETS["hidden"] for s in streaming),
        "share_of_ttft_at_1k_plus": all(
            s["exposed_share_of_ttft"] <= TARGETS["share_of_ttft_at_1k_plus"]
            for s in streaming
            if s["tokens"] >= 1024
        ),
        "shm_vs_memcpy": all(b["shm_vs_memcpy"] >= TARGETS["shm_vs_memcpy"] for b in bandwidth),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/small", help="model folder (made if missing)")
    ap.add_argument("--out", default="runs/bench/kvtransfer.json")
    ap.add_argument("--sizes", default="512,1024,2048", help="prompt lengths in tokens")
    ap.add_argument("--reps", type=int, default=7, help="bandwidth repetitions (interleaved)")
    ap.add_argument("--stream-reps", type=int, default=3, help="prefill repetitions per size")
    args = ap.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        from tooling.models.random_model import make_random_model

        print(f"building the small random model in {args.model} ...", flush=True)
        make_random_model(args.model, "small", seed=0)
    res = run(args.model, [int(s) for s in args.sizes.split(",")], args.reps, args.stream_reps)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    text = table(res)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
