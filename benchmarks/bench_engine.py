"""Engine throughput on the `small` preset vs HF transformers, with MBU and MFU. Standalone.

    python -m benchmarks.bench_engine --model models/small --out runs/bench/engine.json

Measures, in one run and interleaved per batch size so machine drift hits both sides, each
after a warm-up at its shape and as the best of `REPEATS` timings:

- prefill tokens/s: B prompts of `--prompt-len` tokens, one step each (max_tokens=1);
- decode tokens/s: B requests decoding `--decode-steps` tokens after their prefill, timing only
  the decode steps;
- the same through HF `generate` (greedy, KV cache on): prefill = generate(max_new_tokens=1),
  decode = (generate(1 + steps) - generate(1)) per token;
- the machine's memory bandwidth and fp32 matmul FLOP/s (`tooling.machine`, measured before,
  after, and once in every round; the largest of each counts), giving decode
  MBU = bytes read per step / step time / bandwidth (weights except the embedding table, plus
  the KV read), and prefill MFU = model FLOPs / time / matmul FLOP/s.

Writes JSON and a Markdown table next to it (`.md`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from model_runtime.config import ModelConfig
from model_runtime.engine import LLMEngine
from model_runtime.engine_config import EngineConfig
from model_runtime.sampling_params import SamplingParams
from tooling.machine import measure_machine

REPEATS = 3  # timed rounds after a warm-up; the best time of each measurement counts


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes of every weight a decode step reads (the embedding table is only gathered), in
    the engine's dtype."""
    from model_runtime.linear import Linear

    model = engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    norms = sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if name.endswith("layernorm.weight") or name == "norm.weight"
    )
    return sum(m.nbytes() for m in linears) + norms


def _model_flops_per_token(cfg: ModelConfig, context: int) -> float:
    """2 * matmul params + attention (QK^T and PV) for one token at a given context length."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    matmul = cfg.num_hidden_layers * per_layer + cfg.vocab_size * h
    attn = cfg.num_hidden_layers * 2 * cfg.num_attention_heads * d * context
    return 2.0 * matmul + 2.0 * attn


def bench_ours_prefill(engine: LLMEngine, prompts: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.block_pool.reset_prefix_cache()
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    return time.perf_counter() - t0


def bench_ours_decode(engine: LLMEngine, prompts: list[list[int]], steps: int) -> float:
    """Seconds per decode step with len(prompts) sequences running."""
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    engine.block_pool.reset_prefix_cache()
    for i, p in enumerate(prompts):
        engine.add_request(f"d{i}", p, params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in _live(engine)):
        engine.step()
    t0 = time.perf_counter()
    n = 0
    while engine.has_unfinished():
        engine.step()
        n += 1
    return (time.perf_counter() - t0) / max(n, 1)


def _live(engine: LLMEngine) -> list[Any]:
    return [r for r in engine.scheduler.requests.values() if r.finish_reason is None]


class HFRunner:
    """HF `generate` (greedy, KV cache on) on fixed prompts: prefill = generate(1 new token),
    decode step = (generate(1 + steps) - generate(1)) / steps."""

    def __init__(self, hf: Any, prompts: list[list[int]]) -> None:
        self.hf = hf
        self.ids = torch.tensor(prompts)
        self.kw = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None,
                   "attention_mask": torch.ones_like(self.ids)}  # fmt: skip

    def generate_s(self, new_tokens: int) -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            self.hf.generate(
                self.ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **self.kw
            )
            return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="models/small")
    ap.add_argument("--out", default="runs/bench/engine.json")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    ap.add_argument(
        "--linear-kernel", default="auto", choices=["auto", "torch", "onednn", "avx2"],
        help="the engine's GEMM (model_runtime.linear)",
    )  # fmt: skip
    ap.add_argument(
        "--no-torch-gemm-row", action="store_true",
        help="skip the extra decode run of our engine on torch's F.linear (HF's GEMM), which "
        "separates the GEMM's share of the speed-up from the engine's",
    )  # fmt: skip
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if not (Path(args.model) / "config.json").is_file():
        from tooling.models.random_model import make_random_model

        say(f"making the small model in {args.model} ...")
        make_random_model(args.model, "small", seed=0)
    say("measuring the machine ...")
    machine = measure_machine()
    say(f"  {machine}")
    max_b = max(batches)
    tokens = max_b * max(args.prompt_len, args.decode_prompt_len + args.decode_steps + 1)
    config = EngineConfig(
        num_kv_blocks=tokens // 16 + 2 * max_b + 8,
        max_num_batched_tokens=max(max_b * args.prompt_len, 512),
        max_num_seqs=max_b,
        linear_kernel=args.linear_kernel,
    )
    engine = LLMEngine.from_model_dir(args.model, config)
    torch_gemm = None
    if not args.no_torch_gemm_row and engine.runner.linear_kernel != "torch":
        torch_gemm = LLMEngine.from_model_dir(
            args.model, config.model_copy(update={"linear_kernel": "torch"})
        )
    cfg = engine.model_config
    hf = None
    if not args.no_hf:
        import transformers

        hf = transformers.LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        hf.eval()  # type: ignore[no-untyped-call]  # transformers' PreTrainedModel.eval is untyped
    step_weight_bytes = weight_bytes(engine)
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    rows: list[dict[str, Any]] = []
    for b in batches:
        pre = prompts_for(b, args.prompt_len, cfg.vocab_size, seed=b)
        dec = prompts_for(b, args.decode_prompt_len, cfg.vocab_size, seed=100 + b)
        hf_pre = HFRunner(hf, pre) if hf is not None else None
        hf_dec = HFRunner(hf, dec) if hf is not None else None
        steps = args.decode_steps
        # Warm-up at this batch's shapes, then REPEATS rounds, each running every measurement
        # once, so a slow moment of the shared machine hits ours and HF's alike; best counts.
        bench_ours_prefill(engine, pre)
        bench_ours_decode(engine, dec, 2)
        if torch_gemm is not None:
            bench_ours_decode(torch_gemm, dec, 2)
        if hf_pre is not None and hf_dec is not None:
            hf_pre.generate_s(1)
            hf_dec.generate_s(steps + 1)
        t: dict[str, list[float]] = {}
        for rnd in range(REPEATS):
            say(f"batch {b}: round {rnd + 1}/{REPEATS} ...")
            machine = machine.best_of(measure_machine(size_mb=256, gemm_n=1024, repeats=2))
            t.setdefault("pre", []).append(bench_ours_prefill(engine, pre))
            t.setdefault("step", []).append(bench_ours_decode(engine, dec, steps))
            if torch_gemm is not None:
                t.setdefault("torch", []).append(bench_ours_decode(torch_gemm, dec, steps))
            if hf_pre is not None and hf_dec is not None:
                t.setdefault("hf_pre", []).append(hf_pre.generate_s(1))
                t.setdefault("hf_all", []).append(hf_dec.generate_s(steps + 1))
                t.setdefault("hf_one", []).append(hf_dec.generate_s(1))
        t_pre, t_step = min(t["pre"]), min(t["step"])
        row: dict[str, Any] = {"batch": b}
        if "torch" in t:
            row["decode_tokens_per_s_torch_gemm"] = b / min(t["torch"])
        row |= {
            "prefill_tokens_per_s": b * args.prompt_len / t_pre,
            "decode_tokens_per_s": b / t_step,
            "decode_step_ms": t_step * 1e3,
        }
        ctx = args.decode_prompt_len + args.decode_steps // 2
        step_bytes = step_weight_bytes + b * ctx * kv_bytes_per_token
        row["_bytes_per_s"] = step_bytes / t_step
        flops = b * sum(_model_flops_per_token(cfg, c) for c in range(1, args.prompt_len + 1))
        row["_flops_per_s"] = flops / t_pre
        if "hf_pre" in t:
            hf_prefill = min(t["hf_pre"])
            hf_step = max(min(t["hf_all"]) - min(t["hf_one"]), 1e-9) / steps
            row |= {
                "hf_prefill_tokens_per_s": b * args.prompt_len / hf_prefill,
                "hf_decode_tokens_per_s": b / hf_step,
                "decode_speedup_vs_hf": row["decode_tokens_per_s"] * hf_step / b,
                "prefill_speedup_vs_hf": row["prefill_tokens_per_s"]
                * hf_prefill
                / (b * args.prompt_len),
            }
        rows.append(row)
        say(f"  {json.dumps({k: round(v, 3) for k, v in row.items() if k[0] != '_'})}")
    engine.check_integrity()
    assert engine.block_pool.num_free == engine.num_kv_blocks
    say("measuring the machine again (the larger bandwidth and FLOP/s of the two count) ...")
    machine = measure_machine().best_of(machine)
    for row in rows:  # the strictest denominators: the best seen at any point of the run
        row["decode_mbu"] = row.pop("_bytes_per_s") / (machine.memory_bandwidth_gbs * 1e9)
        row["prefill_mfu"] = row.pop("_flops_per_s") / (machine.matmul_gflops * 1e9)
    result = {
        "benchmark": "engine",
        "model": str(args.model),
        "params": engine.runner.model.num_parameters(),
        "linear_kernel": engine.runner.linear_kernel,
        "prompt_len": args.prompt_len,
        "decode_prompt_len": args.decode_prompt_len,
        "decode_steps": args.decode_steps,
        "machine": machine.to_json(),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    table = render_table(result)
    out.with_suffix(".md").write_text(table)
    print(table)
    return 0


def render_table(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"# Engine throughput — {result['model']} ({result['params'] / 1e6:.0f} M params, fp32)",
        "",
        f"Machine: {m['cpu_count']} CPUs, torch {m['torch_version']} with {m['torch_threads']} "
        f"threads; memory bandwidth {m['memory_bandwidth_gbs']:.1f} GB/s, fp32 matmul "
        f"{m['matmul_gflops']:.0f} GFLOP/s (best of torch.mm {m['matmul_gflops_torch_mm']:.0f} "
        f"and oneDNN {m['matmul_gflops_onednn']:.0f}; measured in this run).",
        "",
        "| batch | prefill tok/s | MFU | HF prefill tok/s | decode tok/s | step ms | MBU "
        "| HF decode tok/s | decode vs HF | ours on torch's GEMM: decode tok/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['batch']} | {r['prefill_tokens_per_s']:.0f} | {r['prefill_mfu']:.0%} "
            f"| {r.get('hf_prefill_tokens_per_s', float('nan')):.0f} "
            f"| {r['decode_tokens_per_s']:.1f} | {r['decode_step_ms']:.1f} | {r['decode_mbu']:.0%} "
            f"| {r.get('hf_decode_tokens_per_s', float('nan')):.1f} "
            f"| {r.get('decode_speedup_vs_hf', float('nan')):.2f}x "
            f"| {r.get('decode_tokens_per_s_torch_gemm', float('nan')):.1f} |"
        )
    lines += [
        "",
        'The last column runs our engine with `linear_kernel="torch"` (F.linear, the GEMM HF '
        "uses): it separates the oneDNN GEMM's share of the speed-up from the engine's.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
