"""Goodput reports: Markdown + PNG plots from saved runs (`results.json`). Orchestrator and
`pdserve report` process.

`write_report(run_dir)` renders one run folder in place (`report.md`, `summary.json`,
`attainment.png`, `latency_cdf.png`, `ttft_breakdown.png`); `write_comparison(run_dirs, out)`
puts several saved runs side by side (series labelled `<folder>:<configuration>`, each judged
by its own SLOs). Both recompute everything from the raw request records, so a report can
always be rebuilt: each configuration's max goodput on each trace seed (`sweep.max_goodput`,
runs grouped by `RunResult.seed`), its median and range over the seeds and the paired ratios
(`repeats`), and every non-monotone point, named with both rates. Both return a `Summary`.
`summary.json` holds the same numbers for programs: per series `max_goodput_rps` (the median
of the repeats' answers) and every repeat with its runs, each run's `slo_goodput_rps`
(SLO-meeting requests per second of that one run) — two different quantities, named apart
everywhere (console, report, JSON) — and the ratios.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tooling.goodput.analysis import (
    SLO,
    attainment,
    latency_summary,
    slo_goodput_rps,
    tightest_scale,
    ttft_breakdown,
)
from tooling.goodput.clusters import SPEC_SUFFIX
from tooling.goodput.plots import plot_attainment, plot_breakdown, plot_cdfs
from tooling.goodput.records import SEND_LAG_LIMIT_MS, RunResult
from tooling.goodput.repeats import Spread, ratio_fmt, ratio_spread, spread
from tooling.goodput.sweep import MaxGoodput, max_goodput

BASELINES = ("colocated", "colocated-nochunk")
TOPS = ("disagg", "hybrid")
RESOLVING_REQUESTS = 40  # below this one request moves attainment by more than 2.5 %


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
        return {k: sorted(v, key=lambda r: (r.rate, r.seed)) for k, v in out.items()}

    def seeds(self) -> list[int]:
        """The trace seeds of the runs (one per repeat), ascending."""
        return sorted({r.seed for r in self.runs})

    def answers(self) -> dict[str, dict[int, MaxGoodput]]:
        """Per configuration, its max goodput on each seed it ran (`sweep.max_goodput`)."""
        out: dict[str, dict[int, MaxGoodput]] = {}
        for cfg, runs in self.by_config().items():
            for seed in sorted({r.seed for r in runs}):
                pts = [(r.rate, attainment(r.records, self.slo).both) for r in runs
                       if r.seed == seed]  # fmt: skip
                out.setdefault(cfg, {})[seed] = max_goodput(pts, self.target)
        return out


@dataclass
class Summary:
    """Per series label: each repeat's max goodput (req/s, seed order) and their spread; the
    paired ratios ('disagg/colocated', prefixed by the series' source when comparing); the
    non-monotone warnings; the headline; where the report is."""

    max_goodput: dict[str, list[MaxGoodput]]
    spreads: dict[str, Spread]
    ratios: dict[str, Spread]
    warnings: list[str]
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


def ratios(answers: dict[str, dict[int, MaxGoodput]]) -> dict[str, Spread]:
    """disagg's and hybrid's max goodput over each baseline's, and each `-spec`
    configuration's over its base's (speculative decoding on / off), paired by trace seed (the
    seeds both ran), as spreads over those repeats."""
    pairs = [(top, base) for top in TOPS for base in BASELINES]
    pairs += [(c, c.removesuffix(SPEC_SUFFIX)) for c in answers if c.endswith(SPEC_SUFFIX)]
    out = {}
    for top, base in pairs:
        if top not in answers or base not in answers:
            continue
        seeds = sorted(set(answers[top]) & set(answers[base]))
        if seeds:
            out[f"{top}/{base}"] = ratio_spread(
                [answers[top][s] for s in seeds], [answers[base][s] for s in seeds]
            )
    return out


def headline(src: Source, answers: dict[str, dict[int, MaxGoodput]]) -> str:
    """One line: each configuration's max goodput (median and range over repeats) and disagg's
    (and hybrid's) ratio to each baseline, paired by seed."""
    parts = [f"{src.label(c)} {_spread_text(spread(list(a.values())))}"
             for c, a in answers.items()]  # fmt: skip
    rs = [f"{src.label(name)} {r.text(ratio_fmt)}" for name, r in ratios(answers).items()]
    text = f"max goodput (>= {src.target:.0%} of requests with {src.slo.text()}): " + ", ".join(
        parts
    )
    return text + ("; " + ", ".join(rs) if rs else "")


def _spread_text(sp: Spread) -> str:
    """'0.63 req/s (0.5-0.794 over 3 repeats)': a configuration's spread in the headline."""
    return sp.text(unit=" req/s", equals=False)


def dip_warnings(src: Source, answers: dict[str, dict[int, MaxGoodput]]) -> list[str]:
    """Every non-monotone point, naming both rates with attainment and requests."""
    out = []
    for cfg, per_seed in answers.items():
        for seed, mg in per_seed.items():
            runs = [r for r in src.runs if r.config == cfg and r.seed == seed]

            def requests(rate: float, runs: list[RunResult] = runs) -> int:
                return next(len(r.records) for r in runs if r.rate == rate)

            for dip in mg.dips:
                out.append(f"{src.label(cfg)}, seed {seed}: non-monotone: {dip.text(requests)}")
    return out


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
    search = m.get("search")
    if search is None:  # a run from before repeats
        lines.append(f"- sweep rates {m.get('sweep_rates')}, then {cfg['bisect_steps']} "
                     "bisection step(s) per configuration; configurations interleaved")  # fmt: skip
    else:
        grid = ", ".join(f"{x:.3g}" for x in search["grid"])
        start = (
            "each repeat after the first starts at the previous one's answer"
            if search["warm_start"]
            else "each repeat starts at the lowest listed rate"
        )
        lines.append(
            f"- rate search: listed rates {m.get('sweep_rates')}, grid {grid} req/s; climbing "
            f"through the listed rates stops below {search['give_up']:.0%} attainment; "
            f"{search['bisect_steps']} bisection step(s); {len(search['seeds'])} repeat(s) on "
            f"trace seeds {search['seeds']}, {start}; configurations interleaved within a "
            f"repeat; at least {cfg['min_requests']} requests per run"
        )
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
        "| configuration | seed | rate | n | both | TTFT ok | TPOT ok | errors | SLO goodput "
        "| TTFT p50/p90/p99 | TPOT p50/p90/p99 | ITL p50/p99 | tightest SLO scale "
        "| send lag p99 |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for cfg, runs in src.by_config().items():
        for r in sorted(runs, key=lambda r: (r.seed, r.rate)):
            a = attainment(r.records, src.slo)
            lat = latency_summary(r.records)
            t, p, i = lat["ttft_ms"], lat["tpot_ms"], lat["itl_ms"]
            lag = _fmt(r.send_lag_p99_ms, 1) + ("" if r.valid else " INVALID")
            n = f"{a.n}" if a.n >= RESOLVING_REQUESTS else f"{a.n} (< {RESOLVING_REQUESTS})"
            rows.append(
                f"| {src.label(cfg)} | {r.seed} | {r.rate:.3g} | {n} | {a.both:.0%} | "
                f"{a.ttft:.0%} | {a.tpot:.0%} | {a.errors} | {slo_goodput_rps(r, src.slo):.3f} | "
                f"{_fmt(t['p50'])}/{_fmt(t['p90'])}/{_fmt(t['p99'])} | "
                f"{_fmt(p['p50'])}/{_fmt(p['p90'])}/{_fmt(p['p99'])} | "
                f"{_fmt(i['p50'])}/{_fmt(i['p99'])} | "
                f"{_fmt(tightest_scale(r.records, src.slo, src.target), 2)} | {lag} |"
            )
    return [*rows, ""]


def _render(sources: Sequence[Source], out: Path, title: str) -> Summary:
    """Write report.md, summary.json and the plots for `sources` into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    series, cdfs, parts, scales = {}, {}, {}, {}
    repeats_all: dict[str, list[MaxGoodput]] = {}
    spreads: dict[str, Spread] = {}
    ratios_all: dict[str, Spread] = {}
    warnings: list[str] = []
    per_series: dict[str, dict[str, Any]] = {}  # summary.json
    heads = []
    answers_of = [(src, src.answers()) for src in sources]
    for src, answers in answers_of:
        several = len(src.seeds()) > 1
        for cfg, runs in src.by_config().items():
            for seed in answers[cfg]:
                pts = [(r.rate, attainment(r.records, src.slo)) for r in runs if r.seed == seed]
                lab = f"{src.label(cfg)} seed {seed}" if several else src.label(cfg)
                series[lab] = [(x, a.both, a.ttft, a.tpot) for x, a in pts]
            label = src.label(cfg)
            repeats_all[label] = list(answers[cfg].values())
            spreads[label] = spread(repeats_all[label])
            per_series[label] = _series_json(src, cfg, answers[cfg], spreads[label])
        for name, r in ratios(answers).items():
            ratios_all[src.label(name)] = r
        heads.append(headline(src, answers))
        warnings += dip_warnings(src, answers)
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
    lines += _goodput_tables(answers_of, ratios_all, warnings)
    lines += ["", "![attainment vs rate](attainment.png)\n"]
    for src in sources:
        lines += ([f"# {src.prefix}\n"] if src.prefix else []) + _setup(src)
        lines += ["## Runs\n", *_run_table(src)]
    lines += _at_one_rate(parts, scales)
    lines += ["", _DEFINITIONS.format(lag=SEND_LAG_LIMIT_MS, n=RESOLVING_REQUESTS)]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    summary = {
        "title": title,
        "headline": " | ".join(heads),
        "series": per_series,
        "ratios": {name: r.to_json() for name, r in ratios_all.items()},
        "non_monotone": warnings,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return Summary(repeats_all, spreads, ratios_all, warnings, " | ".join(heads), path)


def _goodput_tables(
    answers_of: Sequence[tuple[Source, dict[str, dict[int, MaxGoodput]]]],
    ratios_all: dict[str, Spread],
    warnings: Sequence[str],
) -> list[str]:
    """The max goodput table (each repeat, then the median and range per series), the ratios
    table and the non-monotone points."""
    lines = [
        "## Max goodput\n",
        "| series | seed | max goodput | first failing rate above | note |",
        "|---|---|---|---|---|",
    ]
    for src, answers in answers_of:
        for cfg, per_seed in answers.items():
            for seed, m in per_seed.items():
                note = "no tested rate above failed (lower bound)" if m.lower_bound else ""
                if m.non_monotone:
                    low = ", ".join(f"{d.failed_rate:.3g}" for d in m.dips)
                    note += f" non-monotone: failed at {low} req/s below it"
                lines.append(f"| {src.label(cfg)} | {seed} | {_rate(m)} | "
                             f"{_fmt(m.first_fail, 3)} | {note.strip()} |")  # fmt: skip
            sp = spread(list(per_seed.values()))
            lines.append(f"| **{src.label(cfg)}** | median of {len(sp.values)} | "
                         f"**{_spread_text(sp)}** | | |")  # fmt: skip
    if ratios_all:
        lines += ["", "| ratio (paired by seed) | median | range | per repeat |",
                  "|---|---|---|---|"]  # fmt: skip
        for name, r in ratios_all.items():
            each = ", ".join(v.text(ratio_fmt) for v in r.values)
            lines.append(f"| {name} | **{r.median.text(ratio_fmt)}** | "
                         f"{r.range_text(ratio_fmt)} | {each} |")  # fmt: skip
    if warnings:
        lines += ["", "Non-monotone attainment (a failing rate below a passing one; the max "
                  "goodput is the higher passing rate):", ""]  # fmt: skip
        lines += [f"- {w}" for w in warnings]
    return lines


def _series_json(
    src: Source, cfg: str, answers: dict[int, MaxGoodput], sp: Spread
) -> dict[str, Any]:
    """One series of summary.json: the median of its repeats' max goodput (each a search's
    answer) and every repeat with its runs' SLO goodput (what that one run delivered), named
    apart on purpose."""
    med = sp.median
    return {
        "max_goodput_rps": med.lo,
        "max_goodput_is_lower_bound": not med.exact and med.lo > 0,
        "max_goodput": sp.to_json(),
        "slo": src.slo.to_json() | {"target": src.target},
        "repeats": [
            {
                "seed": seed,
                "max_goodput_rps": mg.rate,
                "first_failing_rate_rps": mg.first_fail,
                "max_goodput_is_lower_bound": mg.lower_bound,
                "non_monotone": [asdict(d) for d in mg.dips],
                "runs": [
                    {
                        "offered_rate_rps": r.rate,
                        "requests": len(r.records),
                        "attainment": attainment(r.records, src.slo).both,
                        "slo_goodput_rps": slo_goodput_rps(r, src.slo),
                        "valid": r.valid,
                    }
                    for r in src.runs
                    if r.config == cfg and r.seed == seed
                ],
            }
            for seed, mg in answers.items()
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
- Max goodput (of a configuration on one trace seed, req/s): the highest tested offered rate
  whose attainment (both SLOs) reaches the target (DistServe's definition), with the grid
  rates around it tested too: the lowest failing rate above it and the grid rate below it.
  When a rate below it failed (non-monotone attainment) the report names both points and keeps
  the higher. Not the same number as any run's SLO goodput, which is at most its offered rate.
- Over repeats (trace seeds; `max_goodput_rps` in summary.json): the median of the seeds'
  answers and their range; a ratio (disagg/colocated) is taken per seed, between two searches
  run side by side on the same arrivals, then its median and range. `>=` marks a lower bound
  (no tested rate above failed), `<` a value below the lowest tested rate (none passed).
- A run of fewer than {n} requests cannot resolve a 90 % target: one request moves its
  attainment by more than 2.5 %.
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
