"""Goodput reports: Markdown + PNG plots from saved runs (`results.json`). Orchestrator and
`pdserve report` process.

`write_report(run_dir)` renders one run folder in place (`report.md`, `summary.json`,
`attainment.png`, `latency_cdf.png`, `ttft_breakdown.png`); `write_comparison(run_dirs, out)`
puts several saved runs side by side (series labelled `<folder>:<configuration>`, each judged
by its own SLOs). Both recompute everything from the raw request records, so a report can
always be rebuilt. Both return a `Summary`: max goodput per series and the one-line headline.
`summary.json` holds the same numbers for programs: per series `max_goodput_rps` (the sweep's
answer) and per run `slo_goodput_rps` (SLO-meeting requests per second of that one run) — two
different quantities, named apart everywhere (console, report, JSON).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tooling.goodput.analysis import (
    SLO,
    MaxGoodput,
    attainment,
    latency_summary,
    max_goodput,
    slo_goodput_rps,
    tightest_scale,
    ttft_breakdown,
)
from tooling.goodput.plots import plot_attainment, plot_breakdown, plot_cdfs
from tooling.goodput.records import SEND_LAG_LIMIT_MS, RunResult

BASELINES = ("colocated", "colocated-nochunk")


@dataclass
class Source:
    """One saved run folder: its metadata, runs and SLOs; `prefix` labels its series."""

    path: Path
    meta: dict[str, Any]
    runs: list[RunResult]
    prefix: str = ""

    @property
    def slo(self) -> SLO:
        return SLO.from_json(self.meta["slo"])

    @property
    def target(self) -> float:
        return float(self.meta["config"]["target"])

    def label(self, config: str) -> str:
        return f"{self.prefix}:{config}" if self.prefix else config

    def by_config(self) -> dict[str, list[RunResult]]:
        out: dict[str, list[RunResult]] = {}
        for r in self.runs:
            out.setdefault(r.config, []).append(r)
        return {k: sorted(v, key=lambda r: r.rate) for k, v in out.items()}


@dataclass
class Summary:
    """Max goodput (req/s) per series label, the headline, and where the report is."""

    max_goodput: dict[str, MaxGoodput]
    headline: str
    report: Path


def load_source(run_dir: str | Path, prefix: str = "") -> Source:
    """Read `run_dir/results.json`. ValueError if it is missing or has no SLOs yet."""
    path = Path(run_dir) / "results.json"
    if not path.is_file():
        raise ValueError(f"{run_dir}: no results.json (not a `pdserve bench` run folder)")
    data = json.loads(path.read_text())
    if "slo" not in data["meta"]:
        raise ValueError(f"{run_dir}: the run stopped before its SLOs were fixed")
    runs = [RunResult.from_json(r) for r in data["runs"]]
    return Source(Path(run_dir), data["meta"], runs, prefix)


def _rate(mg: MaxGoodput) -> str:
    if mg.rate == 0 and mg.first_fail is not None:
        return f"< {mg.first_fail:.3g} req/s (no tested rate met the target)"
    return f"{'>=' if mg.lower_bound else ''}{mg.rate:.3g} req/s"


def headline(src: Source, mgs: dict[str, MaxGoodput]) -> str:
    """One line: each configuration's max goodput and disagg's (and hybrid's) ratio to each
    baseline."""
    slo = src.slo
    parts = [f"{src.label(c)} {_rate(m)}" for c, m in mgs.items()]
    ratios = []
    for top in ("disagg", "hybrid"):
        if top not in mgs:
            continue
        d = mgs[top]
        for base in BASELINES:
            if base not in mgs:
                continue
            b = mgs[base]
            if d.lower_bound and b.lower_bound:
                ratios.append(f"{top}/{base} = n/a (no tested rate failed for either)")
            elif b.rate > 0:
                bound = ">= " if d.lower_bound else "<= " if b.lower_bound else ""
                ratios.append(f"{top}/{base} = {bound}{d.rate / b.rate:.2f}x")
            elif d.rate > 0 and b.first_fail is not None:  # base's max < its first failing rate
                ratios.append(f"{top}/{base} > {d.rate / b.first_fail:.2f}x ({base} met the "
                              f"target at no tested rate)")  # fmt: skip
            else:
                ratios.append(f"{top}/{base} = n/a ({base} met the target at no tested rate)")
    text = f"max goodput (>= {src.target:.0%} of requests with {slo.text()}): " + ", ".join(parts)
    return text + ("; " + ", ".join(ratios) if ratios else "")


def _fmt(x: float | None, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return "inf" if math.isinf(x) else f"{x:.{digits}f}"


def compare_rate(src: Source) -> float | None:
    """The rate for CDFs and breakdowns: the highest rate every configuration ran at which
    at least one met the target; else the lowest common rate; None without a common rate."""
    groups = src.by_config()
    common = set.intersection(*({r.rate for r in runs} for runs in groups.values()))
    if not common:
        return None
    ok = [
        rate
        for rate in common
        if any(attainment(r.records, src.slo).both >= src.target
               for runs in groups.values() for r in runs if r.rate == rate)
    ]  # fmt: skip
    return max(ok) if ok else min(common)


def _setup(src: Source) -> list[str]:
    m, cfg = src.meta, src.meta["config"]
    mach, model = m["machine"], m["model"]
    calib = m.get("calibration")
    lines = [
        "## Setup\n",
        f"- machine: {mach['cpu_count']} cores, {mach['platform']}, torch {mach['torch_version']};"
        f" measured memory bandwidth {mach['memory_bandwidth_gbs']:.1f} GB/s, fp32 matmul "
        f"{mach['matmul_gflops']:.1f} GFLOP/s",
        f"- model: `{model.get('path', model.get('name', '?'))}` "
        f"({model.get('num_hidden_layers', '?')} layers, hidden {model.get('hidden_size', '?')}, "
        "context "
        f"{model.get('max_position_embeddings', model.get('context_length', '?'))}); "
        f"length budget L = {m['context']} tokens",
        f"- workload: `{cfg['trace'] or cfg['workload']}`, arrivals {cfg['arrival']}"
        + (f" (cv {cfg['cv']})" if cfg["arrival"] == "gamma" else "")
        + f", seed {cfg['seed']} (token seed of the k-th run of a configuration: seed*1000 + k)",
        "- prompts: "
        + (
            f"real English text (a built-in corpus, {m['prompts']['corpus_tokens']} tokens, "
            "cut into windows of the exact prompt length)"
            if m.get("prompts", {}).get("kind") == "text"
            else "random token ids"
        )
        + "; every output has its exact length: `max_tokens` with `ignore_eos` (a real model "
        "would otherwise stop at its end-of-sequence token)",
        "- lengths (prompt / output tokens): mean {input_mean:.0f} / {output_mean:.0f}, median "
        "{input_p50:.0f} / {output_p50:.0f}, max {input_max:.0f} / {output_max:.0f}".format(
            **m["lengths"]
        ),
        f"- SLOs: {src.slo.text()}; attainment target {src.target:.0%}",
    ]
    if calib:
        lines.append(
            f"- unloaded on `{calib['config']}` ({calib['prompt_len']} prompt tokens, "
            f"{calib['output_len']} output): TTFT {calib['prefill_ms']:.1f} ms, decode step "
            f"{calib['decode_ms']:.1f} ms (medians of {len(calib['ttft_samples'])}); SLO scales "
            f"TTFT x{cfg['ttft_scale']:g}, TPOT x{cfg['tpot_scale']:g} unless given in ms"
        )
    for name, u in m.get("unloaded", {}).items():
        lines.append(
            f"- unloaded `{name}`: TTFT {u['prefill_ms']:.1f} ms, TPOT {u['decode_ms']:.1f} ms "
            f"(medians of {len(u['ttft_samples'])}; samples TTFT "
            f"{', '.join(f'{x:.0f}' for x in u['ttft_samples'])}, TPOT "
            f"{', '.join(f'{x:.1f}' for x in u['tpot_samples'])})"
        )
    lines.append(f"- sweep rates {m.get('sweep_rates')}, then {cfg['bisect_steps']} bisection "
                 "step(s) per configuration; configurations interleaved")  # fmt: skip
    for name, c in m.get("clusters", {}).items():
        if "config" in c:
            cc = c["config"]
            e = cc["engine"]
            w = ", ".join(f"{v} {k}" for k, v in cc["workers"].items() if v)
            lines.append(
                f"- `{name}`: {cc['mode']}, {w}, {cc['torch_threads']} torch thread(s) each, "
                f"chunked prefill {'on' if e['enable_chunked_prefill'] else 'off'}, step budget "
                f"{e['max_num_batched_tokens']} tokens, {e['num_kv_blocks']} KV blocks"
            )
        elif c.get("api") == "openai":
            lines.append(
                f"- `{name}`: OpenAI-compatible server at {c['address']}, model `{c['model']}` "
                "(streaming /v1/completions; no server-side timings)"
            )
        else:
            lines.append(f"- `{name}`: external cluster at {c['address']}")
    prio = sorted({str(r.meta.get("loadgen_priority", "?")) for r in src.runs})
    lines.append(f"- load generator: its own process, priority {', '.join(prio)}; send lag p99 "
                 f"limit {SEND_LAG_LIMIT_MS:g} ms")  # fmt: skip
    loads = [x for r in src.runs for x in r.meta.get("loadavg_1min", [])]
    if loads:
        lines.append(
            f"- machine load (1-min load average at the start and end of each run): "
            f"{min(loads):.1f} to {max(loads):.1f} on {mach['cpu_count']} cores (a cluster under "
            "load adds about its number of busy threads; more means other processes shared it)"
        )
    if "wall_s" in m:
        lines.append(f"- started {m['started']}, took {m['wall_s']:.0f} s")
    return [*lines, ""]


def _run_table(src: Source) -> list[str]:
    head = (
        "| configuration | rate | n | both | TTFT ok | TPOT ok | errors | SLO goodput "
        "| TTFT p50/p90/p99 | TPOT p50/p90/p99 | ITL p50/p99 | tightest SLO scale "
        "| send lag p99 |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for cfg, runs in src.by_config().items():
        for r in runs:
            a = attainment(r.records, src.slo)
            lat = latency_summary(r.records)
            t, p, i = lat["ttft_ms"], lat["tpot_ms"], lat["itl_ms"]
            lag = _fmt(r.send_lag_p99_ms, 1) + ("" if r.valid else " INVALID")
            rows.append(
                f"| {src.label(cfg)} | {r.rate:.3g} | {a.n} | {a.both:.0%} | {a.ttft:.0%} | "
                f"{a.tpot:.0%} | {a.errors} | {slo_goodput_rps(r, src.slo):.3f} | "
                f"{_fmt(t['p50'])}/{_fmt(t['p90'])}/{_fmt(t['p99'])} | "
                f"{_fmt(p['p50'])}/{_fmt(p['p90'])}/{_fmt(p['p99'])} | "
                f"{_fmt(i['p50'])}/{_fmt(i['p99'])} | "
                f"{_fmt(tightest_scale(r.records, src.slo, src.target), 2)} | {lag} |"
            )
    return [*rows, ""]


def _render(sources: Sequence[Source], out: Path, title: str) -> Summary:
    """Write report.md and the plots for `sources` into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    series, cdfs, parts, scales = {}, {}, {}, {}
    mgs_all: dict[str, MaxGoodput] = {}
    per_series: dict[str, dict[str, Any]] = {}  # summary.json
    heads = []
    for src in sources:
        mgs = {}
        for cfg, runs in src.by_config().items():
            pts = [(r.rate, attainment(r.records, src.slo)) for r in runs]
            series[src.label(cfg)] = [(x, a.both, a.ttft, a.tpot) for x, a in pts]
            mgs[cfg] = max_goodput([(x, a.both) for x, a in pts], src.target)
            mgs_all[src.label(cfg)] = mgs[cfg]
            per_series[src.label(cfg)] = _series_json(src, runs, mgs[cfg])
        heads.append(headline(src, mgs))
        rate = compare_rate(src)
        for cfg, runs in src.by_config().items():
            run = next((r for r in runs if r.rate == rate), runs[0])
            ok = [x for x in run.records if x.ok]
            lab = f"{src.label(cfg)} @ {run.rate:.3g}/s"
            cdfs[lab] = ([x.ttft_ms for x in ok if x.ttft_ms is not None],
                         [x.tpot_ms for x in ok if x.tpot_ms is not None])  # fmt: skip
            parts[lab] = ttft_breakdown(run.records)
            scales[lab] = tightest_scale(run.records, src.slo, src.target)
    first = sources[0]
    target = first.target
    plot_attainment(series, target, out / "attainment.png", title)
    plot_cdfs(cdfs, (first.slo.ttft_ms, first.slo.tpot_ms), out / "latency_cdf.png")
    plot_breakdown(parts, out / "ttft_breakdown.png", "server-side TTFT breakdown")
    lines = [f"# {title}\n", "**Headline:** " + " | ".join(heads) + "\n"]
    lines += ["## Max goodput\n", "| series | max goodput | first failing rate | note |",
              "|---|---|---|---|"]  # fmt: skip
    for lab, m in mgs_all.items():
        note = "no tested rate failed (lower bound)" if m.lower_bound else ""
        note += " non-monotone: a higher rate passed again" if m.non_monotone else ""
        lines.append(f"| {lab} | {_rate(m)} | {_fmt(m.first_fail, 3)} | {note.strip()} |")
    lines += ["", "![attainment vs rate](attainment.png)\n"]
    for src in sources:
        lines += ([f"# {src.prefix}\n"] if src.prefix else []) + _setup(src)
        lines += ["## Runs\n", *_run_table(src)]
    lines += _at_one_rate(parts, scales)
    lines += ["", _DEFINITIONS.format(lag=SEND_LAG_LIMIT_MS)]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    summary = {"title": title, "headline": " | ".join(heads), "series": per_series}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return Summary(mgs_all, " | ".join(heads), path)


def _series_json(src: Source, runs: Sequence[RunResult], mg: MaxGoodput) -> dict[str, Any]:
    """One series of summary.json: its max goodput (a sweep's answer) and each run's SLO
    goodput (what that one run delivered), named apart on purpose."""
    return {
        "max_goodput_rps": mg.rate,
        "first_failing_rate_rps": mg.first_fail,
        "max_goodput_is_lower_bound": mg.lower_bound,
        "slo": src.slo.to_json() | {"target": src.target},
        "runs": [
            {
                "offered_rate_rps": r.rate,
                "requests": len(r.records),
                "attainment": attainment(r.records, src.slo).both,
                "slo_goodput_rps": slo_goodput_rps(r, src.slo),
                "valid": r.valid,
            }
            for r in runs
        ],
    }


def _at_one_rate(parts: dict[str, dict[str, float]], scales: dict[str, float]) -> list[str]:
    """The CDF / breakdown section: tightest SLO scale and mean TTFT components per series."""
    cols: list[str] = []
    for comp in parts.values():
        cols += [c for c in comp if c not in cols]
    lines = [
        "## Latency at one rate\n",
        "![latency CDFs](latency_cdf.png)\n",
        "![TTFT breakdown](ttft_breakdown.png)\n",
        "| series | tightest SLO scale | " + " | ".join(c.removesuffix("_ms") for c in cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    for lab, comp in parts.items():
        vals = " | ".join(_fmt(comp.get(c), 1) for c in cols)
        lines.append(f"| {lab} | {_fmt(scales[lab], 2)} | {vals} |")
    return [*lines, "", "(TTFT components: mean ms over successful requests.)"]


_DEFINITIONS = """## Definitions

- TTFT: request sent -> first token received by the load generator; TPOT: (last token - first
  token) / (tokens - 1); ITL: gaps between consecutive streamed messages; all client-side.
- Attainment: requests meeting the SLO / all requests sent (errors and timeouts are misses).
- SLO goodput (of one run, req/s; `slo_goodput_rps` in summary.json): requests meeting both
  SLOs / run duration (first send to last response).
- Max goodput (of a configuration, req/s; `max_goodput_rps`): the highest tested offered rate
  whose attainment (both SLOs) reaches the target, below the lowest failing rate (DistServe's
  definition), found by a sweep refined by bisection. Not the same number as any run's SLO
  goodput, which is at most its offered rate.
- Tightest SLO scale: the smallest factor s such that the run would reach the target under
  (s x TTFT SLO, s x TPOT SLO).
- TTFT breakdown: the router's server-side timings, means over successful requests;
  `server_other` and `client_other` are what the components and the server TTFT leave out.
- A run is INVALID when the load generator's p99 send lag exceeds {lag:g} ms.
"""


def write_report(run_dir: str | Path) -> Summary:
    """Render `run_dir/results.json` into `run_dir/report.md` + PNGs."""
    src = load_source(run_dir)
    return _render([src], Path(run_dir), src.meta["config"].get("title", "goodput benchmark"))


def write_comparison(run_dirs: Sequence[str | Path], out: str | Path) -> Summary:
    """Render several run folders side by side into `out`."""
    sources = [load_source(d, Path(d).name or str(d)) for d in run_dirs]
    return _render(
        sources, Path(out), "goodput comparison: " + ", ".join(s.prefix for s in sources)
    )
