"""`pdserve demo` (what `make demo` runs). Orchestrator process.

1. Get the model: SmolLM2-135M-Instruct by default, pulled and converted once
   (`tooling.models.pull`, idempotent; a folder that already holds a model is used as it is).
2. Start the benchmark's clusters (colocated, colocated without chunking, disaggregated 1P1D,
   and hybrid 1P1D — disaggregated, short prompts prefilled on the decode worker;
   `clusters`) with their OpenAI HTTP fronts open, and ask the disaggregated one ONE question
   over `POST /v1/chat/completions` (greedy): the question and the model's answer go to stdout.
3. Run the goodput comparison (`bench.run_bench` with `DEMO`) on the same clusters: prompts are
   windows of real English text (`text_prompts`), outputs are held at exactly `output_len`
   tokens with `ignore_eos`, because a real model stops at its end-of-sequence token and the
   comparison needs the same work per request everywhere. The report path and the headline go
   to stdout, progress to stderr.

`DEMO` is sized for a 2-core machine: about 10 minutes in all with the three fixed
configurations; hybrid, the fourth, adds about a third to that.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tooling.goodput.bench import BenchConfig, run_bench
from tooling.goodput.clusters import CONFIG_NAMES, ClusterSet
from tooling.launch import Cluster, LaunchCluster

QUESTION = "What is the capital of France?"
CHAT_CONFIG = "disagg"

DEMO: dict[str, Any] = {
    # Summarize-style prompts of real text within a 512-token budget, 24-token outputs, a TPOT
    # SLO a few decode steps wide, a loose TTFT SLO. Rates and one bisection step sized for
    # SmolLM2's 30 layers on 2 cores (max goodput 0.2-0.45 x the prefill-bound rate there),
    # so that the demo takes about 10 minutes.
    "workload": "summarize",
    "prompts": "text",
    "context": 512,
    "output_len": 24,
    "ttft_scale": 8.0,
    "tpot_scale": 3.0,
    "rel_rates": (0.2, 0.4, 0.8),
    "duration_s": 20.0,
    "min_requests": 12,
    "bisect_steps": 1,
    "chunk_tokens": 256,
}


def demo_config(model: Path, out: Path, seed: int = 0) -> BenchConfig:
    """The demo's `BenchConfig`: `DEMO`, every configuration, HTTP fronts open."""
    return BenchConfig(
        out=out, model=model, seed=seed, calibrate_on="colocated", http_front=True,
        configs=CONFIG_NAMES,
        title="pdserve demo: disaggregated, hybrid and colocated goodput (SmolLM2-135M-Instruct)",
        **DEMO,
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
    """Print one question and the disaggregated cluster's answer (stdout)."""
    url = clusters.clusters[CHAT_CONFIG].http_url
    if url is None:
        raise RuntimeError(f"the {CHAT_CONFIG} cluster has no HTTP front")
    print(f"chat over the OpenAI API ({CHAT_CONFIG}: 1 prefill + 1 decode worker, {url}):")
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
    """`model` when it already holds a model folder; else SmolLM2-135M-Instruct pulled and
    converted into it (`pull`, idempotent). Raises `PullError` saying what it tried."""
    if (model / "config.json").is_file():
        return model
    from tooling.models.pull import pull

    print(f"pdserve demo: pulling smollm2-135m-instruct into {model} ...", file=sys.stderr)
    return pull("smollm2-135m-instruct", out=model)


def run_demo(
    model: Path, out: Path, seed: int = 0, launch: LaunchCluster[Cluster] | None = None
) -> Any:
    """Steps 2 and 3 of the module docstring on the model folder `model`; returns the
    report's `Summary`."""
    return run_bench(demo_config(model, out, seed), launch=launch, on_started=show_chat)
