"""How often a prefill worker's prompt sits in consecutive KV blocks — the case the KV transfer
sends straight from the cache (zero-copy, `KVCache.run_start`); any other prompt's layers are
copied out first (`kvtransfer.staging.read_layer`).

    python -m benchmarks.bench_block_runs --out runs/bench/block_runs.json

Drives the colocated engine the way a prefill worker does (``max_tokens=1``, blocks held until
the transfer ends — here one step later) on the random `tiny` model with a mixed workload:
prompt lengths uniform in [20, 600) tokens, half of them behind a shared 160-token system
prompt (prefix-cache hits). Counts, per KV-cache size, the prompts whose blocks are one
ascending run when their last prefill chunk runs (the moment the transfer opens).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

from model_runtime.engine import LLMEngine
from model_runtime.engine_config import EngineConfig
from model_runtime.sampling_params import SamplingParams
from model_runtime.scheduler_types import SchedulerOutput
from tooling.models.random_model import make_random_model

BLOCK = 16


def run_mix(model_dir: str, num_blocks: int, num_prompts: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    engine = LLMEngine.from_model_dir(
        model_dir, EngineConfig(num_kv_blocks=num_blocks, block_size=BLOCK)
    )
    system = [rng.randrange(3, 200) for _ in range(160)]
    prompts: dict[str, list[int]] = {}
    counts = {"run": 0, "scattered": 0, "run_with_prefix": 0, "prompts_with_prefix": 0}
    finished: list[str] = []

    def before_forward(scheduled: SchedulerOutput) -> None:
        for item in scheduled.items:
            if not item.samples:
                continue
            prompt = prompts[item.request_id]
            blocks = list(item.block_table[: -(-len(prompt) // BLOCK)])
            run = all(b == blocks[0] + i for i, b in enumerate(blocks))
            counts["run" if run else "scattered"] += 1
            engine.scheduler.open_send(item.request_id, item.request_id)  # held like a send
            if prompt[: len(system)] == system:
                counts["prompts_with_prefix"] += 1
                counts["run_with_prefix"] += run
            finished.append(item.request_id)

    held: list[str] = []
    for i in range(num_prompts):
        prefix = system if rng.random() < 0.5 else []
        prompts[f"r{i}"] = prefix + [rng.randrange(3, 200) for _ in range(rng.randrange(20, 600))]
        engine.add_request(f"r{i}", prompts[f"r{i}"], SamplingParams(max_tokens=1))
        if i % 3 == 2:  # arrivals in threes
            while engine.has_unfinished():
                engine.step(before_forward)
                for rid in held:  # transfers end one step after they open
                    engine.scheduler.send_result(rid)
                held, finished[:] = list(finished), []
    for rid in held + finished:
        engine.scheduler.send_result(rid)
    total = counts["run"] + counts["scattered"]
    return {"num_blocks": num_blocks, **counts, "run_share": counts["run"] / total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/bench/block_runs.json")
    ap.add_argument("--blocks", default="4096,400", help="KV-cache sizes in blocks")
    ap.add_argument("--prompts", type=int, default=300)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        make_random_model(tmp, "tiny", seed=0)
        rows = [run_mix(tmp, int(n), args.prompts, seed=0) for n in args.blocks.split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"prompts": args.prompts, "rows": rows}, indent=2) + "\n")
    for r in rows:
        print(
            f"{r['num_blocks']:>6} blocks: {r['run']}/{r['run'] + r['scattered']} prompts in one "
            f"run ({r['run_share']:.0%}); with the shared prefix {r['run_with_prefix']}/"
            f"{r['prompts_with_prefix']}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
