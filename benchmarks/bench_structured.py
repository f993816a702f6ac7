"""What structured output costs in the engine: TPOT at batch 1 and 16 and TTFT (warm grammar
cache) of constrained against unconstrained requests, and the cold compile time.

Standalone, in-process `LLMEngine` (the engine step is where masks are filled and applied; the
RPC path around it is the same with or without a grammar). Default model: SmolLM2-135M-Instruct
float32 from `pdserve pull`. One command, for a quiet rerun:

    python benchmarks/bench_structured.py [--model-dir DIR] [--steps 48] [--repeats 3]
        [--out runs/structured]

- TPOT: the same prompts decode `--steps` tokens, unconstrained or each under a JSON schema
  that keeps it inside a long array (so no request ends early); mean step time over the
  decode steps after the first token, best of `--repeats` (the machine is shared), at batch 1
  and 16. Overhead = constrained / unconstrained - 1.
- TTFT: one request's prefill step (first token), grammar already cached, against the same
  request unconstrained; median of `--repeats`.
- cold compile: `Grammars.compile` of each schema in `tooling.json_schemas.SCHEMAS`, first
  time (a fresh `Grammars`).

Writes `results.json` to `--out` and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from model_runtime.engine import LLMEngine
from model_runtime.engine_config import EngineConfig
from model_runtime.grammar import Grammars
from model_runtime.sampling_params import SamplingParams
from model_runtime.structured import StructuredOutput
from model_runtime.tokenizer import Tokenizer
from tooling.json_schemas import SCHEMAS

LONG = StructuredOutput(
    "json",
    json.dumps(
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "minItems": 200,
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "maxLength": 12},
                            "n": {"type": "integer"},
                        },
                        "required": ["name", "n"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["items"],
            "additionalProperties": False,
        }
    ),
)


def _decode_step_s(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, steps: int
) -> float:
    """Mean seconds per decode step of `prompts` run together (after their first token)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    while not all(
        engine.scheduler.requests[f"b{i}"].num_output_tokens for i in range(len(prompts))
    ):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = (time.perf_counter() - t0) / steps
    for i in range(len(prompts)):
        if f"b{i}" in engine.scheduler.requests:
            engine.abort_request(f"b{i}")
    return dt


def _ttft_s(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> float:
    engine.add_request("t", prompt, params)
    t0 = time.perf_counter()
    while engine.scheduler.requests["t"].num_output_tokens == 0:
        engine.step()
    dt = time.perf_counter() - t0
    engine.abort_request("t")
    return dt


def run(model_dir: Path, steps: int, repeats: int) -> dict[str, Any]:
    cfg = EngineConfig(
        dtype="float32", num_kv_blocks=1024, max_num_seqs=16, enable_prefix_caching=False
    )
    engine = LLMEngine.from_model_dir(model_dir, cfg)
    tok = Tokenizer.from_model_dir(model_dir)
    base = tok.encode("List many items with a name and a number each, as JSON.", add_bos=False)
    prompts = [base + tok.encode(f" Set {i}.", add_bos=False) for i in range(16)]
    free = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    constrained = SamplingParams(max_tokens=steps + 8, ignore_eos=True, structured=LONG)
    assert engine.grammars is not None
    engine.grammars.compile(LONG)
    out: dict[str, Any] = {"model_dir": str(model_dir), "steps": steps, "repeats": repeats}
    for batch in (1, 16):
        ps = prompts[:batch]
        _decode_step_s(engine, ps, free, 4)  # warm-up
        f = min(_decode_step_s(engine, ps, free, steps) for _ in range(repeats))
        c = min(_decode_step_s(engine, ps, constrained, steps) for _ in range(repeats))
        out[f"tpot_ms_b{batch}"] = {
            "unconstrained": f * 1e3,
            "constrained": c * 1e3,
            "overhead": c / f - 1,
        }
    f_ttft = statistics.median(_ttft_s(engine, prompts[0], free) for _ in range(repeats))
    c_ttft = statistics.median(_ttft_s(engine, prompts[0], constrained) for _ in range(repeats))
    out["ttft_ms_warm"] = {
        "unconstrained": f_ttft * 1e3,
        "constrained": c_ttft * 1e3,
        "overhead_ms": (c_ttft - f_ttft) * 1e3,
    }
    text = (model_dir / "tokenizer.json").read_text()
    t0 = time.perf_counter()
    fresh = Grammars(text, engine.model_config.vocab_size, engine.model_config.eos_token_ids)
    out["tokenizer_info_s"] = time.perf_counter() - t0
    compile_ms = []
    for s in SCHEMAS:
        t0 = time.perf_counter()
        fresh.compile(StructuredOutput("json", json.dumps(s.schema)))
        compile_ms.append((time.perf_counter() - t0) * 1e3)
    out["cold_compile_ms"] = {
        "median": statistics.median(compile_ms),
        "max": max(compile_ms),
        "schemas": len(compile_ms),
    }
    return out


def main() -> None:
    from tooling.models.pull import default_out

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model-dir", type=Path, default=default_out("smollm2-135m-instruct", "float32")
    )
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default="runs/structured")
    args = ap.parse_args()
    res = run(args.model_dir, args.steps, args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(res, indent=2))
    for b in (1, 16):
        r = res[f"tpot_ms_b{b}"]
        was, now, change = r["unconstrained"], r["constrained"], 100 * r["overhead"]
        print(f"TPOT batch {b}: {was:.1f} -> {now:.1f} ms ({change:+.1f} %)")
    t = res["ttft_ms_warm"]
    was, now, extra = t["unconstrained"], t["constrained"], t["overhead_ms"]
    print(f"TTFT warm: {was:.1f} -> {now:.1f} ms ({extra:+.1f} ms)")
    cc = res["cold_compile_ms"]
    med, top, n = cc["median"], cc["max"], cc["schemas"]
    print(f"cold compile: median {med:.2f} ms, max {top:.2f} ms ({n} schemas)")
    print(f"tokenizer info: {res['tokenizer_info_s']:.2f} s")
    print(f"wrote {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
