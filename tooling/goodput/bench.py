"""The goodput benchmark orchestrator (`pdserve bench`, `pdserve demo`). Orchestrator process.

`run_bench(config)`, step by step:

1. measure the machine (memory bandwidth, matmul FLOP/s) before anything else runs;
2. start one local cluster per configuration (`clusters.start_clusters`), or use the running
   one at `config.address`; with `openai_url`, an OpenAI-compatible server (another engine, or
   pdserve's HTTP front) joins as configuration 'openai', loaded with the same workloads and
   arrivals (`openai_load`); send every target a warm-up request;
3. calibrate the unloaded prefill and decode step times on `calibrate_on` and fix the SLOs:
   milliseconds when given, else `ttft_scale * prefill_ms` and `tpot_scale * decode_ms`;
4. search each configuration's max goodput (`sweep.RateSearch`: the given rates, or
   `rel_rates` x the unloaded prefill-bound rate 1000 / prefill_ms, then bisection),
   interleaving configurations (`sweep.run_interleaved`); each run is one load-generator
   process (`loadgen.run_load_process`) with a fresh token seed, so no run hits the prefix
   cache of another; prompts are random ids, or with `prompts="text"` windows of a built-in
   English corpus (`text_prompts`); outputs always have their exact length (`ignore_eos`);
5. write `results.json` (every request of every run, machine, model, SLOs, seeds) after each
   run, then the Markdown report and PNG plots (`report.write_report`).

It returns the report's `Summary` (max goodput per configuration and the headline).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from security.channels import ClientSecurity
from tooling.cpu import CpuMeter
from tooling.goodput.analysis import SLO, LongPromptSLO, attainment, slo_goodput_rps
from tooling.goodput.arrivals import ArrivalKind
from tooling.goodput.calibrate import calibrate
from tooling.goodput.clusters import (
    CONFIG_NAMES,
    DEFAULT_CONFIGS,
    ClusterSet,
    EngineSizing,
    OpenAITarget,
    start_clusters,
)
from tooling.goodput.loadgen import LoadJob, model_info, run_load_process
from tooling.goodput.openai_load import list_models
from tooling.goodput.records import RequestSpec, RunResult
from tooling.goodput.sweep import RateSearch, run_interleaved
from tooling.goodput.traces import read_trace, scale_to_rate
from tooling.goodput.workloads import WORKLOADS, length_summary, make_requests
from tooling.launch import Cluster, LaunchCluster


class BenchConfig(BaseModel):
    """Everything one `pdserve bench` run needs. Frozen; invalid values name their field."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    out: Path = Field(description="Run folder: results.json, report.md, plots, job files.")
    model: Path = Field(default=Path("models/small"), description="Model folder to serve.")
    address: str | None = Field(
        default=None, description="Bench this running router (host:port) instead of launching."
    )
    openai_url: str | None = Field(
        default=None,
        description="Also bench this OpenAI-compatible server (base URL, e.g. "
        "http://host:8000/v1) as configuration 'openai', beside the others.",
    )
    openai_model: str | None = Field(
        default=None, description="Model name for openai_url (default: the server's first)."
    )
    vocab_size: int | None = Field(
        default=None,
        ge=8,
        description="Vocabulary of openai_url's prompts (token ids); default: the model "
        "folder's, when `model` is one.",
    )
    configs: tuple[str, ...] = Field(
        default=DEFAULT_CONFIGS, description=f"Configurations to compare, from {CONFIG_NAMES}."
    )
    workload: str = Field(default="summarize", description=f"One of {sorted(WORKLOADS)}.")
    trace: Path | None = Field(default=None, description="Replay this trace (.csv/.jsonl).")
    prompts: Literal["random", "text"] = Field(
        default="random",
        description="Prompt tokens: 'random' ids, or 'text': windows of a built-in English "
        "corpus tokenized by `model`'s tokenizer (`text_prompts`). Either way outputs have "
        "their exact length (ignore_eos).",
    )
    http_front: bool = Field(
        default=False,
        description="Also open each launched cluster's OpenAI HTTP front (on a free port).",
    )
    context: int | None = Field(
        default=None, ge=16, description="Context budget for lengths; None = the model's."
    )
    output_len: int | None = Field(default=None, ge=1, description="Fixed output length.")
    arrival: ArrivalKind = Field(default="poisson", description="'poisson' or 'gamma'.")
    cv: float = Field(default=2.0, gt=0, description="Gamma arrivals' coefficient of variation.")
    seed: int = Field(default=0, ge=0, description="Seed of lengths, arrivals and tokens.")
    rates: tuple[float, ...] | None = Field(default=None, description="Sweep rates (req/s).")
    rel_rates: tuple[float, ...] = Field(
        default=(0.25, 0.5, 0.75, 1.0),
        description="Sweep rates as fractions of 1000 / unloaded prefill ms (when no rates).",
    )
    duration_s: float = Field(default=60.0, gt=0, description="Target length of one run.")
    min_requests: int = Field(default=20, ge=1, description="Fewest requests in one run.")
    ttft_slo_ms: float | None = Field(default=None, gt=0, description="TTFT SLO in ms.")
    tpot_slo_ms: float | None = Field(default=None, gt=0, description="TPOT SLO in ms.")
    ttft_scale: float = Field(default=5.0, gt=0, description="TTFT SLO / unloaded prefill.")
    tpot_scale: float = Field(default=5.0, gt=0, description="TPOT SLO / unloaded decode step.")
    long_prompt_slo: str | None = Field(
        default=None,
        description="'N:TTFT_MS:TPOT_MS': prompts of >= N tokens are judged by these SLOs "
        "instead (per-class SLOs, e.g. summarization beside chat); None = one SLO for all.",
    )
    target: float = Field(default=0.9, gt=0, le=1, description="Attainment target.")
    bisect_steps: int = Field(default=2, ge=0, description="Bisection runs per configuration.")
    calibrate_on: str | None = Field(
        default=None, description="Configuration calibrated for relative SLOs (default first)."
    )
    threads: int = Field(default=2, ge=1, description="Total torch threads per configuration.")
    chunk_tokens: int = Field(default=256, ge=16, description="Chunked-prefill step budget.")
    num_kv_blocks: int = Field(default=1024, ge=16, description="KV blocks per worker.")
    max_num_seqs: int = Field(default=32, ge=1, description="Running requests per worker.")
    device: str = Field(default="cpu", description="Workers' torch device, e.g. 'cuda'.")
    request_timeout_s: float | None = Field(
        default=None, gt=0, description="Per-request deadline; None = 5 x the SLO budget."
    )
    title: str = Field(default="pdserve goodput benchmark", description="Report title.")
    client_security: dict[str, Any] = Field(
        default_factory=dict,
        description="How to reach `address` (TLS, client certificate, token file): "
        "`security.channels.ClientSecurity.to_json`; file paths only.",
    )

    @model_validator(mode="after")
    def _check(self) -> BenchConfig:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {self.workload!r}")
        if self.address is None:
            bad = [c for c in self.configs if c not in CONFIG_NAMES]
            if bad or (not self.configs and self.openai_url is None):
                raise ValueError(f"configs must be a non-empty subset of {CONFIG_NAMES}: {bad}")
        if self.openai_url is not None and not self.openai_url.startswith(("http://", "https://")):
            raise ValueError(f"openai_url must be an http(s) URL, got {self.openai_url!r}")
        known = (*self.configs, "openai") if self.openai_url else self.configs
        if self.calibrate_on is not None and self.calibrate_on not in known:
            raise ValueError(f"calibrate_on={self.calibrate_on!r} is not in {self.configs}")
        if self.rates is not None and (not self.rates or min(self.rates) <= 0):
            raise ValueError(f"rates must be positive, got {self.rates}")
        if self.long_prompt_slo is not None:
            LongPromptSLO.parse(self.long_prompt_slo)  # ValueError names the expected form
        return self


_T0 = time.monotonic()


def say(msg: str) -> None:
    """Progress lines (seconds since import) go to stderr; stdout keeps only the headline."""
    print(f"[{time.monotonic() - _T0:5.0f} s] {msg}", file=sys.stderr, flush=True)


def model_context(model: Path) -> int:
    """max_position_embeddings of an HF model folder (read from config.json, no torch)."""
    return int(json.loads((model / "config.json").read_text())["max_position_embeddings"])


def specs_for(cfg: BenchConfig, context: int, rate: float) -> list[RequestSpec]:
    """The requests of one run at `rate`: the trace scaled to it, or the synthetic workload
    with max(min_requests, rate * duration_s) requests."""
    if cfg.trace is not None:
        return scale_to_rate(read_trace(cfg.trace), rate)
    n = max(cfg.min_requests, math.ceil(rate * cfg.duration_s))
    return make_requests(
        cfg.workload, n, rate, context=context, seed=cfg.seed, arrival=cfg.arrival, cv=cfg.cv,
        output_len=cfg.output_len,
    )  # fmt: skip


def _slo(cfg: BenchConfig, calib: dict[str, Any] | None) -> SLO:
    long = None if cfg.long_prompt_slo is None else LongPromptSLO.parse(cfg.long_prompt_slo)
    if cfg.ttft_slo_ms is not None and cfg.tpot_slo_ms is not None:
        return SLO(cfg.ttft_slo_ms, cfg.tpot_slo_ms, long)
    if calib is None:
        raise ValueError("relative SLOs need a calibration")
    ttft = cfg.ttft_slo_ms or cfg.ttft_scale * calib["prefill_ms"]
    tpot = cfg.tpot_slo_ms or cfg.tpot_scale * calib["decode_ms"]
    return SLO(round(ttft, 1), round(tpot, 1), long)


class Bench:
    """State of one benchmark while it runs (see the module docstring for the steps)."""

    def __init__(
        self,
        cfg: BenchConfig,
        clusters: ClusterSet,
        meta: dict[str, Any],
        corpus: list[int] | None = None,
    ) -> None:
        self.cfg = cfg
        self.corpus = corpus  # token stream of text prompts; None = random ids
        self.clusters = clusters
        self.meta = meta
        self.runs: list[RunResult] = []
        self.slo: SLO | None = None

    def prepare(self, context: int) -> None:
        """Warm every cluster up, calibrate, fix the SLOs and the sweep rates."""
        cfg = self.cfg
        sample = specs_for(cfg, context, 1.0)
        lengths = length_summary(sample)
        prompt = max(1, int(lengths["input_p50"]))
        out = max(8, min(32, int(lengths["output_p50"])))
        self.meta["lengths"] = lengths
        names = self.clusters.names
        ref = cfg.calibrate_on or names[0]
        unloaded = self.meta["unloaded"] = {}
        for name in names:  # every cluster: warm-up request, then its unloaded latencies
            addr = self.clusters.address(name)
            say(f"warming up and calibrating {name} ({addr}) ...")
            repeats = 5 if name == ref else 2
            job = {**self.clusters.job_fields(name), "security": self._security(name)}
            calib = asyncio.run(calibrate(name, addr, prompt, out, repeats=repeats, **job))
            unloaded[name] = calib.to_json()
            say(f"  unloaded {name}: TTFT {calib.prefill_ms:.1f} ms, TPOT {calib.decode_ms:.1f} ms")
        c = self.meta["calibration"] = unloaded[ref]
        say(f"unloaded on {ref}: prefill {c['prefill_ms']:.1f} ms ({prompt} tokens), "
            f"decode step {c['decode_ms']:.1f} ms")  # fmt: skip
        self.slo = _slo(cfg, c)
        self.meta["slo"] = self.slo.to_json()
        if cfg.rates is not None:
            rates = list(cfg.rates)
        else:
            base = 1000.0 / c["prefill_ms"]
            rates = [round(base * r, 3) for r in cfg.rel_rates]
        self.meta["sweep_rates"] = rates
        say(f"SLOs: {self.slo.text()}; rates {rates}")

    def _security(self, name: str) -> dict[str, Any]:
        """Client credentials for cluster `name`: the configured ones for the external router,
        none for clusters this run launched (plaintext on 127.0.0.1)."""
        return dict(self.cfg.client_security) if name in self.clusters.external else {}

    def timeout_s(self) -> float:
        if self.cfg.request_timeout_s is not None:
            return self.cfg.request_timeout_s
        assert self.slo is not None
        out = float(self.meta["lengths"]["output_max"])
        classes = [(self.slo.ttft_ms, self.slo.tpot_ms)]
        if self.slo.long_prompt is not None:
            classes.append((self.slo.long_prompt.ttft_ms, self.slo.long_prompt.tpot_ms))
        return max(30.0, max(5 * (ttft + out * tpot) / 1e3 for ttft, tpot in classes))

    def run_point(self, name: str, rate: float, k: int, context: int) -> float:
        """One run of configuration `name` at `rate` in its own load-generator process."""
        cfg = self.cfg
        assert self.slo is not None
        job = LoadJob(
            address=self.clusters.address(name),
            specs=specs_for(cfg, context, rate),
            config=name,
            rate=rate,
            arrival="trace" if cfg.trace else cfg.arrival,
            seed=cfg.seed,
            token_seed=cfg.seed * 1000 + k,
            timeout_s=self.timeout_s(),
            label=f"{name}-{k}",
            **self.clusters.job_fields(name),
            security=self._security(name),
            corpus=self.corpus,
        )
        t0 = time.monotonic()
        load_before = os.getloadavg()[0]
        meter = CpuMeter()
        meter.start(self.clusters.pids(name))
        run = run_load_process(job, self.cfg.out / "jobs")
        run.meta["cpu"] = meter.stop({"loadgen": float(run.meta.get("loadgen_cpu_s", 0.0))})
        run.meta["loadavg_1min"] = [load_before, os.getloadavg()[0]]
        self.runs.append(run)
        att = attainment(run.records, self.slo)
        bad = "" if run.valid else f"  INVALID (send lag p99 {run.send_lag_p99_ms:.1f} ms)"
        say(
            f"{name:>18} @ {rate:7.3f} req/s: {len(run.records)} req, attainment "
            f"{att.both:6.1%} (TTFT {att.ttft:6.1%}, TPOT {att.tpot:6.1%}, errors {att.errors}), "
            f"SLO goodput {slo_goodput_rps(run, self.slo):.3f} req/s, "
            f"{time.monotonic() - t0:.0f} s{bad}"
        )
        self.save()
        return att.both

    def save(self) -> Path:
        """Write results.json (called after every run, so a crash keeps what was measured)."""
        path = self.cfg.out / "results.json"
        data = {"meta": self.meta, "runs": [r.to_json() for r in self.runs]}
        path.write_text(json.dumps(data))
        return path


def _targets(
    cfg: BenchConfig, meta: dict[str, Any], launch: LaunchCluster[Cluster] | None
) -> tuple[Any, int]:
    """(context manager giving the `ClusterSet` of pdserve configurations, length budget):
    the running router at `cfg.address`, or local clusters of `cfg.configs` started by
    `launch` (none: an OpenAI server alone). Fills `meta["model"]`."""
    if cfg.address is not None:
        security = ClientSecurity.from_json(cfg.client_security)
        info = asyncio.run(model_info(cfg.address, security=security))
        meta["model"] = {"name": info.model, "context_length": info.context_length,
                         "vocab_size": info.vocab_size, "mode": info.mode}  # fmt: skip
        name = cfg.configs[0] if len(cfg.configs) == 1 else "external"
        clusters = ClusterSet(external={name: cfg.address})
        return contextlib.nullcontext(clusters), min(cfg.context or info.context_length,
                                                     info.context_length)  # fmt: skip
    if not cfg.configs:
        return contextlib.nullcontext(ClusterSet()), cfg.context or 0
    if launch is None:
        raise ValueError("configs: local clusters need a launch function (or give address)")
    model_ctx = model_context(cfg.model)
    context = min(cfg.context or model_ctx, model_ctx)
    meta["model"] = json.loads((cfg.model / "config.json").read_text()) | {"path": str(cfg.model)}
    sizing = EngineSizing(
        context, cfg.chunk_tokens, 16, cfg.num_kv_blocks, cfg.max_num_seqs, cfg.device
    )
    say(f"starting {len(cfg.configs)} clusters: {', '.join(cfg.configs)} ...")
    extra = {"router.http_port": 0} if cfg.http_front else {}
    logs = cfg.out / "logs"
    running = start_clusters(cfg.configs, cfg.model, sizing, logs, launch, cfg.threads, **extra)
    return running, context


def _openai_target(cfg: BenchConfig, meta: dict[str, Any]) -> OpenAITarget:
    """`cfg.openai_url` as a target: its model (asked for when not given), the vocabulary
    of its prompts, and a length budget no larger than its context (`meta["context"]`)."""
    assert cfg.openai_url is not None
    url = cfg.openai_url.rstrip("/")
    cards = asyncio.run(list_models(url))
    model = cfg.openai_model or (cards[0]["id"] if cards else "")
    if not model:
        raise ValueError(f"openai_url {url} lists no model; give openai_model")
    card = next((c for c in cards if c.get("id") == model), {})
    vocab = cfg.vocab_size
    if vocab is None and (cfg.model / "config.json").is_file():
        vocab = int(json.loads((cfg.model / "config.json").read_text())["vocab_size"])
    if vocab is None:
        raise ValueError("vocab_size: needed for openai_url's token-id prompts (or a model folder)")
    limit = card.get("max_model_len") or cfg.context
    if limit is None:
        raise ValueError(f"context: {url} does not report max_model_len; give context")
    meta["context"] = min(meta["context"] or int(limit), int(limit))
    meta["openai"] = {"url": url, "model": model, "vocab_size": vocab, "max_model_len": limit}
    return OpenAITarget(url, model, vocab)


def _corpus(cfg: BenchConfig, meta: dict[str, Any]) -> list[int] | None:
    """The token stream of text prompts (`cfg.prompts == "text"`), tokenized by `cfg.model`'s
    tokenizer; None for random ids. Fills `meta["prompts"]`."""
    if cfg.prompts == "random":
        meta["prompts"] = {"kind": "random"}
        return None
    from tooling.goodput.text_prompts import corpus_ids

    ids = corpus_ids(cfg.model)
    meta["prompts"] = {"kind": "text", "corpus_tokens": len(ids), "tokenizer": str(cfg.model)}
    return ids


def run_bench(
    cfg: BenchConfig,
    on_ready: Callable[[Bench], None] | None = None,
    launch: LaunchCluster[Cluster] | None = None,
    on_started: Callable[[ClusterSet], None] | None = None,
) -> Any:
    """Run the whole benchmark (module docstring); returns `report.Summary`. `launch`
    starts the local clusters of `cfg.configs` (`tooling.launch`; not needed with
    `cfg.address`). `on_started` is called once the targets run, before any warm-up;
    `on_ready` once the SLOs are fixed, before the first run."""
    from tooling.goodput.report import write_report
    from tooling.machine import measure_machine

    cfg.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    say("measuring the machine ...")
    machine = measure_machine(size_mb=256, gemm_n=1024, repeats=3).to_json()
    meta: dict[str, Any] = {"config": cfg.model_dump(mode="json"), "machine": machine}
    meta["started"] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
    corpus = _corpus(cfg, meta)
    clusters_cm, context = _targets(cfg, meta, launch)
    meta["context"] = context
    with clusters_cm as clusters:
        if on_started is not None:
            on_started(clusters)
        if cfg.openai_url is not None:
            clusters.openai["openai"] = _openai_target(cfg, meta)
            context = meta["context"]
        meta["clusters"] = clusters.describe()
        bench = Bench(cfg, clusters, meta, corpus)
        bench.prepare(context)
        if on_ready is not None:
            on_ready(bench)
        rates = meta["sweep_rates"]
        searches = {n: RateSearch(rates, cfg.target, cfg.bisect_steps) for n in clusters.names}
        run_interleaved(searches, lambda n, r, k: bench.run_point(n, r, k, context))
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    meta["wall_s"] = round(time.time() - started, 1)
    bench.save()
    return write_report(cfg.out)
