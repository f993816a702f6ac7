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

With `anchor` (`--anchor-unloaded`), step 2 first scales the profile's prefill and decode
step costs (`anchored_cost`) so that one request alone reproduces what the bench itself
measured unloaded for that configuration (`meta.unloaded`: TTFT and TPOT of one request at a
time, taken before the loaded runs, with every configuration's cluster up). Those probes
belong to the same bench, but not to the loaded runs being judged: an anchored replay tests
the load model (queueing, batching, chunking, CPU sharing) with unloaded costs as they were
in that environment, which a profile taken on a quiet machine can miss (served steps slower
than the bare engine's while other clusters share the cores).

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
from tooling.planner.costs import CostModel, Linear
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
    unloaded: dict[str, Any] | None = None  # the bench's own unloaded probe of this config
    policy: str = "least_load"  # the router's policy in the bench's cluster


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
    scale: tuple[float, float] | None = None  # (prefill, decode) step scale when anchored


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
    anchored: bool = False  # step costs scaled to each bench's unloaded probes

    @property
    def share_inside(self) -> float:
        return sum(p.inside for p in self.points) / len(self.points) if self.points else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "margin": self.margin,
            "anchored": self.anchored,
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
        prefix_caching=bool(e.get("enable_prefix_caching", True)),
        max_inflight=int(r["max_inflight"]),
        max_queued=int(r["max_queued"]),
        threads=float(threads),
        hybrid_threshold=int(r.get("hybrid", {}).get("local_prefill_max_tokens", 0)) or None,
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
    slo = SLO.from_json(meta["slo"])
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
            f"TTFT {slo.ttft_ms:g} ms, TPOT {slo.tpot_ms:g} ms{_long_prompt_text(slo)}; "
            f"{run.config}"
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
                unloaded=(meta.get("unloaded") or {}).get(run.config),
                policy=str(cluster["router"].get("policy", "least_load")),
            )
        )
    return out


def _long_prompt_text(slo: SLO) -> str:
    lp = slo.long_prompt
    if lp is None:
        return ""
    return f" (prompts >= {lp.min_prompt_tokens}: {lp.ttft_ms:g} / {lp.tpot_ms:g} ms)"


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
    ttft_att, tpot_att, both = sim_attainment(
        outs, slo.ttft_ms / 1e3, slo.tpot_ms / 1e3, slo.long_prompt
    )
    ok = [o for o in outs if o.ok]
    ttft = [o.ttft_s * 1e3 for o in ok if o.ttft_s is not None]
    tpot = [o.tpot_s * 1e3 for o in ok if o.tpot_s is not None]
    return _stats(both, ttft_att, tpot_att, ttft, tpot)


def anchored_cost(
    cost: CostModel, spec: ClusterSpec, unloaded: dict[str, Any]
) -> tuple[CostModel, tuple[float, float]]:
    """`cost` with its prefill and decode step costs scaled so that the bench's unloaded probe
    (`unloaded`: prompt_len, output_len, prefill_ms = its TTFT, decode_ms = its TPOT) is what
    the simulator predicts for that one request alone on `spec`; and the two scales. The
    overheads (TTFT, per token) are kept: only the model steps are scaled."""
    probe = [SimRequest(0.0, int(unloaded["prompt_len"]), max(2, int(unloaded["output_len"])))]
    (alone,) = simulate(probe, spec, cost)
    if not alone.ok or alone.ttft_s is None or alone.tpot_s is None:
        return cost, (1.0, 1.0)
    n = probe[0].input_len
    ttft_over = cost.ttft_overhead(n)
    prefill = (unloaded["prefill_ms"] / 1e3 - ttft_over) / max(alone.ttft_s - ttft_over, 1e-9)
    tok_over = cost.token_overhead_s
    decode = (unloaded["decode_ms"] / 1e3 - tok_over) / max(alone.tpot_s - tok_over, 1e-9)
    prefill, decode = max(prefill, 0.05), max(decode, 0.05)

    def times(line: Linear, k: float) -> Linear:
        return Linear(tuple(c * k for c in line.coef), line.rel_err_p50, line.rel_err_max)

    scaled = replace(cost, prefill=times(cost.prefill, prefill), decode=times(cost.decode, decode))
    return scaled, (prefill, decode)


def check_run(
    case: RunCase, profile: Profile, machine_cores: float | None, anchor: bool = False
) -> RunCheck:
    """Replay one run (module docstring, steps 1-3); `machine_cores` None: every worker has
    its own cores (no sharing modelled). `anchor`: scale the step costs to the bench's own
    unloaded probe of the configuration first (`anchored_cost`; runs without one are not
    scaled)."""
    cores = None
    if machine_cores is not None:
        cores = max(0.25, machine_cores - (case.external_cores or 0.0))
    spec = replace(case.spec, cores=cores)
    cost, scale = profile.cost(case.threads), None
    if anchor and case.unloaded:
        cost, scale = anchored_cost(cost, spec, case.unloaded)
    outs = simulate(case.requests, spec, cost, policy=case.policy)
    return RunCheck(
        source=case.source,
        config=case.config,
        rate=case.rate,
        requests=len(case.requests),
        cores=cores,
        measured=measured_stats(case.records, case.slo),
        predicted=predicted_stats(outs, case.slo),
        scale=scale,
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
    anchor: bool = False,
) -> Validation:
    """Replay every run of `run_dirs` and judge every point (module docstring)."""
    cases = [case for d in run_dirs for case in load_cases(d)]
    return judge(cases, profile, machine_cores, margin, anchor)


def judge(
    cases: Sequence[RunCase],
    profile: Profile,
    machine_cores: float | None,
    margin: float = 0.05,
    anchor: bool = False,
) -> Validation:
    """Replay `cases` (loaded runs) and judge every point they form (`validate`)."""
    checks: dict[tuple[str, float], list[RunCheck]] = {}
    for case in cases:
        checks.setdefault((case.key, round(case.rate, 6)), []).append(
            check_run(case, profile, machine_cores, anchor)
        )
    out = Validation(margin=margin, anchored=anchor)
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


def _scales(v: Validation) -> set[str]:
    """'configuration prefill x a..b, decode x c..d' per configuration of an anchored run."""
    by: dict[str, list[tuple[float, float]]] = {}
    for p in v.points:
        for r in p.runs:
            if r.scale is not None:
                by.setdefault(r.config, []).append(r.scale)
    out = set()
    for config, scales in by.items():
        pre, dec = [s[0] for s in scales], [s[1] for s in scales]
        out.add(
            f"{config} prefill x{min(pre):.2f}..{max(pre):.2f}, "
            f"decode x{min(dec):.2f}..{max(dec):.2f}"
        )
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
        *(
            [
                "Step costs anchored to each bench's own unloaded probes (`--anchor-unloaded`): "
                "scale = measured / profiled unloaded step, prefill and decode, per repeat: "
                + "; ".join(sorted(_scales(v))),
                "",
            ]
            if v.anchored
            else []
        ),
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
