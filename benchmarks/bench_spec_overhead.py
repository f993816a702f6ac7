"""What speculative decoding costs a request that accepts nothing, in process. Standalone.

    python -m benchmarks.bench_spec_overhead [--model DIR] [--dtype bfloat16] [--threads 2]
        [--method ngram|draft] [--draft DIR] [--k 4] [--requests 6] [--tokens 128]
        [--prompt-len 128] [--out runs/spec-overhead-YYYYmmdd-HHMMSS.json]

One engine (`LLMEngine`, the worker's, `--threads` torch threads) with `[engine.speculative]`
runs `--requests` pairs of single requests to their end, one at a time: random token-id
prompts, seeded sampling at temperature 1, `ignore_eos` (nothing to quote, no repetition),
each once with speculation and once opted out (`SamplingParams.speculative = False`, a plain
decode step), in alternating order. Two measurements:

1. the decode time per token of each (engine steps after the first token, wall clock) and the
   ratio, median of pairs — the end-to-end effect, as noisy as the machine;
2. the time spent inside speculation itself per token (the scheduler's lookahead callback,
   the proposer and `end_step`, each timed around its call; wall clock, and the engine
   thread's CPU time, which leaves out a loaded machine's waits) over the plain step time:
   what speculation adds when it finds nothing, measured directly, so a shared machine's noise
   does not hide it. With a draft model that never agrees
   (`--method draft` with an unrelated draft, e.g. `pdserve make-model --preset small-draft`
   for `--model` a `small` model) this includes the draft's forwards until k backs off and the
   probes after.

Prints one JSON object; writes it to `--out`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from model_runtime.engine import LLMEngine
from model_runtime.engine_config import EngineConfig
from model_runtime.request import Request
from model_runtime.sampling_params import SamplingParams
from model_runtime.speculative.speculator import Speculator


class TimedSpeculator(Speculator):
    """The engine's speculator, with the time spent in each of its calls added up."""

    def __init__(self, inner: Speculator) -> None:
        super().__init__(inner.proposer, inner.k_max, inner.max_step_rows)
        self.seconds = 0.0  # wall clock
        self.cpu_seconds = 0.0  # the engine thread's CPU (a loaded machine's waits left out)

    def _timed(self, fn: Callable[[], Any]) -> Any:
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fn()
        finally:
            self.seconds += time.perf_counter() - t
            self.cpu_seconds += time.thread_time() - c

    def lookahead(self, request: Request) -> int:
        return int(self._timed(lambda: super(TimedSpeculator, self).lookahead(request)))

    def propose(self, requests: Sequence[Request], grants: Sequence[int]) -> list[list[int]]:
        out: list[list[int]] = self._timed(
            lambda: super(TimedSpeculator, self).propose(requests, grants)
        )
        return out

    def end_step(self, verified: Any) -> None:
        self._timed(lambda: super(TimedSpeculator, self).end_step(verified))


def run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[float, int]:
    """(wall seconds of the steps after the first token, tokens after the first)."""
    engine.add_request("r", prompt, params)
    first: float | None = None
    n = 0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if first is None:
                first = now
            else:
                n += len(o.new_token_ids)
    assert first is not None
    return now - first, n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--method", default="ngram", choices=["ngram", "draft"])
    ap.add_argument("--draft", help="draft model folder (--method draft)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--requests", type=int, default=6, help="request pairs")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument(
        "--out",
        default=f"runs/spec-overhead-{time.strftime('%Y%m%d-%H%M%S')}.json",
        help="JSON file (default: runs/spec-overhead-YYYYmmdd-HHMMSS.json)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec: dict[str, Any] = {"method": args.method, "num_speculative_tokens": args.k}
    if args.method == "draft":
        spec["model"] = args.draft
    cfg = EngineConfig(
        dtype=args.dtype,
        num_kv_blocks=64,
        enable_prefix_caching=False,
        speculative=spec,  # type: ignore[arg-type]
    )
    engine = LLMEngine.from_model_dir(args.model, cfg)
    assert engine.speculator is not None
    timed = TimedSpeculator(engine.speculator)
    engine.speculator = timed
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    pairs = []
    spec_steps = 0
    spec_seconds = 0.0
    spec_cpu = 0.0
    for i in range(args.requests + 1):  # the first pair warms up
        prompt = [rng.randrange(4, vocab) for _ in range(args.prompt_len)]
        got: dict[bool, float] = {}
        for on in (True, False) if i % 2 == 0 else (False, True):
            params = SamplingParams(
                max_tokens=args.tokens, temperature=1.0, seed=i, ignore_eos=True, speculative=on
            )
            before, before_cpu = timed.seconds, timed.cpu_seconds
            seconds, n = run_one(engine, prompt, params)
            got[on] = seconds / max(n, 1)
            if on and i:
                spec_seconds += timed.seconds - before
                spec_cpu += timed.cpu_seconds - before_cpu
                spec_steps += n  # at most one step per token
        if i:
            pairs.append(got)
    per_token_on = statistics.median(p[True] for p in pairs)
    per_token_off = statistics.median(p[False] for p in pairs)
    stats = timed.stats
    result = {
        "benchmark": "spec_overhead",
        "model": str(Path(args.model).resolve()),
        "dtype": args.dtype,
        "threads": args.threads,
        "speculative": spec,
        "requests": args.requests,
        "tokens": args.tokens,
        "decode_ms_per_token_spec": per_token_on * 1e3,
        "decode_ms_per_token_off": per_token_off * 1e3,
        "median_pair_ratio": statistics.median(p[True] / p[False] for p in pairs),
        "speculation_us_per_token": spec_seconds / max(spec_steps, 1) * 1e6,
        "speculation_share_of_plain_step": spec_seconds / max(spec_steps, 1) / per_token_off,
        "speculation_cpu_us_per_token": spec_cpu / max(spec_steps, 1) * 1e6,
        "drafts": stats.num_drafts,
        "draft_tokens": stats.num_draft_tokens,
        "accepted_tokens": stats.num_accepted_tokens,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
