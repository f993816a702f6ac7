"""The shared-prefix workload of `benchmarks.bench_prefix_routing`: the model it runs, the
requests it sends, and the oracle hit rate they allow. Torch-free (the model is made in a
child process)."""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
from pathlib import Path

from model_runtime.hashing import block_hash_chain

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16


# A preset between "tiny" (gRPC and KV-transfer overheads hide the prefix cache) and "small"
# (a run takes long on 2 cores): ~13M parameters. Since the oneDNN GEMMs, a cold 576-token
# prefill takes ~110 ms on one thread of the 2-core dev machine and a 64-token suffix after a
# cached prefix ~15 ms, so fixed per-request costs weigh more than when it was chosen.
MEDIUM = (
    "RandomModelPreset(vocab_size=4096, hidden_size=384, intermediate_size=1024, "
    "num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2, "
    "max_position_embeddings=2048, rope_theta=10000.0, corpus_words=50_000)"
)


def make_model(out: Path, preset: str) -> Path:
    """Build the random model in a child process (this process stays torch-free)."""
    code = "import sys; from tooling.models import random_model as rm; "
    if preset == "medium":  # registered in the child only
        code += f"rm.PRESETS['medium'] = rm.{MEDIUM}; "
    code += "rm.make_random_model(sys.argv[1], sys.argv[2])"
    subprocess.run([sys.executable, "-c", code, str(out), preset], check=True, cwd=REPO)
    return out


def workload(args: argparse.Namespace) -> list[tuple[int, list[int]]]:
    """(group, prompt token ids) in send order: every group's requests, shuffled (seeded)."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(4, 1000) for _ in range(args.prefix)] for _ in range(args.groups)]
    reqs = [
        (g, prefixes[g] + [rng.randrange(4, 1000) for _ in range(args.suffix)])
        for g in range(args.groups)
        for _ in range(args.per_group)
    ]
    rng.shuffle(reqs)
    return reqs


def oracle_hit_rate(reqs: list[tuple[int, list[int]]]) -> float:
    """Cached / prompt tokens with one infinite cache shared by every worker (the block holding
    a prompt's last token always runs, as in the scheduler)."""
    seen: set[int] = set()
    cached = total = 0
    for _, ids in reqs:
        chain = block_hash_chain(ids, BLOCK)
        reusable = (len(ids) - 1) // BLOCK
        n = 0
        while n < reusable and chain[n] in seen:
            n += 1
        cached += n * BLOCK
        total += len(ids)
        seen.update(chain)
    return cached / total
