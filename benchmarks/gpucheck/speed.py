"""Step 4, speed: prefill MFU and decode MBU of the engine's model runner at batch 1, 8, 32
and 128 on a 1B-class random Llama (hidden 2048, 16 layers, 32 heads / 8 KV heads, vocab
32000, bfloat16), made on the machine, next to HF transformers on the same weights and GPU
(a forward over the prompts, then decode steps on its own KV cache).

What is timed: `ModelRunner.execute` (the engine's forward: metadata, model, paged attention,
last-token logits; no scheduler, no sampler) and HF's `forward` with `logits_to_keep=1`, each
synchronized. MFU = model FLOPs (2 x matmul parameters x tokens + causal attention) / time /
peak; MBU = bytes a decode step must read (weights + the batch's KV) / time / peak. The peaks
are the GPU's nominal dense bf16 FLOP/s and HBM bandwidth (`PEAKS`); step 1's measured
ceilings are in the report beside them. Dry run: a miniature model on the CPU, batches 1 and 2,
no peaks (the arithmetic and the plumbing only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpucheck.common import Ctx, StepReport, sync, write_json

# Nominal dense bf16 FLOP/s and HBM bytes/s (SXM parts).
PEAKS = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12), "A100": (312e12, 2.0e12)}


@dataclass(frozen=True)
class Shape:
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def matmul_params(self) -> int:
        """Weights every token multiplies by (embedding lookup excluded, lm_head included)."""
        h, d = self.hidden, self.head_dim
        per_layer = h * self.heads * d * 2 + h * self.kv_heads * d * 2 + 3 * h * self.inter
        return self.layers * per_layer + self.vocab * h

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * itemsize


GPU_SHAPE = Shape(hidden=2048, inter=8192, layers=16, heads=32, kv_heads=8, vocab=32000)
DRY_SHAPE = Shape(hidden=128, inter=256, layers=2, heads=4, kv_heads=2, vocab=512)


def make_model(out: Path, s: Shape, dtype: str) -> Path:
    """Random Llama weights of shape `s` (seed 0) as an HF folder (no tokenizer: the timed
    paths take token ids)."""
    from safetensors.torch import save_file

    from tooling.models.random_model import RandomModelPreset, hf_config, random_weights

    if (out / "model.safetensors").is_file():
        return out
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
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", hf_config(p, s.vocab, dtype))  # type: ignore[arg-type]
    cast = getattr(torch, dtype)
    tensors = {k: v.to(cast).contiguous() for k, v in random_weights(p, s.vocab, 0).items()}
    save_file(tensors, str(out / "model.safetensors"), {"format": "pt"})
    return out


def run(ctx: Ctx) -> StepReport:
    rep = StepReport()
    dev = ctx.device
    shape, dtype = (DRY_SHAPE, "float32") if ctx.dry_run else (GPU_SHAPE, "bfloat16")
    batches = (1, 2) if ctx.dry_run else (1, 8, 32, 128)
    prompt_len, decode_steps, iters = (32, 3, 1) if ctx.dry_run else (512, 16, 3)
    t0 = time.perf_counter()
    mdir = make_model(
        ctx.work / "models" / ("speed-dry" if ctx.dry_run else "llama-1b"), shape, dtype
    )
    rep.metric("model_make_s", round(time.perf_counter() - t0, 1))
    rep.metric("model", f"{shape} {dtype}, {shape.matmul_params() / 1e9:.2f}B matmul params")
    peak_flops, peak_bw = _peaks(dev)
    itemsize = torch.finfo(getattr(torch, dtype)).bits // 8
    weight_bytes = shape.matmul_params() * itemsize
    rows = {}
    for impl in ("pdserve", "hf"):
        fn = _pdserve_times if impl == "pdserve" else _hf_times
        try:
            times = fn(mdir, dev, dtype, batches, prompt_len, decode_steps, iters)
        except Exception as exc:  # one side failing must not hide the other
            rep.check(f"{impl} ran", False, f"{type(exc).__name__}: {exc}")
            continue
        finally:
            if dev.type == "cuda":
                torch.cuda.empty_cache()  # the side's model went with its function
        for b, (prefill_s, decode_s) in times.items():
            tokens = b * prompt_len
            flops = (
                2 * shape.matmul_params() * tokens
                + 2
                * 2
                * shape.layers
                * b
                * (prompt_len * (prompt_len + 1) // 2)
                * shape.heads
                * shape.head_dim
            )
            ctx_len = prompt_len + decode_steps // 2
            step_bytes = weight_bytes + b * ctx_len * shape.kv_bytes_per_token(itemsize)
            row = {
                "prefill_ms": round(prefill_s * 1e3, 2),
                "prefill_tok_s": round(tokens / prefill_s),
                "prefill_TFLOPs": round(flops / prefill_s / 1e12, 1),
                "decode_step_ms": round(decode_s * 1e3, 3),
                "decode_tok_s": round(b / decode_s),
                "decode_GBps": round(step_bytes / decode_s / 1e9, 1),
            }
            if peak_flops and peak_bw:
                row["MFU"] = round(flops / prefill_s / peak_flops, 3)
                row["MBU"] = round(step_bytes / decode_s / peak_bw, 3)
            rows[f"{impl}_b{b}"] = row
            rep.metric(f"{impl}_b{b}", row)
        rep.check(f"{impl} ran", True, f"batches {list(times)}")
    rep.metrics["prompt_len"] = prompt_len
    rep.metrics["decode_steps"] = decode_steps
    return rep


def _peaks(dev: torch.device) -> tuple[float | None, float | None]:
    if dev.type != "cuda":
        return None, None
    name = torch.cuda.get_device_properties(dev).name
    for key, peaks in PEAKS.items():
        if key in name:
            return peaks
    return None, None


def _pdserve_times(
    mdir: Path,
    dev: torch.device,
    dtype: str,
    batches: tuple[int, ...],
    prompt_len: int,
    decode_steps: int,
    iters: int,
) -> dict[int, tuple[float, float]]:
    """(prefill seconds, decode seconds per step) per batch, through `ModelRunner.execute`."""
    from model_runtime.model_runner import ModelRunner, StepInput

    bs = 16
    per_seq = -(-(prompt_len + decode_steps + 2) // bs)
    kernels: Any = "auto" if dev.type == "cuda" else "torch"  # dry run: reference kernels
    runner = ModelRunner.from_model_dir(
        mdir,
        num_blocks=max(batches) * per_seq + 1,
        block_size=bs,
        device=dev,
        dtype=dtype,
        attention_backend=kernels,
        linear_kernel=kernels,
    )
    gen = torch.Generator().manual_seed(0)
    out: dict[int, tuple[float, float]] = {}
    for b in batches:
        tables = [list(range(i * per_seq + 1, (i + 1) * per_seq + 1)) for i in range(b)]
        prompts = torch.randint(4, 500, (b, prompt_len), generator=gen).tolist()
        items = [StepInput(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
        prefill = _median(lambda items=items: runner.execute(items), dev, iters)
        step_times = []
        for k in range(decode_steps + 2):
            items = [StepInput([7], prompt_len + k, t) for t in tables]
            t0 = time.perf_counter()
            runner.execute(items)
            sync(dev)
            if k >= 2:
                step_times.append(time.perf_counter() - t0)
        out[b] = (prefill, sorted(step_times)[len(step_times) // 2])
        print(
            f"  pdserve b={b}: prefill {prefill * 1e3:.1f} ms, decode step "
            f"{out[b][1] * 1e3:.2f} ms",
            flush=True,
        )
    return out


def _hf_times(
    mdir: Path,
    dev: torch.device,
    dtype: str,
    batches: tuple[int, ...],
    prompt_len: int,
    decode_steps: int,
    iters: int,
) -> dict[int, tuple[float, float]]:
    """The same for HF transformers: a forward over the prompts (building its cache), then
    one-token forwards on that cache."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(mdir, dtype=getattr(torch, dtype))
    model = model.to(dev).eval()  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    out: dict[int, tuple[float, float]] = {}
    with torch.no_grad():
        for b in batches:
            ids = torch.randint(4, 500, (b, prompt_len), generator=gen).to(dev)
            prefill = _median(
                lambda ids=ids: model(ids, use_cache=True, logits_to_keep=1), dev, iters
            )
            cache = model(ids, use_cache=True, logits_to_keep=1).past_key_values
            nxt = torch.full((b, 1), 7, device=dev)
            step_times = []
            for k in range(decode_steps + 2):
                t0 = time.perf_counter()
                cache = model(
                    nxt, past_key_values=cache, use_cache=True, logits_to_keep=1
                ).past_key_values
                sync(dev)
                if k >= 2:
                    step_times.append(time.perf_counter() - t0)
            out[b] = (prefill, sorted(step_times)[len(step_times) // 2])
            print(
                f"  hf b={b}: prefill {prefill * 1e3:.1f} ms, decode step {out[b][1] * 1e3:.2f} ms",
                flush=True,
            )
    return out


def _median(fn: object, dev: torch.device, iters: int) -> float:
    from benchmarks.gpucheck.common import timed

    return timed(fn, dev, iters=iters, warmup=1)
