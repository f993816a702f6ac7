"""Step 3, engine: greedy tokens of the engine on the GPU, run through ``pdserve batch``
(`deploy.batch`, its own process, ``--device cuda``), equal those of the CPU float32 engine and
of HF transformers on the same random weights (`tiny` and `small`, seed 0): float32 token for
token up to a near-tie (`common.TIE_TOL`); bfloat16 against HF in bfloat16: equal or a
near-tie by the tests' rule (`common.BF16_TIE_REL`, tests/integration/test_fidelity_hf.py),
else judged by HF float32's logits at the first difference within the bfloat16 noise HF itself
shows on that step (`common.bf16_agrees`). Dry run: `tiny` only, the batch on the CPU,
float32 only."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpucheck.common import (
    Ctx,
    StepReport,
    bf16_agrees,
    first_difference,
    greedy_agrees,
    model_dir,
)

LENGTHS = (1, 15, 16, 17, 64, 200)
MAX_TOKENS = 16
BATCH_TIMEOUT_S = 150.0


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(4, vocab) for _ in range(n)] for n in LENGTHS]  # 0..3: specials


def run(ctx: Ctx) -> StepReport:
    rep = StepReport()
    presets = ["tiny"] if ctx.dry_run else ["tiny", "small"]
    if ctx.dry_run:
        rep.skip("model small, bfloat16", "dry run (CPU)")
    for preset in presets:
        _check_model(ctx, rep, preset)
    return rep


def _check_model(
    ctx: Ctx, rep: StepReport, preset: str, dtypes: tuple[str, ...] | None = None
) -> None:
    """The checks of one model; `dtypes` defaults to float32 (dry run) or both."""
    from model_runtime.config import ModelConfig

    mdir = model_dir(ctx, preset)
    vocab = ModelConfig.from_model_dir(mdir).vocab_size
    ps = prompts(vocab)
    cpu = _engine_tokens(mdir, ps)
    if dtypes is None:
        dtypes = ("float32",) if ctx.dry_run else ("float32", "bfloat16")
    for dtype in dtypes:
        hf = _hf_model(mdir, ctx.device, dtype)
        hf_tokens, hf_logits = _hf_greedy(hf, ps, ctx.device)
        del hf
        t0 = time.perf_counter()
        ours = _pdserve_batch(ctx, mdir, ps, dtype)
        rep.metric(f"{preset}_{dtype}_batch_s", round(time.perf_counter() - t0, 1))
        hf32 = None if dtype == "float32" else _hf_model(mdir, ctx.device, "float32")
        for i, (o, h) in enumerate(zip(ours, hf_tokens, strict=True)):
            if hf32 is None:
                ok, why = greedy_agrees(o, h, hf_logits[i], None)
            else:  # HF float32's logits after the shared context, at the first difference
                f32_at = _f32_logits_at(hf32, ps[i], h, ctx.device)
                ok, why = bf16_agrees(o, h, hf_logits[i], f32_at)
            rep.check(f"{preset} {dtype} {ctx.device.type} len{LENGTHS[i]} vs HF", ok, why)
        del hf32
        if dtype == "float32":
            for i, (o, c) in enumerate(zip(ours, cpu, strict=True)):
                k = first_difference(o, c)
                if k is None:
                    ok, why = True, "equal"
                else:  # judged by HF's logits, the oracle of both
                    ok, why = greedy_agrees(o, c, hf_logits[i], None)
                rep.check(
                    f"{preset} float32 {ctx.device.type} len{LENGTHS[i]} vs CPU engine", ok, why
                )


def _engine_tokens(mdir: Path, ps: list[list[int]]) -> list[list[int]]:
    """The CPU float32 engine on the reference kernels (torch attention and GEMM)."""
    from model_runtime.engine import LLMEngine
    from model_runtime.engine_config import EngineConfig
    from model_runtime.sampling_params import SamplingParams

    cfg = EngineConfig(
        device="cpu",
        dtype="float32",
        attention_backend="torch",
        linear_kernel="torch",
        num_kv_blocks=256,
        enable_prefix_caching=False,
    )
    engine = LLMEngine.from_model_dir(mdir, cfg)
    outs = engine.generate(ps, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return [list(o.output_token_ids) for o in outs]


def _hf_model(mdir: Path, device: torch.device, dtype: str) -> Any:
    """HF's LlamaForCausalLM of `mdir` in `dtype` on `device`, in eval mode."""
    import transformers

    torch_dtype = getattr(torch, dtype)
    model = transformers.LlamaForCausalLM.from_pretrained(mdir, dtype=torch_dtype)
    return model.to(device).eval()  # type: ignore[arg-type]


def _f32_logits_at(
    model: Any, prompt: list[int], ref: list[int], device: torch.device
) -> Callable[[int], torch.Tensor]:
    """A function of k: `model`'s logits (float32, CPU) of the token after prompt + ref[:k]."""

    def at(k: int) -> torch.Tensor:
        ids = torch.tensor([prompt + ref[:k]], device=device)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
        row: torch.Tensor = out.logits[0, -1].float().cpu()
        return row

    return at


def _hf_greedy(
    model: Any, ps: list[list[int]], device: torch.device
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """HF greedy tokens and the logits of every step, one prompt at a time."""
    tokens, logits = [], []
    with torch.no_grad():
        for p in ps:
            ids = torch.tensor([p], device=device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens.append(out.sequences[0, len(p) :].tolist())
            logits.append([s[0].float().cpu() for s in out.scores])
    return tokens, logits


def _pdserve_batch(ctx: Ctx, mdir: Path, ps: list[list[int]], dtype: str) -> list[list[int]]:
    """Run ``pdserve batch`` in its own process on `ctx.device`; the token ids per prompt."""
    d = ctx.work / "batch"
    d.mkdir(parents=True, exist_ok=True)
    inp, out = d / f"{mdir.name}-{dtype}-in.jsonl", d / f"{mdir.name}-{dtype}-out.jsonl"
    lines = [
        {"id": i, "prompt_token_ids": p, "max_tokens": MAX_TOKENS, "temperature": 0}
        for i, p in enumerate(ps)
    ]
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    argv = [
        sys.executable,
        "-m",
        "deploy.cli",
        "batch",
        "--model",
        str(mdir),
        "--input",
        str(inp),
        "--output",
        str(out),
        "--device",
        ctx.device.type,
        "--dtype",
        dtype,
        "--num-kv-blocks",
        "512",
    ]
    if ctx.dry_run:  # the reference kernels: no compiler needed
        argv += ["--attention-backend", "torch", "--linear-kernel", "torch"]
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=BATCH_TIMEOUT_S,
        env=os.environ.copy(),
        check=False,
    )
    print(proc.stderr[-2000:], flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pdserve batch exited {proc.returncode}: {proc.stderr[-1500:]}")
    results = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    bad = [r for r in results if "error" in r]
    if bad:
        raise RuntimeError(f"pdserve batch errors: {bad[:3]}")
    return [list(r["token_ids"]) for r in sorted(results, key=lambda r: int(r["id"]))]
