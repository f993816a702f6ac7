"""Issue 31's measured targets: hybrid beside colocated and disaggregated, and the planner's
choice, on the TPOT-tight, TTFT-tight and mixed workloads (mixed twice: under one SLO pair for
every request, and as `mixed-classes`, each request judged by its application's SLOs).

    python -m benchmarks.bench_modes [--model /work/main/models/small] [--repeats 3]
        [--workloads summarize,chat,mixed,mixed-classes] [--duration 12] [--min-requests 40]
        [--rates-chat 0.5,1,1.5,2] [--rates-mixed-classes 1.2,2,2.8] ...
        [--out runs/modes-YYYYmmdd-HHMMSS]
    python -m benchmarks.bench_modes --analyze-only --out runs/modes-...   # tables again

Runs in its own process; every measurement is a `pdserve bench` subprocess (`python -m
deploy.cli bench`: its own clusters, load generator and analysis), every prediction a `pdserve
plan` subprocess. Steps:

1. for each repeat k = 1..R and each workload (repeats outermost, so slow drift of the machine
   spreads over every workload alike): one `pdserve bench` with `--configs
   colocated,disagg,hybrid` (interleaved by the bench itself), the same total threads (2:
   colocated one worker of 2, disagg and hybrid 1P + 1D of 1 each; hybrid's
   `local_prefill_max_tokens` is the bench's 128), the same fixed rates in every repeat (no
   grid beyond them, no bisection: the validation's bands need every repeat at every rate),
   at least `--min-requests` (40) requests per rate, on its own trace (seed ``--seed`` + k -
   1: lengths and arrivals; one trace for all three repeats let one burst cap every repeat at
   the same rate), into `OUT/<workload>-r<k>/` (a folder that already holds a `results.json`
   of the same seed is kept, so an interrupted matrix resumes);
2. per workload and configuration: max goodput of each repeat by the rules every goodput
   tool shares (`tooling.goodput.sweep.max_goodput`: the highest tested rate meeting the
   attainment target; a failing rate below it is named as non-monotone, never silently taken)
   and their median and range (`tooling.goodput.repeats`); hybrid's median over the better
   of colocated's and disagg's, and the range of that ratio per repeat;
3. per workload: `pdserve plan --search-rate` on the same workload flags, SLOs, routing policy,
   trace seeds and duration (`--seeds R --search-duration D`: the median max rate over the
   repeats' seeds, each simulated rate at least D seconds of arrivals),
   `--profile` (default `docs/planner/validation/small-contended.profile.json`) and
   `--cores 2`, over the measured alternatives (`--chunk-tokens 256 --hybrid-thresholds
   128`; colocated whole prompts is always simulated too but was not measured); its
   recommendation among the measured configurations against the best measured median
   (`--tolerance`, 10 %);
4. `pdserve plan --validate` over every run folder: the share of (workload, configuration,
   rate) points whose predicted attainment lies inside the measured band (min..max over the
   repeats, widened by 5 points);
5. `OUT/summary.md` (tables in `benchmarks/RESULTS.md`'s form) and `OUT/summary.json`.

Duration: with 10 requests per rate, the first three workloads (3 configurations x 3 repeats,
12 s of arrivals, four rates) took about 45 minutes on a 2-vCPU host (sizing in
`docs/performance.md`); at 40 requests a rate r lasts max(12, 40 / r) s instead of
max(12, 10 / r), about 2.5x the runs' time at the default rates (about 2 hours);
`mixed-classes` adds about a third.

The pure parts (`max_goodputs`, `hybrid_ratio`, `hybrid_ratio_spread`, `config_of_row`,
`planner_verdict`, `markdown`) are unit-tested on fixture data (`tests/unit/test_bench_modes.py`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from router.hybrid import HybridConfig
from tooling.goodput.analysis import SLO, LongPromptSLO, attainment
from tooling.goodput.records import RunResult
from tooling.goodput.repeats import Spread, ratio_fmt, ratio_spread, spread
from tooling.goodput.sweep import MaxGoodput, max_goodput
from tooling.goodput.workloads import summarize_min_prompt

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("colocated", "disagg", "hybrid")
FIXED = ("colocated", "disagg")
HYBRID_THRESHOLD = 128  # tooling.goodput.clusters.HYBRID_LOCAL_PREFILL_TOKENS (what `hybrid` runs)
CHUNK_TOKENS = 256  # the bench's default chunk budget


@dataclass(frozen=True)
class Workload:
    """One workload of the matrix: its `pdserve bench` / `pdserve plan` flags.

    SLOs: TPOT-tight and TTFT-tight are the ones the planner validation used
    (`docs/planner/README.md`); mixed loosens the 1000 ms TTFT of the first hybrid run
    (`docs/performance.md`) to 1500 ms, because a 300-430-token summarization prompt alone
    takes about 1000 ms on the 1-thread prefill worker: at 1000 ms every remote request missed
    by construction, which favoured colocated trivially. mixed-classes sends the same requests
    but judges each by its own application's SLOs (chat turns by chat's, summarization prompts
    by summarize's), as DistServe defines goodput per application."""

    name: str  # the matrix's name for it (run folders NAME-rK)
    label: str  # what the table calls it
    ttft_slo_ms: float
    tpot_slo_ms: float
    rates: tuple[float, ...]
    output_len: int | None = None
    context: int = 512
    min_requests: int = 40
    lengths: str = ""  # the bench's --workload (default: `name`)
    long_prompt_slo: str | None = None  # the bench's --long-prompt-slo N:TTFT_MS:TPOT_MS

    @property
    def bench_workload(self) -> str:
        return self.lengths or self.name

    def slo_flags(self) -> list[str]:
        """The SLO flags `pdserve bench` and `pdserve plan` share (but for their names)."""
        return [] if self.long_prompt_slo is None else ["--long-prompt-slo", self.long_prompt_slo]

    def bench_flags(self) -> list[str]:
        out = ["--workload", self.bench_workload, "--context", str(self.context)]
        out += ["--ttft-slo-ms", f"{self.ttft_slo_ms:g}", "--tpot-slo-ms", f"{self.tpot_slo_ms:g}"]
        out += self.slo_flags()
        out += ["--rates", ",".join(f"{r:g}" for r in self.rates)]
        out += ["--min-requests", str(self.min_requests)]
        if self.output_len is not None:
            out += ["--output-len", str(self.output_len)]
        return out

    def slo_text(self) -> str:
        out = f", output {self.output_len}" if self.output_len else ""
        if self.long_prompt_slo is not None:
            lp = LongPromptSLO.parse(self.long_prompt_slo)
            out += f"; prompts >= {lp.min_prompt_tokens}: {lp.ttft_ms:g} / {lp.tpot_ms:g} ms"
        return f"TTFT {self.ttft_slo_ms:g} / TPOT {self.tpot_slo_ms:g} ms{out}"


MIXED_SUMMARIZE_FROM = summarize_min_prompt(512)
"""`mixed-classes`: prompts this long are the summarization ones, judged by summarize's SLOs;
the chat turns keep chat's."""

WORKLOADS: dict[str, Workload] = {
    "summarize": Workload(
        "summarize", "TPOT-tight (summarize)", 6000, 85, (0.5, 1.0, 1.5, 2.0), output_len=24
    ),
    "chat": Workload("chat", "TTFT-tight (chat)", 300, 240, (0.5, 1.0, 1.5, 2.0)),
    "mixed": Workload("mixed", "mixed (chat + 30 % summarize)", 1500, 100, (0.4, 0.8, 1.2, 1.6)),
    "mixed-classes": Workload(
        "mixed-classes",
        "mixed, per-class SLOs (chat + 30 % summarize)",
        300,
        240,
        (1.2, 2.0, 2.8, 3.6),
        lengths="mixed",
        long_prompt_slo=f"{MIXED_SUMMARIZE_FROM}:6000:85",
    ),
}


# ------------------------------------------------------------------------------ pure parts


def points_of(results: Mapping[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """(rate, attainment of both SLOs) per configuration of one bench's `results.json`."""
    slo = SLO.from_json(results["meta"]["slo"])
    out: dict[str, list[tuple[float, float]]] = {}
    for r in results["runs"]:
        run = RunResult.from_json(r)
        out.setdefault(run.config, []).append((run.rate, attainment(run.records, slo).both))
    return {c: sorted(p) for c, p in out.items()}


def local_share(results: Mapping[str, Any], config: str = "hybrid") -> tuple[int, int]:
    """(requests prefilled on their decode worker, requests) of `config`'s runs."""
    local = total = 0
    for r in results["runs"]:
        if r["config"] != config:
            continue
        run = RunResult.from_json(r)
        total += len(run.records)
        local += sum(rec.prefill_path == "local" for rec in run.records)
    return local, total


def max_goodputs(
    repeats: Sequence[Mapping[str, Sequence[tuple[float, float]]]], target: float
) -> dict[str, list[MaxGoodput]]:
    """Per configuration, the max goodput of each repeat (`sweep.max_goodput`; unknown, rate
    0, for a repeat where it did not run), in repeat order."""
    configs = sorted({c for rep in repeats for c in rep})
    return {c: [max_goodput(rep.get(c, ()), target) for rep in repeats] for c in configs}


def median_goodput(answers: Sequence[MaxGoodput]) -> float:
    """The median of the repeats' max goodputs (`repeats.Spread`'s lower bound: a repeat
    below the lowest rate counts 0, a lower bound its rate; 0 with none)."""
    return spread(answers).median.lo if answers else 0.0


def hybrid_ratio(medians: Mapping[str, float]) -> float | None:
    """Hybrid's median max goodput over the better of colocated's and disagg's; None when
    neither fixed mode met the target anywhere (nothing to compare with)."""
    best = max(medians.get(c, 0.0) for c in FIXED)
    return medians.get("hybrid", 0.0) / best if best > 0 else None


def hybrid_ratio_spread(answers: Mapping[str, Sequence[MaxGoodput]]) -> Spread | None:
    """Hybrid over the better fixed mode of the same repeat, per repeat (paired by trace
    seed), as a spread; None without hybrid or any fixed mode."""
    fixed = [answers[c] for c in FIXED if c in answers]
    if "hybrid" not in answers or not fixed:
        return None
    best = [max(each, key=lambda m: m.rate) for each in zip(*fixed, strict=True)]
    return ratio_spread(answers["hybrid"], best)


def config_of_row(row: Mapping[str, Any]) -> str | None:
    """The bench configuration a `pdserve plan --json` row simulates, or None when the bench
    did not measure it (colocated whole prompts, another chunk budget, split or threshold)."""
    if row["colocated"]:
        ok = row["colocated"] == 1 and row["chunked"] and row["chunk_tokens"] == CHUNK_TOKENS
        return "colocated" if ok else None
    if (row["prefill"], row["decode"], row["chunk_tokens"]) != (1, 1, CHUNK_TOKENS):
        return None
    if row["hybrid_threshold"] is None:
        return "disagg"
    return "hybrid" if row["hybrid_threshold"] == HYBRID_THRESHOLD else None


@dataclass(frozen=True)
class PlannerCheck:
    """The planner's recommendation against the measured medians of one workload."""

    top: str  # the plan's first row, described
    recommended: str | None  # its best-ranked measured configuration
    predicted: dict[str, float]  # predicted max rate per measured configuration
    best_measured: str | None  # None: no configuration met the target at any rate
    recommended_vs_best: float | None
    verdict: str  # ok | miss | inconclusive | not measured


def planner_verdict(
    rows: Sequence[Mapping[str, Any]], medians: Mapping[str, float], tolerance: float
) -> PlannerCheck:
    """Judge `pdserve plan`'s ranked `rows` on `medians` (median max goodput per measured
    configuration): ok when the best-ranked measured configuration's median is within
    `tolerance` of the best median; inconclusive when every median is 0."""
    assert rows, "pdserve plan returned no rows"
    predicted: dict[str, float] = {}
    for row in rows:
        cfg = config_of_row(row)
        if cfg is not None and cfg not in predicted:
            predicted[cfg] = float(row["max_rate"] or 0.0)
    top = describe(rows[0])
    recommended = next((c for c in map(config_of_row, rows) if c is not None), None)
    best = max(medians, key=lambda c: medians[c], default=None)
    if best is None or medians[best] <= 0:
        return PlannerCheck(top, recommended, predicted, None, None, "inconclusive")
    if recommended is None or recommended not in medians:
        return PlannerCheck(top, recommended, predicted, best, None, "not measured")
    ratio = medians[recommended] / medians[best]
    verdict = "ok" if ratio >= 1 - tolerance else "miss"
    return PlannerCheck(top, recommended, predicted, best, ratio, verdict)


def describe(row: Mapping[str, Any]) -> str:
    """A plan row in words: 'colocated (chunk 256)', 'disagg 1:1', 'hybrid 1:1 @128'."""
    chunk = f"chunk {row['chunk_tokens']}" if row["chunked"] else "whole prompts"
    if row["colocated"]:
        return f"colocated x{row['colocated']} ({chunk})"
    ratio = f"{row['prefill']}:{row['decode']}"
    if row["hybrid_threshold"] is None:
        return f"disagg {ratio} ({chunk})"
    return f"hybrid {ratio} @{row['hybrid_threshold']} ({chunk})"


@dataclass(frozen=True)
class WorkloadResult:
    """Everything the summary says about one workload."""

    workload: Workload
    target: float
    runs: list[str]
    answers: dict[str, list[MaxGoodput]]  # per configuration, per repeat
    curves: dict[str, dict[float, list[float]]]  # per configuration: rate -> attainments
    local: tuple[int, int]  # hybrid's (local, all) requests over the repeats
    planner: PlannerCheck | None

    @property
    def goodputs(self) -> dict[str, list[float]]:
        """Per configuration, each repeat's max goodput (req/s; 0 below the lowest rate)."""
        return {c: [m.rate for m in v] for c, v in self.answers.items()}

    @property
    def medians(self) -> dict[str, float]:
        return {c: median_goodput(v) for c, v in self.answers.items()}

    @property
    def ratio(self) -> float | None:
        return hybrid_ratio(self.medians)

    @property
    def ratio_spread(self) -> Spread | None:
        return hybrid_ratio_spread(self.answers)

    def dips(self) -> list[str]:
        """Every non-monotone point of the workload's repeats, both rates named."""
        return [
            f"{self.workload.name}, {c}, repeat {k}: {d.text()}"
            for c, answers in self.answers.items()
            for k, m in enumerate(answers, 1)
            for d in m.dips
        ]


def _num(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".") if x else "0"


def markdown(
    results: Sequence[WorkloadResult],
    validation: Mapping[str, Any] | None,
    header: str,
    tolerance: float,
) -> str:
    """The summary: max goodput per workload and configuration (repeats and median), hybrid's
    ratio against the issue's bars, the planner's choice, the validation share, and the
    median attainment per rate."""
    lines = [header, ""]
    lines += [
        "Max goodput, req/s: median of the repeats (each repeat's in brackets; `>=`: no tested "
        "rate above failed, `<`: none passed); a repeat's max goodput is the highest tested rate "
        "whose attainment (both SLOs) meets the target (a failing rate below it is listed under "
        "the table). Hybrid / best fixed: hybrid's median over the better of colocated's and "
        "disagg's (targets: >= 0.95 on every workload, >= 1.2 on one), and in brackets the range "
        "of hybrid over the better fixed mode of the same repeat.",
        "",
        "| workload | SLOs | colocated | disagg | hybrid | hybrid / best fixed | hybrid local |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        cells = []
        med = r.medians
        top = max(med.values(), default=0.0)
        for c in CONFIGS:
            reps = ", ".join(_answer(m) for m in r.answers.get(c, []))
            value = _num(med.get(c, 0.0))
            value = f"**{value}**" if top > 0 and med.get(c, 0.0) == top else value
            cells.append(f"{value} ({reps})")
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x"
        sp = r.ratio_spread
        if sp is not None and len(sp.values) > 1:
            ratio += f" ({sp.range_text(ratio_fmt)})"
        local, total = r.local
        share = f"{local / total:.0%} of {total}" if total else "-"
        lines.append(
            f"| {r.workload.label} | {r.workload.slo_text()} | {' | '.join(cells)} | {ratio} "
            f"| {share} |"
        )
    dips = [d for r in results for d in r.dips()]
    if dips:
        lines += ["", "Non-monotone attainment (a failing rate below a passing one):", ""]
        lines += [f"- {d}" for d in dips]
    ratios = [r.ratio for r in results]
    every = all(x is not None and x >= 0.95 for x in ratios)
    one = any(x is not None and x >= 1.2 for x in ratios)
    lines += [
        "",
        f"Hybrid >= 0.95x the better fixed mode on every workload: **{_met(every)}**; "
        f">= 1.2x on at least one: **{_met(one)}**.",
        "",
    ]
    checked = [r for r in results if r.planner is not None]
    if checked:
        lines += [
            f"Planner (`pdserve plan --search-rate`, same workload flags and SLOs): its "
            f"best-ranked measured configuration against the best measured median (ok within "
            f"{tolerance:.0%}).",
            "",
            "| workload | plan's top row | predicted max rate (colocated / disagg / hybrid) | "
            "recommended | best measured | recommended / best | verdict |",
            "|---|---|---|---|---|---:|---|",
        ]
        for r in checked:
            p = r.planner
            assert p is not None
            pred = " / ".join(_num(p.predicted.get(c, 0.0)) for c in CONFIGS)
            ratio = "-" if p.recommended_vs_best is None else f"{p.recommended_vs_best:.2f}"
            verdict = {"miss": "**miss**"}.get(p.verdict, p.verdict)
            lines.append(
                f"| {r.workload.label} | {p.top} | {pred} | {p.recommended or '-'} | "
                f"{p.best_measured or 'none'} | {ratio} | {verdict} |"
            )
        ok = sum(r.planner is not None and r.planner.verdict == "ok" for r in checked)
        lines += [
            "",
            f"Planner within {tolerance:.0%} of the best: **{ok} of {len(checked)}**.",
            "",
        ]
    if validation is not None:
        pts = validation["points"]
        inside = sum(p["inside"] for p in pts)
        lines += [
            f"`pdserve plan --validate` over the {sum(len(r.runs) for r in results)} run "
            f"folders: **{inside} of {len(pts)} points ({validation['share_inside']:.0%}) inside "
            f"the measured band** (min..max of the repeats +- {validation['margin']:.0%}; "
            "target 80 %).",
            "",
            "| configuration | " + " | ".join(r.workload.name for r in results) + " |",
            "|---|" + "---:|" * len(results),
        ]
        for c in CONFIGS:
            cells = []
            for r in results:
                mine = [p for p in pts if p["config"] == c and _of_workload(p, r)]
                cells.append(f"{sum(p['inside'] for p in mine)}/{len(mine)}")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["Median attainment (both SLOs) per rate over the repeats:", ""]
    for r in results:
        rates = sorted({x for c in r.curves.values() for x in c})
        lines += [
            f"{r.workload.label}, {r.workload.slo_text()}:",
            "",
            "| configuration | " + " | ".join(f"{x:g}" for x in rates) + " |",
            "|---|" + "---:|" * len(rates),
        ]
        for c in CONFIGS:
            curve = r.curves.get(c, {})
            cells = [
                f"{statistics.median(curve[x]):.0%}" if x in curve else "—" for x in rates
            ]  # fmt: skip
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _answer(m: MaxGoodput) -> str:
    """One repeat's max goodput in the table: '1', '>= 2', '< 0.5', or '0' (did not run)."""
    if m.rate > 0:
        return f">= {_num(m.rate)}" if m.lower_bound else _num(m.rate)
    return f"< {_num(m.first_fail)}" if m.first_fail is not None else "0"


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def _of_workload(point: Mapping[str, Any], r: WorkloadResult) -> bool:
    """Whether a validation point came from `r`'s run folders (each run names its `source`)."""
    return any(run["source"] in r.runs for run in point["runs"])


# ------------------------------------------------------------------------------- the runs


def python() -> list[str]:
    return [sys.executable, "-m", "deploy.cli"]


def repeat_seed(base: int, k: int) -> int:
    """The trace seed of repeat `k` (1-based): each repeat draws its own trace (lengths and
    arrivals), so a burst in one draw caps one repeat's max goodput, not all three."""
    return base + k - 1


def bench(w: Workload, out: Path, seed: int, args: argparse.Namespace) -> float:
    """One `pdserve bench` of the three configurations on trace `seed` into `out`; its wall
    seconds (0 when `out` already held a finished run)."""
    if (out / "results.json").is_file():
        kept = json.loads((out / "results.json").read_text())["meta"]["config"].get("seed", 0)
        if kept != seed:
            raise SystemExit(f"bench_modes: {out} holds a run of trace seed {kept}, not {seed}")
        print(f"bench_modes: keeping {out} (has results.json)", file=sys.stderr)
        return 0.0
    cmd = [*python(), "bench", "--model", str(args.model), "--configs", ",".join(CONFIGS)]
    cmd += w.bench_flags()
    cmd += ["--duration", f"{args.duration:g}", "--bisect-steps", "0", "--threads", "2"]
    cmd += ["--repeats", "1", "--grid-below", "0", "--grid-above", "0"]  # the fixed matrix
    cmd += ["--seed", str(seed), "--out", str(out), "--title", f"bench_modes {out.name}"]
    print("bench_modes: " + " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, check=True)
    return time.monotonic() - t0


def plan(w: Workload, results: Mapping[str, Any], out: Path, args: argparse.Namespace) -> Any:
    """`pdserve plan --search-rate` on `w` as the bench ran it; the JSON it wrote."""
    meta = results["meta"]
    policies = {c["config"]["router"].get("policy") for c in meta["clusters"].values()}
    policy = policies.pop() if len(policies) == 1 else None
    cmd = [*python(), "plan", "--workload", w.bench_workload, "--rate", f"{max(w.rates):g}"]
    cmd += ["--num-requests", str(args.plan_requests), "--context", str(w.context)]
    cmd += ["--slo-ttft-ms", f"{w.ttft_slo_ms:g}", "--slo-tpot-ms", f"{w.tpot_slo_ms:g}"]
    cmd += w.slo_flags()
    cmd += ["--target", f"{results['meta']['config']['target']:g}", "--seed", str(args.seed)]
    cmd += ["--seeds", str(args.repeats)]  # the repeats' trace seeds, as they were run
    cmd += ["--search-duration", f"{args.duration:g}"]  # and their seconds of arrivals per rate
    cmd += ["--profile", str(args.profile), "--cores", f"{args.cores:g}", "--workers", "2"]
    cmd += ["--threads", "1", "--chunk-tokens", str(CHUNK_TOKENS), "--search-rate"]
    cmd += ["--hybrid-thresholds", str(HYBRID_THRESHOLD), "--json", str(out)]
    if w.output_len is not None:
        cmd += ["--output-len", str(w.output_len)]
    if policy:
        cmd += ["--policy", str(policy)]
    print("bench_modes: " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def validate(dirs: Sequence[Path], out: Path, args: argparse.Namespace) -> Any:
    """`pdserve plan --validate` over `dirs`; its JSON."""
    cmd = [*python(), "plan", "--validate", *map(str, dirs), "--profile", str(args.profile)]
    cmd += ["--cores", f"{args.cores:g}", "--json", str(out / "validation.json")]
    cmd += ["--report", str(out / "validation.md")]
    print("bench_modes: " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "validation.json").read_text())


def analyze(w: Workload, dirs: Sequence[Path], out: Path, args: argparse.Namespace) -> Any:
    """The `WorkloadResult` of `w`'s finished repeats in `dirs`."""
    data = [json.loads((d / "results.json").read_text()) for d in dirs]
    target = float(data[0]["meta"]["config"]["target"])
    repeats = [points_of(x) for x in data]
    curves: dict[str, dict[float, list[float]]] = {}
    for rep in repeats:
        for c, pts in rep.items():
            for rate, att in pts:
                curves.setdefault(c, {}).setdefault(rate, []).append(att)
    shares = [local_share(x) for x in data]
    local = (sum(a for a, _ in shares), sum(b for _, b in shares))
    result = WorkloadResult(
        w, target, [str(d) for d in dirs], max_goodputs(repeats, target), curves, local, None
    )
    if args.no_plan:
        return result
    rows = plan(w, data[0], out / f"plan-{w.name}.json", args)["rows"]
    return replace(result, planner=planner_verdict(rows, result.medians, args.tolerance))


def finished(out: Path, name: str, repeats: int) -> list[Path]:
    """The run folders of workload `name` in `out` that hold a `results.json`."""
    dirs = [out / f"{name}-r{k}" for k in range(1, repeats + 1)]
    return [d for d in dirs if (d / "results.json").is_file()]


def rates(value: str) -> tuple[float, ...]:
    out = tuple(float(x) for x in value.split(",") if x.strip())
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive rates, got {value!r}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("/work/main/models/small"))
    p.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma list of " + ", ".join(WORKLOADS)
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--duration", type=float, default=12.0, help="seconds of arrivals per rate")
    for name, w in WORKLOADS.items():
        p.add_argument(f"--rates-{name}", type=rates, default=w.rates, metavar="R[,R...]")
        p.add_argument(f"--slo-{name}", default=f"{w.ttft_slo_ms:g}:{w.tpot_slo_ms:g}",
                       metavar="TTFT_MS:TPOT_MS")  # fmt: skip
    p.add_argument("--min-requests", type=int, default=40,
                   help="fewest requests per rate (40: one moves it by 2.5 %%)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="repeat k runs trace seed SEED+k-1")
    p.add_argument(
        "--profile",
        type=Path,
        default=ROOT / "docs/planner/validation/small-contended.profile.json",
    )
    p.add_argument("--cores", type=float, default=2.0)
    p.add_argument("--plan-requests", type=int, default=100, help="requests per planner simulation")
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--no-plan", action="store_true", help="skip pdserve plan and --validate")
    p.add_argument("--analyze-only", action="store_true", help="tables from the runs in --out")
    p.add_argument("--out", default=f"runs/modes-{time.strftime('%Y%m%d-%H%M%S')}")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.workloads.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or args.repeats < 1:
        p.error(
            f"--workloads from {sorted(WORKLOADS)} and --repeats >= 1 "
            f"(got {unknown}, {args.repeats})"
        )
    chosen = {}
    for n in names:
        dest = n.replace("-", "_")  # argparse's attribute for --rates-NAME / --slo-NAME
        ttft, _, tpot = getattr(args, f"slo_{dest}").partition(":")
        chosen[n] = replace(
            WORKLOADS[n], rates=getattr(args, f"rates_{dest}"), ttft_slo_ms=float(ttft),
            tpot_slo_ms=float(tpot), min_requests=args.min_requests,
        )  # fmt: skip
    walls: list[float] = []
    if not args.analyze_only:
        for k in range(1, args.repeats + 1):
            for n, w in chosen.items():
                walls.append(bench(w, out / f"{n}-r{k}", repeat_seed(args.seed, k), args))
    dirs = {n: finished(out, n, args.repeats) for n in chosen}
    results = [analyze(chosen[n], ds, out, args) for n, ds in dirs.items() if ds]
    every = [d for ds in dirs.values() for d in ds]
    validation = None if args.no_plan or not every else validate(every, out, args)
    ran = [x for x in walls if x > 0]
    header = (
        f"## Hybrid beside the fixed modes, and the planner's choice (issue 31, "
        f"{time.strftime('%Y-%m-%d %H:%M')})\n\n`python -m benchmarks.bench_modes "
        f"{' '.join(sys.argv[1:] if argv is None else argv)}`: {args.model.name}, "
        f"{args.repeats} repeat(s) (repeat k on trace seed {args.seed}+k-1), "
        f"{args.duration:g} s of arrivals and at least {args.min_requests} requests per rate, "
        "context 512, "
        "2 threads in every configuration (colocated 1 x 2; disagg and hybrid 1P + 1D x 1; "
        f"hybrid `local_prefill_max_tokens` {HYBRID_THRESHOLD}, `spill_to_prefill` "
        f"{str(HybridConfig().spill_to_prefill).lower()}), configurations interleaved "
        f"within each bench, no bisection. Rates (req/s): "
        + "; ".join(f"{w.name} {', '.join(f'{x:g}' for x in w.rates)}" for w in chosen.values())
        + (f". {len(ran)} benches, {sum(ran):.0f} s." if ran else ".")
    )
    text = markdown(results, validation, header, args.tolerance)
    (out / "summary.md").write_text(text + "\n")
    summary = {
        "walls_s": walls,
        "workloads": [
            asdict(r) | {"medians": r.medians, "ratio": r.ratio, "non_monotone": r.dips(),
                         "ratio_spread": r.ratio_spread and r.ratio_spread.to_json()}
            for r in results
        ],
        "validation_share_inside": None if validation is None else validation["share_inside"],
    }  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(text)
    print(f"bench_modes: wrote {out / 'summary.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
