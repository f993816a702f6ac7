"""Pool several `benchmarks.bench_kvtransfer` runs into one verdict per prompt length.

    python -m benchmarks.kvtransfer_pool runs/bench/kvtransfer_*.json

One run's paired ratio is the median of its reps' ratios (raw gloo / transfer, each transfer
against the raw run right beside it); on a shared 2-core host one run of 25 reps still moves by
+-15 %. This pools the rep-by-rep ratios of every run given and prints, per prompt length, their
median with a rank-based ~90 % confidence interval, beside the per-run values and each run's
best shared-memory transfer against its best memcpy (`shm_vs_memcpy`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any


def median_interval(xs: list[float], z: float = 1.645) -> tuple[float, float, float]:
    """The median of `xs` and a distribution-free ~90 % interval for it (order statistics)."""
    s, n = sorted(xs), len(xs)
    half = z * math.sqrt(n) / 2
    lo, hi = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half))
    return statistics.median(s), s[lo], s[hi]


def pool(runs: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for run in runs:
        for b in run["bandwidth"]:
            row = out.setdefault(b["tokens"], {"ratios": [], "paired": [], "shm_vs_memcpy": []})
            pairs = zip(b["raw_gloo_s"]["all"], b["transfer_s"]["all"], strict=True)
            row["ratios"].extend(raw / xfer for raw, xfer in pairs)
            row["paired"].append(b["vs_raw_gloo_paired"])
            row["shm_vs_memcpy"].append(b["shm_vs_memcpy"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="bench_kvtransfer JSON files")
    args = ap.parse_args()
    runs = [json.loads(Path(p).read_text()) for p in args.runs]
    print(f"{len(runs)} runs: {', '.join(args.runs)}\n")
    print(
        "| tokens | reps | transfer vs raw gloo, pooled median [~90 % CI] | per run (paired) "
        "| shm vs memcpy per run |"
    )
    print("|---|---|---|---|---|")
    for tokens, row in sorted(pool(runs).items()):
        med, lo, hi = median_interval(row["ratios"])
        per_run = ", ".join(f"{x:.0%}" for x in row["paired"])
        shm = ", ".join(f"{x:.0%}" for x in row["shm_vs_memcpy"])
        print(
            f"| {tokens} | {len(row['ratios'])} | {med:.0%} [{lo:.0%}, {hi:.0%}] | {per_run} "
            f"| {shm} |"
        )


if __name__ == "__main__":
    main()
