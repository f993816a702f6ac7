"""Engine decode step next to its weight-streaming floor, per model, dtype, thread count, batch.

    python -m benchmarks.bench_decode_step --models small,smollm2 --threads 1,2 \\
        --batches 1,16 --rounds 3 [--baselines] [--profile-batches 1] \\
        --out runs/bench/decode_step.json
    python -m benchmarks.bench_decode_step --models smollm2 --dtypes q8_0,q4_1 \\
        --threads 1,2 --batches 1 --rounds 3 --no-torch-path --profile-batches 1 \\
        --out runs/bench/decode_step_quant.json       (weights kept quantized, issue 40)

One engine per (model, dtype), all in one process, on the `avx2` linear kernel (the panel
GEMM, whose weights the fused decode step reads): `small` (the 12-layer preset, 129 M
parameters) and `smollm2` (a random model of SmolLM2-135M's shape: hidden 576, intermediate
1536, 30 layers, 9 heads, 3 KV heads, vocab 49152, tied embeddings; written here, in
models/smollm2-shape[-bf16], unless present), each in float32 and bfloat16; and with
`--dtypes q8_0,q4_1` the float32 folder quantized (`pdserve quantize`, into
models/<name>-q8_0 and -q4_1, bfloat16 activations): q8_0 every matrix Q8_0, q4_1 the layers
Q4_1 with the embedding and LM head Q8_0 (the make-up of SmolLM2's own Q4_1 file, 96.4 MB a
step for this shape). Their floor is the packed bytes (blocks and scales) over the bandwidth;
`--quant-activations` picks the int8 or float32 decode path. Per engine two
variants on the same weights: `fused` (all-decode steps in one C call,
`model_runtime.kernels.decode_step`, the default wherever the weights are panel-packed) and
`torch` (the model's torch modules, the path before issue 30). `--baselines` adds, where the
host has oneDNN: an engine on the `onednn` kernel, torch path (what `auto` gave decode steps on
AVX-512 hosts before they got a panel copy: the `onednn_ms` column), and one on `auto` with its
default decode path (on AVX-512/AMX hosts oneDNN for prefill plus panels for fused decode steps:
`auto_ms` and `auto / floor`); the `auto` engine is left out where `auto` is `avx2` (the fused
columns are it).

For each batch B, in `--rounds` rounds, for each thread count: the memory bandwidth is measured
(`tooling.machine`, with that torch thread count), then every variant runs: B requests with
`--context`-token prompts (after the first round their full blocks are prefix-cache hits, so a
round prefills one token each) decode `--steps` tokens, each `engine.step()` timed (scheduler,
runner, sampler); a round's step is the median, and the best round counts, as does the best
bandwidth. The floor is the bytes of weights a decode step reads (every Linear and norm; the
embedding is only gathered) over that bandwidth; issue 30's target is fused step / floor
<= 1.25 at batch 1.

`--profile-batches`: after the timed rounds, per model, dtype, thread count and batch: the fused
step's time per op (wall time inside the C step, `FusedDecode.start_op_timing`) with what the
step spends outside it (Python: scheduler, metadata, sampler), and each GEMM next to its own
weight floor.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_engine import prompts_for, weight_bytes
from model_runtime.engine import LLMEngine
from model_runtime.engine_config import EngineConfig
from model_runtime.fused_decode import decoder_layers
from model_runtime.sampling_params import SamplingParams
from tooling.machine import MachineInfo, measure_machine

DTYPES = ("float32", "bfloat16")
QUANTIZED = {"q8_0": "int8", "q4_1": "q4"}  # pseudo-dtype -> `pdserve quantize --to`
TOP_OPS = 12  # torch-profiler rows with their own line; the rest are summed
# SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M config.json), random weights.
SMOLLM2_SHAPE: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
MODELS = {"small": "models/small", "smollm2": "models/smollm2-shape"}


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_model(path: str, dtype: str) -> None:
    """Make the `small` random model in `path` (in `dtype`) unless it is there."""
    if not (Path(path) / "config.json").is_file():
        from tooling.models.random_model import make_random_model

        _say(f"making the small model ({dtype}) in {path} ...")
        make_random_model(
            path, "small", seed=0, dtype="bfloat16" if dtype == "bfloat16" else "float32"
        )


def write_shaped_model(path: str, shape: dict[str, Any], dtype: str, seed: int = 0) -> None:
    """A random Llama model folder of `shape` (HF config keys) in `dtype`, unless present:
    config.json and model.safetensors only (the engine needs no tokenizer). Weights are
    uniform with the fan-in scale of `model_runtime.random_model`; decode speed does not
    depend on their values."""
    out = Path(path)
    if (out / "config.json").is_file():
        return
    from safetensors.torch import save_file

    _say(f"making a {shape['num_hidden_layers']}-layer model ({dtype}) in {path} ...")
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    d = h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32

    def draw(rows: int, cols: int, fan_in: int) -> torch.Tensor:
        a = math.sqrt(3.0 / fan_in)
        return ((torch.rand((rows, cols), generator=gen) * 2 - 1) * a).to(tdtype)

    w = {"model.embed_tokens.weight": draw(shape["vocab_size"], h, 1)}
    for i in range(shape["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        for name, rows, cols in (
            ("self_attn.q_proj", q, h),
            ("self_attn.k_proj", kv, h),
            ("self_attn.v_proj", kv, h),
            ("self_attn.o_proj", h, q),
            ("mlp.gate_proj", inter, h),
            ("mlp.up_proj", inter, h),
            ("mlp.down_proj", h, inter),
        ):
            w[pre + name + ".weight"] = draw(rows, cols, cols)
        w[pre + "input_layernorm.weight"] = torch.ones(h, dtype=tdtype)
        w[pre + "post_attention_layernorm.weight"] = torch.ones(h, dtype=tdtype)
    w["model.norm.weight"] = torch.ones(h, dtype=tdtype)
    save_file(w, str(out / "model.safetensors"), {"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "head_dim": d,
        "hidden_act": "silu",
        "torch_dtype": dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def model_path(name: str, dtype: str) -> str:
    """The folder of model `name` in `dtype` (or quantized: QUANTIZED), made if missing."""
    if dtype in QUANTIZED:
        from tooling.models.quantize import quantize_folder

        path = f"{MODELS[name]}-{dtype}"
        if not (Path(path) / "config.json").is_file():
            _say(f"quantizing {name} to {dtype} into {path} ...")
            quantize_folder(model_path(name, "float32"), path, QUANTIZED[dtype], "bfloat16")  # type: ignore[arg-type]
        return path
    path = MODELS[name] + ("-bf16" if dtype == "bfloat16" else "")
    if name == "small":
        ensure_model(path, dtype)
    else:
        write_shaped_model(path, SMOLLM2_SHAPE, dtype)
    return path


def make_engine(
    model: str,
    max_batch: int,
    tokens_per_seq: int,
    linear_kernel: str = "auto",
    attention_backend: str = "auto",
    quant_activations: str = "auto",
) -> LLMEngine:
    """An engine sized for `max_batch` sequences of `tokens_per_seq` tokens."""
    per_seq = -(-tokens_per_seq // 16) + 1
    config = EngineConfig.model_validate(
        {
            "num_kv_blocks": 2 * max_batch * per_seq + 8,
            "max_num_batched_tokens": max(4096, max_batch),
            "max_num_seqs": max_batch,
            "linear_kernel": linear_kernel,
            "attention_backend": attention_backend,
            "quant_activations": quant_activations,
        }
    )
    return LLMEngine.from_model_dir(model, config)


def decode_steps(
    engine: LLMEngine,
    prompts: list[list[int]],
    steps: int,
    profile: bool = False,
    reuse_prefix: bool = False,
) -> tuple[list[float], Any]:
    """Prefill `prompts`, then run `steps` decode steps; (each step's seconds, profiler or None).

    Every request decodes exactly `steps` tokens after its first, so all steps run the full
    batch; the blocks are all free again when it returns (checked). `reuse_prefix`: keep the
    prefix cache, so prompts seen before prefill only their last block's tokens."""
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    if not reuse_prefix:
        engine.block_pool.reset_prefix_cache()
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    while _prefilling(engine):
        engine.step()
    times: list[float] = []
    prof = None
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        prof = torch_profile(activities=[ProfilerActivity.CPU])
        prof.start()
    try:
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
    finally:
        if prof is not None:
            prof.stop()
    engine.check_integrity()
    assert engine.block_pool.num_free == engine.num_kv_blocks, "blocks leaked"
    return times, prof


def _prefilling(engine: LLMEngine) -> bool:
    return any(
        r.num_computed_tokens < len(r.prompt_token_ids)
        for r in engine.scheduler.requests.values()
        if r.finish_reason is None
    )


def op_table(prof: Any, steps: int) -> dict[str, float]:
    """Self CPU milliseconds per step for every op the profiler saw."""
    return {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}


def fused_op_profile(engine: LLMEngine, prompts: list[list[int]], steps: int) -> dict[str, float]:
    """ms per step: each op inside the fused C step, and the step's wall time outside it."""
    fused = engine.runner.fused
    assert fused is not None, engine.runner.fused_unsupported
    decode_steps(engine, prompts, 1, reuse_prefix=True)  # prefill outside the timing
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    while _prefilling(engine):
        engine.step()
    fused.start_op_timing()
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    ops = {k: v * 1e3 / len(times) for k, v in fused.stop_op_timing().items()}
    wall = statistics.mean(times) * 1e3
    ops["outside the C step (Python)"] = wall - sum(ops.values())
    ops["step"] = wall
    return ops


def gemm_bytes(engine: LLMEngine) -> dict[str, int]:
    """Weight bytes each fused-step GEMM reads per step (all layers), by `fused_op_profile` op."""
    model = engine.runner.model
    out = {"qkv gemm": 0, "o_proj gemm": 0, "gate/up gemm": 0, "down gemm": 0}
    for layer in decoder_layers(model):
        out["qkv gemm"] += layer.self_attn.qkv_proj.nbytes()
        out["o_proj gemm"] += layer.self_attn.o_proj.nbytes()
        out["gate/up gemm"] += layer.mlp.gate_up_proj.nbytes()
        out["down gemm"] += layer.mlp.down_proj.nbytes()
    out["lm head gemm"] = model.lm_head.nbytes()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="small,smollm2", help=f"of {sorted(MODELS)}")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--threads", default="1,2", help="torch thread counts, interleaved")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile-batches", default="", help="e.g. 1,16 (empty: no op profile)")
    ap.add_argument(
        "--baselines",
        action="store_true",
        help="also time 'auto' (its default decode path) and 'onednn' (torch path), where "
        "the host has oneDNN",
    )
    ap.add_argument(
        "--no-torch-path",
        action="store_true",
        help="skip the avx2 weights' torch-path variant (the step before the fused C step)",
    )
    ap.add_argument(
        "--quant-activations",
        default="auto",
        choices=["auto", "int8", "float32"],
        help="quantized weights (dtypes q8_0, q4_1): how decode steps multiply them",
    )
    ap.add_argument("--out", default="runs/bench/decode_step.json")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    dtypes = [d for d in args.dtypes.split(",") if d]
    batches = [int(b) for b in args.batches.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    profile_batches = [int(b) for b in args.profile_batches.split(",") if b]
    max_b = max(batches + profile_batches)
    tokens = args.context + args.steps + 2
    engines: dict[tuple[str, str, str], LLMEngine] = {}
    for name in models:
        for dtype in dtypes:
            path = model_path(name, dtype)
            engines[(name, dtype, "avx2")] = make_engine(
                path, max_b, tokens, "avx2", quant_activations=args.quant_activations
            )
            if args.baselines:
                auto = make_engine(path, max_b, tokens, "auto")
                if auto.runner.linear_kernel != "avx2":
                    engines[(name, dtype, "auto")] = auto
                if auto.runner.linear_kernel == "onednn":
                    onednn = make_engine(path, max_b, tokens, "onednn")
                    onednn.runner.set_decode_path("torch")
                    engines[(name, dtype, "onednn")] = onednn
    for key, e in engines.items():
        _say(f"{key}: kernel {e.runner.linear_kernel}, decode path {e.runner.decode_path}")
    # variant key: (model, dtype, engine label, decode path)
    variants = [(*k, "fused") for k in engines if k[2] == "avx2"]
    variants += [
        (*k, "torch")
        for k in engines
        if k[2] == "onednn" or (k[2] == "avx2" and not args.no_torch_path)
    ]
    variants += [(*k, e.runner.decode_path) for k, e in engines.items() if k[2] == "auto"]
    best: dict[tuple[str, str, str, str, int, int], float] = {}
    bandwidth: dict[int, MachineInfo] = {}
    for b in batches:
        prompt_sets = {
            name: prompts_for(
                b, args.context, engines[(name, dtypes[0], "avx2")].model_config.vocab_size, seed=b
            )
            for name in models
        }
        for (name, _, _), e in engines.items():  # full prefill once, then prefix-cache hits
            decode_steps(e, prompt_sets[name], 2, reuse_prefix=True)
        for rnd in range(args.rounds):
            for t in threads:
                torch.set_num_threads(t)
                m = measure_machine(size_mb=256, gemm_n=256, repeats=3)
                bandwidth[t] = m if t not in bandwidth else bandwidth[t].best_of(m)
                for name, dtype, kernel, path in variants:
                    e = engines[(name, dtype, kernel)]
                    if kernel == "avx2":
                        e.runner.set_decode_path(path)  # type: ignore[arg-type]
                    times, _ = decode_steps(e, prompt_sets[name], args.steps, reuse_prefix=True)
                    vkey = (name, dtype, kernel, path, t, b)
                    best[vkey] = min(best.get(vkey, math.inf), statistics.median(times))
            _say(
                f"batch {b} round {rnd + 1}: "
                + ", ".join(
                    f"{k[0]}/{k[1]}/{k[3]}/{k[4]}t {v * 1e3:.1f}"
                    for k, v in best.items()
                    if k[5] == b and k[2] == "avx2"
                )
            )
    profiles: dict[str, dict[str, float]] = {}
    for b in profile_batches:
        for t in threads:
            torch.set_num_threads(t)
            for (name, dtype, kernel), e in engines.items():
                if kernel != "avx2":
                    continue
                e.runner.set_decode_path("fused")
                prompts = prompts_for(b, args.context, e.model_config.vocab_size, seed=b)
                ops = fused_op_profile(e, prompts, max(8, args.steps))
                profiles[f"{name} {dtype} {t}t b{b}"] = ops
                _say(f"profiled {name} {dtype} {t} thread(s) batch {b}: {ops['step']:.2f} ms")
    result = summarize(args, engines, bandwidth, best, profiles)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    table = render(result)
    out.with_suffix(".md").write_text(table)
    print(table)
    return 0


def summarize(
    args: argparse.Namespace,
    engines: dict[tuple[str, str, str], LLMEngine],
    bandwidth: dict[int, MachineInfo],
    best: dict[tuple[str, str, str, str, int, int], float],
    profiles: dict[str, dict[str, float]],
) -> dict[str, Any]:
    wbytes = {f"{k[0]} {k[1]}": weight_bytes(e) for k, e in engines.items() if k[2] == "avx2"}
    rows = []
    for (name, dtype, kernel, path, t, b), sec in best.items():
        if kernel != "avx2" or path != "fused":
            continue
        bw = bandwidth[t].memory_bandwidth_gbs * 1e9
        floor_ms = wbytes[f"{name} {dtype}"] / bw * 1e3
        row: dict[str, Any] = {
            "model": name,
            "dtype": dtype,
            "threads": t,
            "batch": b,
            "bandwidth_gbs": bw / 1e9,
            "floor_ms": floor_ms,
            "fused_ms": sec * 1e3,
            "torch_ms": best.get((name, dtype, kernel, "torch", t, b), math.nan) * 1e3,
        }
        for (n2, d2, k2, _p2, t2, b2), s2 in best.items():
            if (n2, d2, t2, b2) == (name, dtype, t, b) and k2 != "avx2":
                row[f"{k2}_ms"] = s2 * 1e3
        row["fused_over_floor"] = row["fused_ms"] / floor_ms
        if "auto_ms" in row:
            row["auto_over_floor"] = row["auto_ms"] / floor_ms
        rows.append(row)
    by_key = {(r["model"], r["dtype"], r["threads"], r["batch"]): r for r in rows}
    for r in rows:
        one = by_key.get((r["model"], r["dtype"], r["threads"], 1))
        r["over_batch1"] = r["fused_ms"] / one["fused_ms"] if one else None
        single = by_key.get((r["model"], r["dtype"], 1, r["batch"]))
        r["over_1_thread"] = r["fused_ms"] / single["fused_ms"] if single else None
    gemms = {f"{k[0]} {k[1]}": gemm_bytes(e) for k, e in engines.items() if k[2] == "avx2"}
    return {
        "benchmark": "decode_step",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "context": args.context,
        "steps": args.steps,
        "quant_activations": args.quant_activations,
        "rounds": args.rounds,
        "machine": {str(t): m.to_json() for t, m in bandwidth.items()},
        "weight_bytes": wbytes,
        "gemm_bytes": gemms,
        "rows": rows,
        "profiles": profiles,
    }


def render(result: dict[str, Any]) -> str:
    rows = result["rows"]
    extra = sorted(
        {k for r in rows for k in r if k.endswith("_ms")} - {"floor_ms", "fused_ms", "torch_ms"}
    )
    auto = any("auto_over_floor" in r for r in rows)
    lines = [
        f"# Decode step vs weight-streaming floor ({result['date']}, CPU capability "
        f"{result['cpu_capability']}, context {result['context']}, best of "
        f"{result['rounds']} rounds x {result['steps']} steps)",
        "",
        "Bandwidth measured in this run per thread count: "
        + ", ".join(
            f"{t} thread(s) {m['memory_bandwidth_gbs']:.1f} GB/s"
            for t, m in result["machine"].items()
        )
        + ". Floor = weight bytes / that bandwidth. `fused`: the step in one C call; `torch`: "
        "the same packed weights through the torch modules"
        + (
            "; `onednn_ms`: oneDNN weights, torch path (the old `auto` on AVX-512 hosts); "
            "`auto_ms`: the `auto` kernel with its default decode path"
            if extra
            else ""
        )
        + ".",
        "",
        "| model | dtype | threads | batch | floor ms | fused ms | fused / floor | torch ms | "
        + "".join(f"{k} | " for k in extra)
        + ("auto / floor | " if auto else "")
        + "x batch 1 | x 1 thread |",
        "|---|---|---:|---:|---:|---:|---:|---:|"
        + "---:|" * (len(extra) + int(auto))
        + "---:|---:|",
    ]

    def ratio(v: float | None) -> str:
        return "" if v is None else f"{v:.2f}"

    for r in sorted(rows, key=lambda r: (r["model"], r["dtype"], r["batch"], r["threads"])):
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['threads']} | {r['batch']} | "
            f"{r['floor_ms']:.2f} | {r['fused_ms']:.2f} | **{r['fused_over_floor']:.2f}** | "
            f"{r['torch_ms']:.2f} | "
            + "".join(f"{r[k]:.2f} | " if k in r else " | " for k in extra)
            + (f"**{ratio(r.get('auto_over_floor'))}** | " if auto else "")
            + f"{ratio(r['over_batch1'])} | {ratio(r['over_1_thread'])} |"
        )
    if result["profiles"]:
        lines += ["", *render_fused_profile(result)]
    return "\n".join(lines) + "\n"


def render_fused_profile(result: dict[str, Any]) -> list[str]:
    """Ops as rows, profiled configurations as columns, ms per step; each GEMM's own floor."""
    profiles: dict[str, dict[str, float]] = result["profiles"]
    cols = list(profiles)
    names = list(next(iter(profiles.values())))
    lines = [
        "### Fused step: ms per step by op (wall time inside the C step; GEMM floors = its "
        "weight bytes / the bandwidth above)",
        "",
        "| op | " + " | ".join(cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for n in names:
        cells = []
        for c in cols:
            cell = f"{profiles[c][n]:.2f}"
            model, dtype, threads = c.split()[:3]
            nbytes = result["gemm_bytes"][f"{model} {dtype}"].get(n)
            if nbytes:
                bw = result["machine"][threads.rstrip("t")]["memory_bandwidth_gbs"] * 1e9
                cell += f" (floor {nbytes / bw * 1e3:.2f})"
            cells.append(cell)
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
