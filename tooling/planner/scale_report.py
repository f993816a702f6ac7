"""`pdserve simulate`'s outputs: simulation.json, report.md and its plots. CLI process
(matplotlib, Agg).

- `simulation.json`: `ScaleResult.to_json()` — adaptive_goodput, best_fixed_goodput,
  best_fixed_split, every fixed split's goodput (`fixed_goodput`), per-phase attainment,
  the ratio changes and the controller's decision records;
- `goodput_by_split.png`: goodput of every fixed split, the adaptive run as a line;
- `timeline.png`: rolling attainment of the adaptive run (or the `--policy fixed:P:D` split)
  and the best fixed split, with the controller's worker counts below and the phases marked.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from tooling.planner.scale import ScaleResult
from tooling.planner.timeline import plot_timeline
from tooling.planner.workload import phase_starts


def _meets(res: ScaleResult, label: str) -> list[tuple[float, bool]]:
    slo_ttft, slo_tpot = res.setup["slo_ttft_s"], res.setup["slo_tpot_s"]
    out = []
    for r, o in zip(res.requests, res.outcomes[label], strict=True):
        ok = o.ok and o.ttft_s is not None and o.ttft_s <= slo_ttft
        ok = ok and (o.tpot_s is None or o.tpot_s <= slo_tpot)
        out.append((o.end_s if o.end_s is not None else r.arrival_s, ok))
    return out


def plot_goodput(res: ScaleResult, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(10, 4))
    labels = [r.split for r in res.fixed]
    ax.bar(labels, [r.goodput_rps for r in res.fixed], color="#8aa", label="fixed split")
    ax.axhline(res.adaptive_goodput, color="C3", lw=1.8, label="adaptive (ratio controller)")
    ax.set_xlabel("prefill:decode")
    ax.set_ylabel("goodput (req/s meeting both SLOs)")
    ax.tick_params(axis="x", labelrotation=90 if len(labels) > 16 else 0)
    ax.legend(fontsize=8)
    ax.set_title(
        f"{res.setup['workload']} on {res.setup['workers']} workers ({res.setup['profile']})"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_scale_report(res: ScaleResult, out: Path) -> Path:
    """Write simulation.json, the plots and report.md into `out`; return report.md's path."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulation.json").write_text(json.dumps(res.to_json(), indent=1) + "\n")
    plot_goodput(res, out / "goodput_by_split.png")
    phases = [tuple(p) for p in res.setup["phases"]]
    best = res.best_fixed_split
    series = {res.subject: _meets(res, res.subject)}
    if best != res.subject:
        series[f"best fixed {best}"] = _meets(res, best)
    changes = res.changes if res.subject == "adaptive" else []
    plot_timeline(
        series,
        changes,
        out / "timeline.png",
        target=res.setup["target"],
        window_s=10.0,
        phases=phase_starts([(str(n), float(r), float(d)) for n, r, d in phases]),
        title=f"{res.setup['workload']}, {res.setup['workers']} workers",
    )
    (out / "report.md").write_text(markdown(res) + "\n")
    return out / "report.md"


def start_text(res: ScaleResult) -> str:
    c = res.setup["cluster"]
    first = f"{c['prefill']}:{c['decode']}"
    if first == res.best_fixed_split:
        return f"the best fixed split ({first})"
    return f"{first} (not the best fixed split, {res.best_fixed_split}: `--start`)"


def markdown(res: ScaleResult) -> str:
    s = res.setup
    lines = [
        f"# Ratio controller at scale (simulated): `{s['workload']}` on {s['workers']} workers",
        "",
        f"**Adaptive / best fixed split ({res.best_fixed_split}): "
        f"{res.adaptive_vs_best_fixed:.2f}x** (goodput {res.adaptive_goodput:.1f} vs "
        f"{res.best_fixed_goodput:.1f} req/s meeting TTFT <= {s['slo_ttft_s'] * 1e3:g} ms and "
        f"TPOT <= {s['slo_tpot_s'] * 1e3:g} ms).",
        "",
        f"- profile `{s['profile']}`: {s['worker']}",
        f"- workload: {', '.join(f'{n} at {r:g} req/s for {d:g} s' for n, r, d in s['phases'])}"
        f" ({s['requests']} requests, seed {s['seed']})",
        "- every fixed split is simulated on the same requests; the adaptive run is the router's "
        "own `RatioController` (decisions, hysteresis, cooldown, reverts) on the simulator's "
        f"clock, starting from {start_text(res)}; a switch drains the worker request by "
        "request first",
        f"- controller: window {s['controller']['window_s']:g} s, decision every "
        f"{s['controller']['interval_s']:g} s, cooldown {s['controller']['cooldown_s']:g} s, "
        f"hysteresis {s['controller']['hysteresis']:g}, max step {s['controller']['max_step']}, "
        f"drain limit {s['controller']['drain_timeout_s']:g} s",
        "",
        "![goodput by split](goodput_by_split.png)",
        "",
        "![timeline](timeline.png)",
        "",
        "| configuration | goodput req/s | attainment | TTFT att. | TPOT att. | "
        + " | ".join(f"phase {i + 1} att." for i in range(len(s["phases"])))
        + " |",
        "|---|---|---|---|---|" + "---|" * len(s["phases"]),
    ]
    for r in [res.adaptive, *res.fixed]:
        mark = " (best fixed)" if r.split == res.best_fixed_split else ""
        lines.append(
            f"| {r.split}{mark} | {r.goodput_rps:.1f} | {r.attainment:.1%} | "
            f"{r.ttft_attainment:.1%} | {r.tpot_attainment:.1%} | "
            + " | ".join(f"{p['attainment']:.1%}" for p in r.phases)
            + " |"
        )
    if res.pairing:
        lines += pairing_markdown(res)
    lines += ["", "Ratio changes of the adaptive run (completed switches):", ""]
    for t, p, d, what in res.changes:
        lines.append(f"- t={t:.1f} s: {p}:{d} ({what})")
    if res.thresholds:
        lines += ["", "Hybrid threshold of the adaptive run (local prefill up to N tokens):", ""]
        lines += [f"- t={t:.1f} s: {n} tokens" for t, n in res.thresholds]
    moves = [m for m in res.decisions if m["event"] == "decision" and m["action"] != "hold"]
    lines += ["", f"Controller decisions ({len(moves)}):", ""]
    for m in moves:
        to = m["to_role"] if m["action"] != "threshold" else m["threshold_to"]
        lines.append(f"- t={m['t']:.1f} s: {m['action']} -> {to}: {m['reason']}")
    return "\n".join(lines)


def pairing_markdown(res: ScaleResult) -> list[str]:
    """The node-blind vs pair-aware comparison of a multi-node run."""
    pr, s = res.pairing, res.setup
    lines = [
        "",
        f"## Prefill/decode pairs over {s['nodes']} nodes ({s['cross_node_gbps']:g} GB/s "
        "between nodes)",
        "",
        f"At the best fixed split {pr['split']} (workers' nodes: {', '.join(pr['nodes'])}): the "
        "router's least-load policy node-blind (every KV move priced 0) vs with pair scoring "
        "(`router.pair_scoring`: queue, prefix and the move's exposed transfer time). A pair on "
        "one node moves KV at the profile's same-node cost; across nodes the prompt's KV bytes "
        "share the prefill worker's link.",
        "",
        "| routing | goodput req/s | attainment | TTFT p90 | pairs across nodes |",
        "|---|---|---|---|---|",
    ]
    for name in ("node_blind", "pair_aware"):
        r = pr[name]
        p90 = "-" if r["ttft_p90_s"] is None else f"{r['ttft_p90_s'] * 1e3:.0f} ms"
        lines.append(
            f"| {name.replace('_', '-')} | {r['goodput_rps']:.1f} | {r['attainment']:.1%} | "
            f"{p90} | {r['cross_node_share']:.0%} |"
        )
    if pr.get("pair_vs_blind") is not None:
        lines += ["", f"Pair-aware / node-blind goodput: **{pr['pair_vs_blind']:.2f}x**."]
    return lines
