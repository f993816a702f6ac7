"""Check `pdserve plan`'s mode choice against measured `pdserve bench` runs.

    python -m benchmarks.planner_check --profile PROFILE.json --out DIR \\
        --workload NAME=RUN_DIR[,RUN_DIR...] [--workload ...]

For each workload (a set of repeats of one `pdserve bench` over colocated, colocated-nochunk
and disagg at fixed rates):

1. measured max goodput per configuration: the median attainment over the repeats at each
   rate; the highest rate whose median reaches the target, and the interpolated rate where the
   median curve crosses it (between the last passing and the first failing rate);
2. `tooling.planner.planner` on the same requests (workload, context, output length, SLOs,
   engine settings as the bench launched them, this machine's cores) ranks the same three
   alternatives by predicted max rate (the simulator's max goodput);
3. verdict: `ok` when the recommended configuration's measured max goodput (interpolated) is
   within `tolerance` (10 %) of the best measured one, `miss` when not, `inconclusive` when no
   configuration met the target at any tested rate (nothing to compare). Alternatives
   predicted within 2 % of the recommendation are reported as tied with it.

Writes DIR/planner_check.json and DIR/planner_check.md. Runs in its own process (pure
simulation plus reading the bench folders).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from tooling.goodput.analysis import SLO, attainment
from tooling.goodput.records import RunResult
from tooling.goodput.workloads import make_requests
from tooling.planner.planner import Alternative, plan_alternatives
from tooling.planner.profiles import load_profile
from tooling.planner.validate import spec_of
from tooling.planner.workload import to_sim

NAMES = {"colocated": "colocated chunked", "colocated-nochunk": "colocated whole prompts"}
TIE = 0.02  # predicted max goodputs this close are a tie


def measured(run_dirs: list[Path], target: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """(per-configuration measured curve and max goodput, the first folder's meta)."""
    by: dict[str, dict[float, list[float]]] = {}
    meta: dict[str, Any] = {}
    for d in run_dirs:
        data = json.loads((d / "results.json").read_text())
        meta = meta or data["meta"]
        slo = SLO(data["meta"]["slo"]["ttft_ms"], data["meta"]["slo"]["tpot_ms"])
        for r in data["runs"]:
            run = RunResult.from_json(r)
            att = attainment(run.records, slo).both
            by.setdefault(run.config, {}).setdefault(run.rate, []).append(att)
    out = {}
    for config, points in by.items():
        curve = sorted((rate, statistics.median(v), len(v)) for rate, v in points.items())
        passing = [rate for rate, a, _ in curve if a >= target]
        best = max(passing, default=0.0)
        crossing = best
        after = [(rate, a) for rate, a, _ in curve if rate > best]
        before = next(((rate, a) for rate, a, _ in curve if rate == best), None)
        if after and before is not None and after[0][1] < target:
            (r0, a0), (r1, a1) = before, after[0]
            crossing = r0 + (r1 - r0) * (a0 - target) / max(a0 - a1, 1e-9)
        out[config] = {"curve": curve, "max_tested_rate": best, "max_goodput": crossing}
    return out, meta


def predicted(meta: dict[str, Any], profile_path: Path, cores: float) -> list[dict[str, Any]]:
    """The planner's ranking of the bench's configurations on the bench's workload."""
    cfg = meta["config"]
    profile = load_profile(profile_path)
    slo = meta["slo"]
    alts = []
    for name, cluster in meta["clusters"].items():
        spec, threads = spec_of(cluster["config"])
        alts.append((name, Alternative(replace(spec, cores=cores), threads)))

    def make(rate: float) -> list[Any]:
        n = max(cfg["min_requests"], round(rate * cfg["duration_s"]))
        return to_sim(
            make_requests(cfg["workload"], n, rate, context=meta["context"], seed=cfg["seed"],
                          output_len=cfg["output_len"])
        )  # fmt: skip

    policies = {
        c["config"]["router"].get("policy", "least_load") for c in meta["clusters"].values()
    }
    if len(policies) != 1:
        raise ValueError(f"the bench's clusters route with different policies: {policies}")
    rows = plan_alternatives(
        make(max(meta["sweep_rates"])), profile.cost, [a for _, a in alts],
        slo["ttft_ms"] / 1e3, slo["tpot_ms"] / 1e3, rate_search=[make], target=cfg["target"],
        rate_bounds=(0.05, 4 * max(meta["sweep_rates"])), policy=policies.pop(),
    )  # fmt: skip
    out = []
    for row in rows:
        name = next(
            n for n, a in alts
            if (a.spec.colocated, a.spec.prefill, a.spec.chunked)
            == (row.colocated, row.prefill, row.chunked)
        )  # fmt: skip
        out.append({"config": name, "predicted_max_goodput": row.max_rate})
    return out


def check(
    name: str, run_dirs: list[Path], profile: Path, cores: float, tol: float
) -> dict[str, Any]:
    target = float(
        json.loads((run_dirs[0] / "results.json").read_text())["meta"]["config"]["target"]
    )
    meas, meta = measured(run_dirs, target)
    ranking = predicted(meta, profile, cores)
    rec = ranking[0]["config"]
    best = max(meas, key=lambda c: meas[c]["max_goodput"])
    got, top = meas[rec]["max_goodput"], meas[best]["max_goodput"]
    return {
        "workload": name,
        "bench": cfg_summary(meta),
        "target": target,
        "runs": [str(d) for d in run_dirs],
        "measured": meas,
        "predicted": ranking,
        "recommended": rec,
        "best_measured": best,
        "recommended_vs_best": got / top if top > 0 else None,
        "tied_with": [
            p["config"]
            for p in ranking[1:]
            if p["predicted_max_goodput"] >= (1 - TIE) * ranking[0]["predicted_max_goodput"]
        ],
        "verdict": "inconclusive" if top <= 0 else "ok" if got >= (1 - tol) * top else "miss",
    }


def cfg_summary(meta: dict[str, Any]) -> str:
    c = meta["config"]
    out = f", output {c['output_len']}" if c.get("output_len") else ""
    return (
        f"{c['workload']} (context {meta['context']}{out}), TTFT <= {meta['slo']['ttft_ms']:g} "
        f"ms, TPOT <= {meta['slo']['tpot_ms']:g} ms, rates {meta['sweep_rates']}"
    )


def markdown(results: list[dict[str, Any]], tol: float) -> str:
    ok = sum(r["verdict"] == "ok" for r in results)
    undecided = sum(r["verdict"] == "inconclusive" for r in results)
    lines = [
        "# `pdserve plan`'s mode choice against measured `pdserve bench` runs",
        "",
        f"**{ok} of {len(results)} workloads: the recommended configuration's measured max "
        f"goodput is within {tol:.0%} of the best measured one** ({undecided} inconclusive: "
        "no configuration met the target at any tested rate).",
        "",
        "| workload | recommended (predicted max goodput) | predicted ranking | measured max "
        "goodput per configuration (interpolated; highest passing rate) | best measured | "
        "recommended / best | ok |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        pred = ", ".join(
            f"{NAMES.get(p['config'], p['config'])} {p['predicted_max_goodput']:.2f}"
            for p in r["predicted"]
        )
        meas = ", ".join(
            f"{NAMES.get(c, c)} {m['max_goodput']:.2f} ({m['max_tested_rate']:g})"
            for c, m in sorted(r["measured"].items())
        )
        ratio = "-" if r["recommended_vs_best"] is None else f"{r['recommended_vs_best']:.2f}"
        rec = NAMES.get(r["recommended"], r["recommended"])
        if r["tied_with"]:
            rec += " (tied with " + ", ".join(NAMES.get(c, c) for c in r["tied_with"]) + ")"
        best = "none" if r["verdict"] == "inconclusive" else NAMES.get(r["best_measured"])
        verdict = {"ok": "yes", "miss": "**no**", "inconclusive": "inconclusive"}[r["verdict"]]
        lines.append(
            f"| {r['workload']}: {r['bench']} | {rec} | {pred} | {meas} | {best} | {ratio} | "
            f"{verdict} |"
        )
    lines += [
        "",
        "Measured: median attainment over the repeats at each rate (req/s); max goodput = the "
        "rate where that median crosses the 90 % target, interpolated between the last passing "
        "and first failing rate (in brackets: the highest passing tested rate). Predicted: the "
        "simulator's max rate meeting the target (bisection), same requests, same engine "
        "settings, this machine's cores. Tied: predicted within "
        f"{TIE:.0%} of the recommendation (the planner cannot tell them apart; the check still "
        "judges the one it lists first).",
    ]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", required=True, type=Path)
    p.add_argument("--workload", action="append", required=True, help="NAME=DIR[,DIR...]")
    p.add_argument("--cores", type=float, default=2.0)
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()
    results = []
    for item in args.workload:
        name, _, dirs = item.partition("=")
        results.append(
            check(name, [Path(d) for d in dirs.split(",")], args.profile, args.cores,
                  args.tolerance)
        )  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "planner_check.json").write_text(json.dumps(results, indent=1) + "\n")
    text = markdown(results, args.tolerance)
    (args.out / "planner_check.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
