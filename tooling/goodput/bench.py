"""The goodput benchmark orchestrator (`pdserve bench`, `pdserve demo`). Orchestrator process.

`run_bench(config)`, step by step:

1. measure the machine (memory bandwidth, matmul FLOP/s) before anything else runs;
2. start one local cluster per configuration (`clusters.start_clusters`), or use the running
   one at `config.address`; with `openai_url`, an OpenAI-compatible server (another engine, or
   pdserve's HTTP front) joins as configuration 'openai', loaded with the same workloads and
   arrivals (`openai_load`); send every target a warm-up request;
3. calibrate the unloaded prefill and decode step times on `calibrate_on` and fix the SLOs:
   milliseconds when given, else `ttft_scale * prefill_ms` and `tpot_scale * decode_ms`;
4. search each configuration's max goodput on `repeats` trace seeds (`seed`, `seed + 1`, ...:
   lengths and arrivals), repeat by repeat, configurations interleaved within a repeat
   (`sweep.run_repeats`; the rules: `sweep`'s docstring): the grid is the given rates, or
   `rel_rates` x the unloaded prefill-bound rate 1000 / prefill_ms, extended by `grid_step`
   (`grid_below` / `grid_above` steps); with `warm_start` a repeat starts at the previous
   repeat's answer. Each run sends max(`min_requests`, rate x `duration_s`) requests (40 by
   default: one request moves attainment by 2.5 %) from one load-generator process
   (`loadgen.run_load_process`) with a fresh token seed, so no run hits the prefix cache of
   another; prompts are random ids, or with `prompts="text"` windows of a built-in English
   corpus (`text_prompts`); outputs always have their exact length (`ignore_eos`). Each run
   prints a progress line: its attainment, its seconds against the expected (requests / rate
   plus the overhead measured so far), the time elapsed and about how long the rest takes
   (`sweep.RateSearch.points_left`);
5. write `results.json` (every request of every run, machine, model, SLOs, seeds) after each
   run, then the Markdown report and PNG plots (`report.write_report`: the median and range
   over repeats, `repeats`).

It returns the report's `Summary` (max goodput per configuration and the headline).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import statistics
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
from tooling.goodput.repeats import Bounded
from tooling.goodput.sweep import Grid, RateSearch, run_repeats
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
    min_requests: int = Field(
        default=40,
        ge=1,
        description="Fewest requests in one run (40: one request moves attainment by 2.5 %, "
        "so a point can resolve a 90 % target).",
    )
    repeats: int = Field(
        default=3,
        ge=1,
        description="Trace seeds seed .. seed + repeats - 1 (lengths and arrivals; a trace "
        "file keeps its arrivals): each configuration's max goodput is searched on each, "
        "repeat by repeat; the report gives the median and the range.",
    )
    grid_step: float = Field(
        default=2.0, gt=1, description="Factor between grid rates beyond the listed rates."
    )
    grid_below: int = Field(
        default=2, ge=0, description="Grid steps the search may take under the lowest rate."
    )
    grid_above: int = Field(
        default=2, ge=0, description="Grid steps the search may take over the highest rate."
    )
    give_up: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="Climbing through the listed rates stops at a rate whose attainment is "
        "below this (beyond them the search climbs only while rates pass).",
    )
    warm_start: bool = Field(
        default=False,
        description="Repeat k + 1 of a configuration starts at repeat k's max goodput "
        "(instead of the lowest listed rate): a walk from one start rate re-brackets in "
        "about three runs.",
    )
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


def requests_at(cfg: BenchConfig, rate: float) -> int:
    """How many requests a synthetic run at `rate` sends: max(min_requests, rate x duration)."""
    return max(cfg.min_requests, math.ceil(rate * cfg.duration_s))


def specs_for(
    cfg: BenchConfig, context: int, rate: float, seed: int | None = None
) -> list[RequestSpec]:
    """The requests of one run at `rate` on trace seed `seed` (default `cfg.seed`): the trace
    file scaled to it, or the synthetic workload with `requests_at(cfg, rate)` requests."""
    if cfg.trace is not None:
        return scale_to_rate(read_trace(cfg.trace), rate)
    return make_requests(
        cfg.workload, requests_at(cfg, rate), rate, context=context,
        seed=cfg.seed if seed is None else seed, arrival=cfg.arrival, cv=cfg.cv,
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
        self.context = 0  # the length budget, fixed by `prepare`
        self.searches: dict[str, RateSearch] = {}  # the current repeat's, per configuration
        self.repeat = 0  # the current repeat (0-based)
        self.counts: dict[str, int] = {}  # runs so far per configuration (token seeds)
        self.overheads: list[float] = []  # per run: wall seconds beyond requests / rate
        self._trace_len: int | None = None

    def prepare(self, context: int) -> None:
        """Warm every cluster up, calibrate, fix the SLOs and the sweep rates."""
        cfg = self.cfg
        self.context = context
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
        grid = self.grid()
        self.meta["search"] = {
            "grid": list(grid.points), "seeds": self.seeds(), "warm_start": cfg.warm_start,
            "give_up": cfg.give_up, "bisect_steps": cfg.bisect_steps,
        }  # fmt: skip
        say(f"SLOs: {self.slo.text()}; rates {rates}, grid "
            f"{', '.join(f'{x:.3g}' for x in grid.points)} req/s")  # fmt: skip
        first = grid.rates[0] if len(grid.rates) == 1 else None
        say(f"{len(names)} configurations x {cfg.repeats} repeats (seeds {self.seeds()}), at "
            f"least {cfg.min_requests} requests per run; expected about "
            f"{self.expected_s(first):.0f} s of runs")  # fmt: skip

    def seeds(self) -> list[int]:
        """The trace seed of each repeat."""
        return [self.cfg.seed + k for k in range(self.cfg.repeats)]

    def grid(self) -> Grid:
        cfg = self.cfg
        return Grid(tuple(self.meta["sweep_rates"]), cfg.grid_step, cfg.grid_below, cfg.grid_above)

    def point_s(self, rate: float) -> float:
        """Expected seconds of one run at `rate`: its requests / rate (the span of their
        arrivals) plus the median overhead of the runs so far (5 s before the first)."""
        if self.cfg.trace is not None:
            if self._trace_len is None:
                self._trace_len = len(read_trace(self.cfg.trace))
            n = self._trace_len
        else:
            n = requests_at(self.cfg, rate)
        extra = statistics.median(self.overheads) if self.overheads else 5.0
        return n / rate + extra

    def expected_s(self, start: float | None = None) -> float:
        """About how many seconds the runs still to come take: each configuration's current
        search (`RateSearch.points_left` runs near its next rate) and the repeats after it
        (with `warm_start` three runs plus the bisection steps near its answer, else its
        current search's path again). Before any search: three runs per repeat at `start`
        (default: each listed rate once)."""
        cfg = self.cfg
        if not self.searches:
            rates = [start] * 3 if start is not None else list(self.meta["sweep_rates"])
            per_repeat = sum(self.point_s(r) for r in rates) + cfg.bisect_steps * self.point_s(
                rates[-1]
            )
            return len(self.clusters.names) * cfg.repeats * per_repeat
        later = cfg.repeats - 1 - self.repeat
        total = 0.0
        for search in self.searches.values():
            nxt = search.next_rate()
            ref = nxt if nxt is not None else search.next_start()
            left = search.points_left()
            total += left * self.point_s(ref)
            if cfg.warm_start:
                total += later * (3 + cfg.bisect_steps) * self.point_s(search.next_start())
            else:
                path = [*search.points, *[ref] * left]
                total += later * sum(self.point_s(r) for r in path)
        return total

    def search(self) -> dict[str, list[RateSearch]]:
        """Step 4 of the module docstring: every configuration's search on every seed."""
        cfg = self.cfg
        grid = self.grid()

        def new_search(name: str, k: int, previous: RateSearch | None) -> RateSearch:
            start = previous.next_start() if cfg.warm_start and previous is not None else None
            search = RateSearch(grid, cfg.target, cfg.bisect_steps, cfg.give_up, start=start)
            self.searches[name] = search
            self.repeat = k
            return search

        return run_repeats(
            self.clusters.names, cfg.repeats, new_search, self.run_point, self._repeat_done
        )

    def _repeat_done(self, k: int, searches: dict[str, RateSearch]) -> None:
        """Say each configuration's answer on repeat k's seed, and any non-monotone point."""
        for name, search in searches.items():
            res = search.result()
            above = "" if res.rate == 0 or res.first_fail is None else (
                f", {res.first_fail:.3g} req/s above it failed"
            )  # fmt: skip
            say(f"repeat {k + 1}/{self.cfg.repeats} (seed {self.seeds()[k]}) {name}: max goodput "
                f"{Bounded.of(res).text()} req/s{above}")  # fmt: skip
            for dip in res.dips:
                say(f"  non-monotone: {dip.text()}")

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

    def run_point(self, name: str, repeat: int, rate: float) -> float:
        """One run of configuration `name` at `rate` on repeat `repeat`'s trace seed, in its
        own load-generator process; returns its attainment (both SLOs)."""
        cfg = self.cfg
        assert self.slo is not None
        seed = self.seeds()[repeat]
        k = self.counts.get(name, 0)  # the k-th run of `name` over every repeat
        self.counts[name] = k + 1
        specs = specs_for(cfg, self.context, rate, seed)
        job = LoadJob(
            address=self.clusters.address(name),
            specs=specs,
            config=name,
            rate=rate,
            arrival="trace" if cfg.trace else cfg.arrival,
            seed=seed,
            token_seed=cfg.seed * 1000 + k,
            timeout_s=self.timeout_s(),
            label=f"{name}-{k}",
            **self.clusters.job_fields(name),
            security=self._security(name),
            corpus=self.corpus,
        )
        expected = self.point_s(rate)
        t0 = time.monotonic()
        load_before = os.getloadavg()[0]
        meter = CpuMeter()
        meter.start(self.clusters.pids(name))
        run = run_load_process(job, self.cfg.out / "jobs")
        run.meta["cpu"] = meter.stop({"loadgen": float(run.meta.get("loadgen_cpu_s", 0.0))})
        run.meta["loadavg_1min"] = [load_before, os.getloadavg()[0]]
        self.runs.append(run)
        wall = time.monotonic() - t0
        self.overheads.append(max(0.0, wall - len(specs) / rate))
        att = attainment(run.records, self.slo)
        self.searches[name].record(rate, att.both)  # now, for the estimate below (idempotent)
        bad = "" if run.valid else f"  INVALID (send lag p99 {run.send_lag_p99_ms:.1f} ms)"
        say(
            f"r{repeat + 1} {name:>17} @ {rate:7.3f} req/s: {len(run.records)} req, attainment "
            f"{att.both:6.1%} (TTFT {att.ttft:6.1%}, TPOT {att.tpot:6.1%}, errors {att.errors}), "
            f"SLO goodput {slo_goodput_rps(run, self.slo):.3f} req/s, {wall:.0f} s (expected "
            f"{expected:.0f} s); about {self.expected_s():.0f} s to go{bad}"
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
        bench.search()
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    meta["wall_s"] = round(time.time() - started, 1)
    bench.save()
    return write_report(cfg.out)
