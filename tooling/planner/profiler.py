"""`pdserve profile`: measure prefill and decode step costs of a model on this machine.

Runs in the CLI process (imports torch). Drives `model_runtime.engine.LLMEngine` directly —
the same scheduler, runner and sampler a worker's engine thread runs, without gRPC — with
`torch.set_num_threads(threads)` as a worker would, and times `engine.step()`:

1. prefill: one request at a time, `max_tokens=1`, prefix caching off, step budget `chunk`;
   a prompt of n <= chunk tokens is one step of (start 0, n tokens); a longer prompt runs as
   chunks, each step one (start, chunk) sample — so both terms (tokens, attention) are seen;
2. decode: per context, `max(batches)` requests of `context` prompt tokens each are
   prefilled once (untimed); then, from the largest batch down, the batch is cut to size by
   aborting requests, one warm-up step runs and `decode_steps * repeats` steps are timed; their
   median is one (batch, sum of contexts) sample. Prefilling once per context rather than once
   per (batch, repetition) is what keeps this affordable on a CPU: the prefills were most of
   the profile's time;
3. every prefill sample is the median of `repeats` runs (after one warm-up of each shape); the
   coefficients are fitted with `costs.fit_linear` (non-negative, relative error).

The result is a `CostModel` whose `meta` keeps every sample, the model folder and the thread
count; the serving overheads are left at 0 (`costs.calibrate_overheads` fits them from a real
run).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tooling.planner.costs import CostModel, fit_linear

PREFILL_LENGTHS = (16, 32, 64, 128, 256, 384, 512)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
DECODE_CONTEXTS = (32, 256, 640)


def _engine(model_dir: Path, chunk: int, max_seqs: int, blocks: int) -> Any:
    from model_runtime.engine import LLMEngine
    from model_runtime.engine_config import EngineConfig

    cfg = EngineConfig(
        block_size=16,
        num_kv_blocks=blocks,
        max_num_batched_tokens=max(chunk, max_seqs),
        max_num_seqs=max_seqs,
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
    )
    return LLMEngine.from_model_dir(model_dir, cfg)


def _timed_step(engine: Any) -> float:
    t = time.perf_counter()
    engine.step()
    return time.perf_counter() - t


def _prompt(n: int, vocab: int, salt: int) -> list[int]:
    return [(salt * 7919 + i * 31) % (vocab - 10) + 5 for i in range(n)]


def measure_prefill(
    engine: Any, lengths: Sequence[int], chunk: int, repeats: int, vocab: int
) -> list[tuple[int, int, float]]:
    """[(start, tokens, seconds)] samples (module docstring, step 1)."""
    from model_runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    times: dict[tuple[int, int], list[float]] = {}
    for rep in range(repeats + 1):
        for n in lengths:
            engine.add_request(f"p{rep}-{n}", _prompt(n, vocab, rep * 1000 + n), params)
            start = 0
            while engine.has_unfinished():
                dt = _timed_step(engine)
                step = min(chunk, n - start)
                if rep > 0:  # repetition 0 is the warm-up
                    times.setdefault((start, step), []).append(dt)
                start += step
    return [(s, k, statistics.median(v)) for (s, k), v in sorted(times.items())]


def decode_headroom(
    batches: Sequence[int], contexts: Sequence[int], chunk: int, steps: int, repeats: int = 1
) -> int:
    """max_tokens of a decode-profile request: enough that none finishes before the last
    timed step (`measure_decode`): the tokens it decodes while the rest of its batch is still
    prefilling (each step prefills at most `chunk` tokens), then a warm-up step and
    `steps * repeats` timed steps at every batch size."""
    b = max(batches)
    during_prefill = -(-b * max(contexts) // max(1, chunk - b))  # decodes share the budget
    return during_prefill + len(batches) * (1 + steps * repeats) + 8


def measure_decode(
    engine: Any,
    batches: Sequence[int],
    contexts: Sequence[int],
    decode_steps: int,
    repeats: int,
    vocab: int,
    headroom: int,
) -> list[tuple[int, int, float]]:
    """[(batch, total context, seconds)] samples (module docstring, step 2). Every request it
    adds is finished or aborted when it returns."""
    from model_runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=headroom, ignore_eos=True)
    out = []
    for ctx in contexts:
        ids = [f"d{ctx}-{i}" for i in range(max(batches))]
        for i, rid in enumerate(ids):
            engine.add_request(rid, _prompt(ctx, vocab, i), params)
        reqs = [engine.scheduler.requests[rid] for rid in ids]
        while any(not r.output_token_ids for r in reqs):  # prefill, untimed
            engine.step()
        for b in sorted(batches, reverse=True):
            for rid in ids[b : len(reqs)]:
                engine.abort_request(rid)
            reqs = reqs[:b]
            engine.step()  # warm-up of the new batch shape
            shapes: list[tuple[int, float]] = []  # (context at the step, seconds)
            for _ in range(decode_steps * repeats):
                context = sum(r.num_prompt_tokens + len(r.output_token_ids) for r in reqs)
                shapes.append((context, _timed_step(engine)))
            context = round(statistics.median(c for c, _ in shapes))
            out.append((b, context, statistics.median(t for _, t in shapes)))
        for rid in ids[: len(reqs)]:
            engine.abort_request(rid)
    return sorted(out)


def profile_engine(
    model_dir: str | Path,
    threads: int = 1,
    chunk: int = 256,
    max_prompt: int = 512,
    max_batch: int = 32,
    max_context: int = 640,
    decode_steps: int = 6,
    repeats: int = 3,
) -> CostModel:
    """Measure and fit a `CostModel` for `model_dir` on this machine (module docstring)."""
    import torch

    from model_runtime.config import ModelConfig

    model_dir = Path(model_dir)
    mc = ModelConfig.from_model_dir(model_dir)
    limit = mc.max_position_embeddings - decode_steps - 4
    lengths = [n for n in PREFILL_LENGTHS if n <= min(max_prompt, limit)]
    if max_prompt > chunk and max_prompt <= limit and max_prompt not in lengths:
        lengths.append(max_prompt)
    batches = [b for b in DECODE_BATCHES if b <= max_batch]
    headroom = decode_headroom(
        batches or [1],
        [c for c in DECODE_CONTEXTS if c <= max_context],
        chunk,
        decode_steps,
        repeats,
    )
    contexts = [c for c in DECODE_CONTEXTS if c <= min(max_context, limit - headroom)]
    if not lengths or not batches or not contexts:
        raise ValueError(
            f"nothing to measure: max_prompt={max_prompt}, max_batch={max_batch}, "
            f"max_context={max_context} for a model of context {mc.max_position_embeddings}"
        )
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        blocks = (max(batches) * (max(contexts) + headroom + 16)) // 16 + 64
        blocks = max(blocks, max(lengths) // 16 + 8)
        engine = _engine(model_dir, chunk, max(batches), blocks)
        pre = measure_prefill(engine, lengths, chunk, repeats, mc.vocab_size)
        dec = measure_decode(
            engine, batches, contexts, decode_steps, repeats, mc.vocab_size, headroom
        )
    finally:
        torch.set_num_threads(old)
    prefill = fit_linear([(float(k), float(k * (s + k))) for s, k, _ in pre], [t for *_, t in pre])
    decode = fit_linear([(float(b), float(c)) for b, c, _ in dec], [t for *_, t in dec])
    meta = {
        "model": str(model_dir),
        "threads": threads,
        "chunk": chunk,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "load_avg_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "seconds": round(time.perf_counter() - t0, 2),
        "prefill_samples": [[s, k, t] for s, k, t in pre],
        "decode_samples": [[b, c, t] for b, c, t in dec],
    }
    return CostModel(prefill=prefill, decode=decode, meta=meta)
