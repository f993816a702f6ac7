"""`pdserve plan --validate RUN_DIR...`: replay saved `pdserve bench` runs through the simulator
and compare. Pure (reads JSON); runs in the CLI process.

For every run of every RUN_DIR (its `results.json`):

1. the exact requests the load generator sent — send times, prompt and output lengths — and
   the configuration the bench launched (mode, workers, torch threads, engine step budget,
   chunking, batch and KV limits, the router's admission limits) become a `ClusterSpec` and a
   request list (`case_from_run`);
2. the simulator runs them with the profile's costs for that thread count, on the cores the
   run had: the machine's cores minus what other processes used during it (`meta.cpu`, measured
   by the bench from /proc; runs recorded without it get the whole machine);
3. predicted and measured SLO attainment (both SLOs, the bench's definition) and TTFT / TPOT
   percentiles are compared.

Repeats of the same run (same workload, SLOs, configuration and rate, in different RUN_DIRs)
form one *point*: the measured band is [min, max] of their attainments widened by `margin`
(5 points), and the point's prediction is the median of its runs' predictions. A point outside
its band gets a diagnosis naming the modelled cost that is off (`diagnose`).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tooling.goodput.analysis import SLO, attainment
from tooling.goodput.records import RequestRecord, RunResult
from tooling.planner.profiles import Profile
from tooling.planner.sim import simulate
from tooling.planner.sim_types import ClusterSpec, SimOutcome, SimRequest
from tooling.planner.sim_types import attainment as sim_attainment


@dataclass
class RunCase:
    """One saved run, ready to replay."""

    source: str  # RUN_DIR
    key: str  # workload | SLOs | configuration: repeats share it
    config: str
    rate: float
    requests: list[SimRequest]
    records: list[RequestRecord]
    spec: ClusterSpec
    threads: int
    slo: SLO
    external_cores: float | None


@dataclass
class RunCheck:
    """One run: measured vs predicted."""

    source: str
    config: str
    rate: float
    requests: int
    cores: float | None
    measured: dict[str, float | None]
    predicted: dict[str, float | None]


@dataclass
class Point:
    """Repeats of one run, their band and the verdict."""

    key: str
    config: str
    rate: float
    runs: list[RunCheck]
    band: tuple[float, float]
    predicted: float
    inside: bool
    diagnosis: str = ""


@dataclass
class Validation:
    points: list[Point] = field(default_factory=list)
    margin: float = 0.05

    @property
    def share_inside(self) -> float:
        return sum(p.inside for p in self.points) / len(self.points) if self.points else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "margin": self.margin,
            "share_inside": self.share_inside,
            "points": [asdict(p) for p in self.points],
        }


def _pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def spec_of(cluster: dict[str, Any]) -> tuple[ClusterSpec, int]:
    """The simulated cluster of a bench configuration's effective `ClusterConfig` JSON, and the
    torch threads of one worker."""
    w, e, r = cluster["workers"], cluster["engine"], cluster["router"]
    threads = int(cluster["torch_threads"])
    colocated = cluster["mode"] == "colocated"
    spec = ClusterSpec(
        prefill=0 if colocated else int(w["prefill"]),
        decode=0 if colocated else int(w["decode"]),
        colocated=int(w["colocated"]) if colocated else 0,
        chunk_tokens=int(e["max_num_batched_tokens"]),
        max_num_seqs=int(e["max_num_seqs"]),
        num_kv_blocks=int(e["num_kv_blocks"]),
        block_size=int(e["block_size"]),
        chunked=bool(e["enable_chunked_prefill"]),
        max_inflight=int(r["max_inflight"]),
        max_queued=int(r["max_queued"]),
        threads=float(threads),
    )
    return spec, threads


def load_cases(run_dir: str | Path) -> list[RunCase]:
    """Every run of a `pdserve bench` folder (ValueError when it has no results.json or
    launched no clusters of its own)."""
    path = Path(run_dir) / "results.json"
    if not path.is_file():
        raise ValueError(f"{run_dir}: no results.json (not a `pdserve bench` folder)")
    data = json.loads(path.read_text())
    meta = data["meta"]
    cfg = meta["config"]
    slo = SLO(float(meta["slo"]["ttft_ms"]), float(meta["slo"]["tpot_ms"]))
    workload = cfg.get("trace") or cfg["workload"]
    out = []
    for run_json in data["runs"]:
        run = RunResult.from_json(run_json)
        cluster = meta["clusters"].get(run.config, {}).get("config")
        if cluster is None:
            raise ValueError(f"{run_dir}: {run.config!r} was not launched by this bench")
        spec, threads = spec_of(cluster)
        key = (
            f"{workload} (context {meta['context']}, output {cfg.get('output_len') or 'drawn'}); "
            f"TTFT {slo.ttft_ms:g} ms, TPOT {slo.tpot_ms:g} ms; {run.config}"
        )
        reqs = [SimRequest(r.sent_s, r.input_len, r.output_len) for r in run.records]
        cpu = run.meta.get("cpu") or {}
        out.append(
            RunCase(
                source=str(run_dir),
                key=key,
                config=run.config,
                rate=run.rate,
                requests=reqs,
                records=run.records,
                spec=spec,
                threads=threads,
                slo=slo,
                external_cores=cpu.get("external_cores"),
            )
        )
    return out


def measured_stats(records: Sequence[RequestRecord], slo: SLO) -> dict[str, float | None]:
    att = attainment(records, slo)
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    tpot = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    return _stats(att.both, att.ttft, att.tpot, ttft, tpot)


def _stats(
    both: float, ttft_att: float, tpot_att: float, ttft: list[float], tpot: list[float]
) -> dict[str, float | None]:
    return {
        "attainment": both,
        "ttft_attainment": ttft_att,
        "tpot_attainment": tpot_att,
        "ttft_p50_ms": _pct(ttft, 0.5),
        "ttft_p90_ms": _pct(ttft, 0.9),
        "tpot_p50_ms": _pct(tpot, 0.5),
        "tpot_p90_ms": _pct(tpot, 0.9),
    }


def predicted_stats(outs: Sequence[SimOutcome], slo: SLO) -> dict[str, float | None]:
    ttft_att, tpot_att, both = sim_attainment(outs, slo.ttft_ms / 1e3, slo.tpot_ms / 1e3)
    ok = [o for o in outs if o.ok]
    ttft = [o.ttft_s * 1e3 for o in ok if o.ttft_s is not None]
    tpot = [o.tpot_s * 1e3 for o in ok if o.tpot_s is not None]
    return _stats(both, ttft_att, tpot_att, ttft, tpot)


def check_run(case: RunCase, profile: Profile, machine_cores: float | None) -> RunCheck:
    """Replay one run (module docstring, steps 1-3); `machine_cores` None: every worker has
    its own cores (no sharing modelled)."""
    cores = None
    if machine_cores is not None:
        cores = max(0.25, machine_cores - (case.external_cores or 0.0))
    spec = replace(case.spec, cores=cores)
    outs = simulate(case.requests, spec, profile.cost(case.threads))
    return RunCheck(
        source=case.source,
        config=case.config,
        rate=case.rate,
        requests=len(case.requests),
        cores=cores,
        measured=measured_stats(case.records, case.slo),
        predicted=predicted_stats(outs, case.slo),
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None and b > 0 else None


def diagnose(point: Point, lowest: Point | None) -> str:
    """Which modelled cost is off, from the point's runs (medians over repeats)."""
    m = point.runs

    def med(side: str, key: str) -> float | None:
        xs = [r.__dict__[side][key] for r in m if r.__dict__[side][key] is not None]
        return statistics.median(xs) if xs else None

    d_ttft = (med("predicted", "ttft_attainment") or 0) - (med("measured", "ttft_attainment") or 0)
    d_tpot = (med("predicted", "tpot_attainment") or 0) - (med("measured", "tpot_attainment") or 0)
    side, metric = ("TTFT", "ttft") if abs(d_ttft) >= abs(d_tpot) else ("TPOT", "tpot")
    r50 = _ratio(med("measured", f"{metric}_p50_ms"), med("predicted", f"{metric}_p50_ms"))
    r90 = _ratio(med("measured", f"{metric}_p90_ms"), med("predicted", f"{metric}_p90_ms"))
    cost = {
        "TTFT": "the prefill step / first-token path (prefill cost, TTFT overhead, KV hand-off)",
        "TPOT": "the decode step (decode cost; on a colocated worker the mixed step with "
        "prefill chunks)",
    }[side]
    too = "optimistic" if d_ttft + d_tpot > 0 else "pessimistic"
    text = f"{side} attainment is where the prediction is {too}: {cost}"
    if r50 is not None:
        text += f"; measured/predicted {side} p50 {r50:.2f}x"
    if r90 is not None:
        text += f", p90 {r90:.2f}x"
    if lowest is not None and lowest is not point and lowest.inside:
        text += (
            f"; at {lowest.rate:g} req/s this configuration is predicted within its band, so the "
            "unloaded costs hold and contention under load (CPU sharing: cores, side work of "
            "the serving threads) is what the model gets wrong here"
        )
    return text


def validate(
    run_dirs: Sequence[str | Path],
    profile: Profile,
    machine_cores: float | None,
    margin: float = 0.05,
) -> Validation:
    """Replay every run of `run_dirs` and judge every point (module docstring)."""
    checks: dict[tuple[str, float], list[RunCheck]] = {}
    for d in run_dirs:
        for case in load_cases(d):
            checks.setdefault((case.key, round(case.rate, 6)), []).append(
                check_run(case, profile, machine_cores)
            )
    out = Validation(margin=margin)
    for (key, rate), runs in sorted(checks.items()):
        meas = [float(r.measured["attainment"] or 0.0) for r in runs]
        pred = statistics.median(float(r.predicted["attainment"] or 0.0) for r in runs)
        band = (max(0.0, min(meas) - margin), min(1.0, max(meas) + margin))
        inside = band[0] - 1e-9 <= pred <= band[1] + 1e-9
        out.points.append(Point(key, runs[0].config, rate, runs, band, pred, inside))
    by_key: dict[str, list[Point]] = {}
    for p in out.points:
        by_key.setdefault(p.key, []).append(p)
    for pts in by_key.values():
        lowest = min(pts, key=lambda p: p.rate)
        for p in pts:
            if not p.inside:
                p.diagnosis = diagnose(p, lowest)
    return out


def validation_markdown(v: Validation, profile_name: str) -> str:
    """The validation report: one row per run, grouped by point, verdict and diagnosis."""
    lines = [
        "# Simulator validation against measured `pdserve bench` runs",
        "",
        f"**{sum(p.inside for p in v.points)} of {len(v.points)} points "
        f"({v.share_inside:.0%}) predicted inside the measured band** (min..max attainment of "
        f"the repeats, widened by {v.margin * 100:g} points). Profile: `{profile_name}`.",
        "",
        "| workload, SLOs, configuration | rate | measured att. (repeats) | band | predicted | "
        "inside | TTFT p50/p90 ms meas. / pred. | TPOT p50/p90 ms meas. / pred. | cores |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def ms(d: dict[str, float | None], k: str) -> str:
        return "-" if d[k] is None else f"{d[k]:.0f}"

    for p in v.points:
        m0, p0 = p.runs[0].measured, p.runs[0].predicted
        atts = ", ".join(f"{float(r.measured['attainment'] or 0):.0%}" for r in p.runs)
        cores = ", ".join("-" if r.cores is None else f"{r.cores:.2f}" for r in p.runs)
        lines.append(
            f"| {p.key} | {p.rate:g} | {atts} | {p.band[0]:.0%}..{p.band[1]:.0%} | "
            f"{p.predicted:.0%} | {'yes' if p.inside else '**no**'} | "
            f"{ms(m0, 'ttft_p50_ms')}/{ms(m0, 'ttft_p90_ms')} / "
            f"{ms(p0, 'ttft_p50_ms')}/{ms(p0, 'ttft_p90_ms')} | "
            f"{ms(m0, 'tpot_p50_ms')}/{ms(m0, 'tpot_p90_ms')} / "
            f"{ms(p0, 'tpot_p50_ms')}/{ms(p0, 'tpot_p90_ms')} | {cores} |"
        )
    misses = [p for p in v.points if not p.inside]
    if misses:
        lines += ["", "## Where the prediction falls outside the band", ""]
        for p in misses:
            lines.append(
                f"- {p.key} at {p.rate:g} req/s (predicted {p.predicted:.0%}, band "
                f"{p.band[0]:.0%}..{p.band[1]:.0%}): {p.diagnosis}"
            )
    lines += [
        "",
        "Latency columns: the first repeat's client-side percentiles of successful requests, "
        "measured / predicted. Cores: the cores the simulator gave each repeat (the machine's "
        "minus what other processes used during that run, measured from /proc).",
    ]
    return "\n".join(lines)
