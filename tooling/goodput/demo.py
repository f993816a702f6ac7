"""`pdserve demo` (what `make demo` runs). Orchestrator process.

1. Get the model: SmolLM2-135M-Instruct by default, pulled and converted once
   (`tooling.models.pull`, idempotent; a folder that already holds a model is used as it is).
2. Start the benchmark's clusters (`DEMO_CONFIGS`: colocated with chunked prefill and
   disaggregated 1P1D; `--configs` adds colocated without chunking and hybrid 1P1D, see
   `clusters`) with their OpenAI HTTP fronts open, and ask the disaggregated one ONE question
   over `POST /v1/chat/completions` (greedy): the question and the model's answer go to stdout.
3. Run the goodput comparison (`bench.run_bench` with `DEMO`) on the same clusters: prompts are
   windows of real English text (`text_prompts`), outputs are held at exactly `output_len`
   tokens with `ignore_eos`, because a real model stops at its end-of-sequence token and the
   comparison needs the same work per request everywhere. The report path and the headline
   (medians and ranges over 3 trace seeds, `repeats`) go to stdout, progress to stderr.

The search (`sweep`'s rules, `DEMO`): a geometric walk on the grid 0.6 x 2^(k/4) x b, where
b = 1000 / the unloaded colocated TTFT (the prefill-bound rate: 1.2-1.7 req/s for SmolLM2 on
2 cores in earlier runs, most of them on a loaded machine), from 0.25 b to 4 b. Repeat 1
starts at 0.6 b (earlier runs put max goodput between 0.2 b and 1.6 b) and walks until a
passing rate has a failing one above it and a tested one below it; repeats 2 and 3 (the next
trace seeds) start at the previous answer and take about three runs each. Neighbouring grid
rates are 19 % apart, so two runs whose medians differ by one grid step still lie within
25 % of each other. Every run sends 40 requests (more only above 4 req/s: 10 s of arrivals),
so a run at rate r lasts about 40 / r s plus the overhead (load-generator start, the last
answers; ~3 s).

Budget, from these rules and earlier runs (an estimate, not a measurement): start-up, chat and
calibration ~80 s, then sum(40 / r + 3 s) over about 21 runs: colocated 3-4 runs in repeat 1
and 3 in each later one, disagg 6-7 and 3 + 3. With b = 2, colocated at 0.4 b and disagg at
b, that is 40-60 s per colocated run and 15-35 s per disagg run: about 15 minutes (13-17
over simulated attainment noise). The runs' time scales with 1 / b: b = 1.5 takes about 20
minutes, b = 3 about 11. Each extra configuration (`--configs`) adds about a third.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tooling.goodput.bench import BenchConfig, run_bench
from tooling.goodput.clusters import ClusterSet
from tooling.launch import Cluster, LaunchCluster

QUESTION = "What is the capital of France?"
CHAT_CONFIG = "disagg"
DEMO_CONFIGS = ("colocated", "disagg")

DEMO: dict[str, Any] = {
    # Summarize-style prompts of real text within a 512-token budget, 24-token outputs, a TPOT
    # SLO a few decode steps wide, a loose TTFT SLO (the module docstring has the budget).
    "workload": "summarize",
    "prompts": "text",
    "context": 512,
    "output_len": 24,
    "ttft_scale": 8.0,
    "tpot_scale": 3.0,
    "rel_rates": (0.6,),  # the walk's start, x the prefill-bound rate
    "grid_step": 2 ** (1 / 4),  # 19 % between grid rates
    "grid_below": 5,  # floor 0.6 / 2^(5/4) = 0.25 x
    "grid_above": 11,  # ceiling 0.6 x 2^(11/4) = 4.0 x
    "warm_start": True,
    "repeats": 3,
    "duration_s": 10.0,
    "min_requests": 40,
    "bisect_steps": 0,
    "chunk_tokens": 256,
}


def demo_config(
    model: Path,
    out: Path,
    seed: int = 0,
    configs: tuple[str, ...] = DEMO_CONFIGS,
    **overrides: Any,
) -> BenchConfig:
    """The demo's `BenchConfig`: `DEMO` (with `overrides`, e.g. fewer `repeats` for a smoke
    run) on `configs`, calibrated on colocated, HTTP fronts open."""
    return BenchConfig(
        out=out, model=model, seed=seed, calibrate_on="colocated", http_front=True,
        configs=configs,
        title=f"pdserve demo: {', '.join(configs)} goodput (SmolLM2-135M-Instruct)",
        **(DEMO | overrides),
    )  # fmt: skip


def _post(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        data: dict[str, Any] = json.loads(resp.read())
    return data


def chat_once(base_url: str, question: str, max_tokens: int = 48, timeout_s: float = 120.0) -> str:
    """Ask `question` over `POST {base_url}/chat/completions` (greedy) and return the answer's
    text. Raises OSError (urllib's URLError / HTTPError) when the server fails."""
    with urllib.request.urlopen(f"{base_url}/models", timeout=timeout_s) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    answer = _post(f"{base_url}/chat/completions", body, timeout_s)
    return str(answer["choices"][0]["message"]["content"])


def show_chat(clusters: ClusterSet) -> None:
    """Print one question and the disaggregated cluster's answer (stdout; the first cluster's
    when disagg is not among them)."""
    name = CHAT_CONFIG if CHAT_CONFIG in clusters.clusters else next(iter(clusters.clusters))
    url = clusters.clusters[name].http_url
    if url is None:
        raise RuntimeError(f"the {name} cluster has no HTTP front")
    what = "1 prefill + 1 decode worker" if name == CHAT_CONFIG else "one worker"
    print(f"chat over the OpenAI API ({name}: {what}, {url}):")
    print(f"  user:      {QUESTION}")
    t0 = time.monotonic()
    answer = chat_once(url, QUESTION)
    print(f"  assistant: {answer.strip()}")
    print(f"  ({time.monotonic() - t0:.1f} s)", flush=True)
    print(
        "goodput benchmark next: real-text prompts, every output held at exactly "
        f"{DEMO['output_len']} tokens with ignore_eos (a real model would stop at its EOS "
        "token; the comparison needs the same work per request)",
        file=sys.stderr,
        flush=True,
    )


def ensure_model(model: Path) -> Path:
    """`model` when it already holds a model folder; else SmolLM2-135M-Instruct pulled into it
    with its Q4_1 / Q8_0 weights kept quantized and bfloat16 activations (`pull --weights keep`,
    idempotent: the file as it ships, served quantized; it meets the fidelity bounds, see
    `tests/e2e/test_quant_real_model.py`). Raises `PullError` saying what it tried."""
    if (model / "config.json").is_file():
        return model
    from tooling.models.pull import pull

    print(
        f"pdserve demo: pulling smollm2-135m-instruct (Q4_1, kept quantized) into {model} ...",
        file=sys.stderr,
    )
    return pull("smollm2-135m-instruct", out=model, weights="keep")


def run_demo(
    model: Path,
    out: Path,
    seed: int = 0,
    launch: LaunchCluster[Cluster] | None = None,
    configs: tuple[str, ...] = DEMO_CONFIGS,
    **overrides: Any,
) -> Any:
    """Steps 2 and 3 of the module docstring on the model folder `model`; returns the
    report's `Summary`."""
    cfg = demo_config(model, out, seed, configs, **overrides)
    return run_bench(cfg, launch=launch, on_started=show_chat)
