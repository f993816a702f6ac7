"""The soak's outputs: `soak.json` (summary), `requests.jsonl` (one line per request),
`report.md` and `timeline.png` (faults against outcomes over time). Runs in the soak process.

`soak.json` keys: `seed`, `requests`, `completed_exact`, `near_tie`, `ended_with_status`
(status name -> count; CANCELLED counts only client cancels), `wrong`, `hung`, `stalled`
(waited on the cluster longer than the stall budget: `check.judge`), `unclear`,
`unexplained` (a failure nothing explains: `blast`), `refused_oversized`, `explained_by`
(cause -> count, e.g. ``own deadline``, ``fault 3``, ``shed in burst 0``),
`leaked_blocks` (sum over live workers), `leaks_by_worker`, `router_in_flight`,
`stale_index_entries`, `not_rejoined`, `not_serving_after_rejoin`, `faults` (time, kind,
target, ...), `failures` (one line per failed check; empty = passed), `passed`, `config`,
`duration_s`, `examples` (the first few details of each failing category).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tooling.soak.check import Verdict
from tooling.soak.client import Outcome
from tooling.soak.faults import FaultRecord
from tooling.soak.workload import PlannedRequest

FAILING = ("wrong", "hung", "stalled", "unclear", "unexplained")
COLORS = {
    "exact": "tab:green",
    "near_tie": "tab:olive",
    "refused": "tab:cyan",
    "status": "tab:blue",
    "explained": "tab:blue",
    "unexplained": "tab:pink",
    "wrong": "tab:red",
    "hung": "black",
    "stalled": "tab:brown",
    "unclear": "tab:purple",
}
FAULT_COLORS = {
    "kill-prefill": "red",
    "kill-decode": "darkred",
    "stop": "orange",
    "long-stop": "darkorange",
    "redis": "purple",
    "kv-stall": "brown",
}


def summarize(
    config: dict[str, Any],
    seed: int,
    verdicts: Sequence[Verdict],
    outcomes: Sequence[Outcome],
    records: Sequence[FaultRecord],
    cluster: dict[str, Any],
    duration_s: float,
) -> dict[str, Any]:
    """The `soak.json` dictionary (module docstring); `cluster` holds the end-of-run checks:
    leaks_by_worker, router_in_flight, stale_index_entries, not_rejoined,
    not_serving_after_rejoin."""
    cats = Counter(v.category for v in verdicts)
    by_index = {o.index: o for o in outcomes}
    ended = ("status", "explained", "unexplained")
    statuses = Counter(by_index[v.index].code for v in verdicts if v.category in ended)
    causes = Counter(
        v.detail.split(": ", 1)[1].split(" (")[0] for v in verdicts if v.category == "explained"
    )
    leaks = cluster["leaks_by_worker"]
    leaked = sum(n for n in leaks.values() if n > 0)
    failures = [f"{cats[c]} {c} request(s)" for c in FAILING if cats[c]]
    if leaks:
        failures.append(f"blocks not back at their start: {leaks}")
    if any(cluster["router_in_flight"].values()):
        failures.append(f"router in flight after quiesce: {cluster['router_in_flight']}")
    failures += [f"Redis: {line}" for line in cluster["stale_index_entries"]]
    if cluster["not_rejoined"]:
        failures.append(f"killed workers that never served again: {cluster['not_rejoined']}")
    if cluster["not_serving_after_rejoin"]:
        failures.append(
            f"restarted workers that served nothing: {cluster['not_serving_after_rejoin']}"
        )
    failures += [
        f"fault {r.index} ({r.kind}) failed: {r.detail}" for r in records if r.target == "?"
    ]
    examples = {
        c: [f"request {v.index}: {v.detail}" for v in verdicts if v.category == c][:10]
        for c in FAILING
        if cats[c]
    }
    return {
        "seed": seed,
        "requests": len(verdicts),
        "completed_exact": cats["exact"],
        "near_tie": cats["near_tie"],
        "ended_with_status": dict(sorted(statuses.items())),
        "wrong": cats["wrong"],
        "hung": cats["hung"],
        "stalled": cats["stalled"],
        "unclear": cats["unclear"],
        "unexplained": cats["unexplained"],
        "refused_oversized": cats["refused"],
        "explained_by": dict(sorted(causes.items())),
        "leaked_blocks": leaked,
        **cluster,
        "faults": [r.to_json() for r in sorted(records, key=lambda r: r.time_s)],
        "failures": failures,
        "passed": not failures,
        "duration_s": round(duration_s, 1),
        "examples": examples,
        "config": config,
    }


def write_outputs(
    out: Path,
    summary: dict[str, Any],
    plan: Sequence[PlannedRequest],
    outcomes: Sequence[Outcome],
    verdicts: Sequence[Verdict],
) -> Path:
    """Write soak.json, requests.jsonl, timeline.png and report.md into `out`; the report's
    path."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(summary, indent=2) + "\n")
    by_index = {o.index: o for o in outcomes}
    with open(out / "requests.jsonl", "w") as f:
        for r, v in zip(plan, verdicts, strict=True):
            o = by_index[r.index]
            line = {"kind": r.kind, "verdict": v.category, "detail": v.detail, **asdict(o)}
            f.write(json.dumps(line) + "\n")
    plot_timeline(out / "timeline.png", plan, outcomes, verdicts, summary["faults"])
    report = out / "report.md"
    report.write_text(markdown(summary))
    return report


def plot_timeline(
    path: Path,
    plan: Sequence[PlannedRequest],
    outcomes: Sequence[Outcome],
    verdicts: Sequence[Verdict],
    faults: Sequence[dict[str, Any]],
) -> None:
    """Top: every request's latency at its send time, coloured by verdict; bottom: outcomes
    per time bin (about 60 bins). Faults are drawn across both (lines; spans for stops)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_index = {o.index: o for o in outcomes}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    for cat, color in COLORS.items():
        pts = [by_index[v.index] for v in verdicts if v.category == cat]
        if pts:
            top.scatter(
                [o.sent_at for o in pts],
                [max(o.latency_s, 1e-3) for o in pts],
                s=8,
                c=color,
                label=f"{cat} ({len(pts)})",
            )
    top.set_yscale("log")
    top.set_ylabel("request latency (s)")
    top.legend(loc="upper right", fontsize=8)
    end = max((o.ended_at for o in outcomes), default=1.0)
    width = max(1.0, round(end / 60))
    bins = int(end // width) + 1
    stacks = {c: [0] * bins for c in COLORS}
    for v in verdicts:
        stacks[v.category][int(by_index[v.index].sent_at // width)] += 1
    xs = [i * width for i in range(bins)]
    bottom_acc = [0] * bins
    for cat, color in COLORS.items():
        if any(stacks[cat]):
            bottom.bar(xs, stacks[cat], width=width, bottom=bottom_acc, color=color,
                       align="edge", label=cat)  # fmt: skip
            bottom_acc = [a + b for a, b in zip(bottom_acc, stacks[cat], strict=True)]
    bottom.set_ylabel(f"requests sent per {width:.0f} s")
    bottom.set_xlabel("seconds since the load started")
    for ax in (top, bottom):
        for f in faults:
            color = FAULT_COLORS.get(f["kind"], "gray")
            if f["duration_s"] > 0:
                ax.axvspan(f["time_s"], f["time_s"] + f["duration_s"], color=color, alpha=0.15)
            ax.axvline(f["time_s"], color=color, lw=1, alpha=0.8)
    for f in faults:
        top.annotate(f"{f['kind']} {f['target']}", (f["time_s"], 1.0), rotation=90,
                     xycoords=("data", "axes fraction"), va="top", fontsize=6)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(s: dict[str, Any]) -> str:
    """The Markdown report of a `soak.json` summary."""
    verdict = "PASSED" if s["passed"] else "FAILED"
    lines = [
        f"# pdserve soak: {verdict}",
        "",
        f"Seed {s['seed']}, {s['requests']} requests, {len(s['faults'])} faults, "
        f"{s['duration_s']} s.",
        "",
        "| outcome | requests |",
        "|---|---|",
        f"| exact (equal to the reference) | {s['completed_exact']} |",
        f"| equal up to a numerical near-tie | {s['near_tie']} |",
    ]
    lines += [f"| ended with {k} | {n} |" for k, n in s["ended_with_status"].items()]
    lines += [f"| refused as it must be (oversized body) | {s['refused_oversized']} |"]
    lines += [f"| **{k}** | {s[k]} |" for k in FAILING]
    lines += ["", "Every failure's cause (blast radius):", ""]
    lines += [f"- {cause}: {n}" for cause, n in s["explained_by"].items()] or ["- none"]
    lines += [
        "",
        f"Leaked blocks: {s['leaked_blocks']} ({s['leaks_by_worker'] or 'none'}); router in "
        f"flight after quiesce: {s['router_in_flight']}; stale Redis entries: "
        f"{s['stale_index_entries'] or 'none'}; killed workers not back: "
        f"{s['not_rejoined'] or 'none'}.",
        "",
        "![timeline](timeline.png)",
        "",
    ]
    if s["failures"]:
        lines += ["## Failures", ""] + [f"- {f}" for f in s["failures"]] + [""]
        for cat, ex in s["examples"].items():
            lines += [f"### {cat}", ""] + [f"- {e}" for e in ex] + [""]
    lines += ["## Faults", "", "| t (s) | kind | target | duration (s) | rejoined (s) | detail |"]
    lines += ["|---|---|---|---|---|---|"]
    for f in s["faults"]:
        rej = "" if f["rejoined_s"] is None else f"{f['rejoined_s']:.1f}"
        lines.append(
            f"| {f['time_s']:.1f} | {f['kind']} | {f['target']} | {f['duration_s']:.1f} | "
            f"{rej} | {f['detail']} |"
        )
    return "\n".join(lines) + "\n"
