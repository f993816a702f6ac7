"""Timeline of ratio changes against SLO attainment (a PNG for the ratio and goodput reports).

Runs in the benchmark / report process (matplotlib, Agg). Inputs are plain data:

- `series`: label -> [(end time s, meets both SLOs)] of each configuration's requests, on the
  run's clock (t = 0 at the first scheduled arrival);
- `changes`: [(time s, prefill workers, decode workers, label)] from the controller's `done`
  decision records (`ratio_steps` builds them from JSONL records and the run's start);
- `phases`: [(start s, name)] of a shifting workload, drawn as vertical lines.

Top panel: rolling attainment (both SLOs) over the requests that ended in the last `window_s`
seconds, one line per configuration, and the target. Bottom panel: the controller's prefill
and decode worker counts over time, one marker per change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def rolling(
    points: Sequence[tuple[float, bool]], window_s: float, step_s: float = 1.0
) -> tuple[list[float], list[float]]:
    """(times, attainment) of the requests ending in (t - window_s, t], every `step_s`
    (times with no such request are skipped)."""
    pts = sorted(points)
    if not pts:
        return [], []
    ts, ys = [], []
    t, end = pts[0][0], pts[-1][0]
    lo = 0
    while t <= end + step_s:
        while lo < len(pts) and pts[lo][0] <= t - window_s:
            lo += 1
        hi = lo
        while hi < len(pts) and pts[hi][0] <= t:
            hi += 1
        if hi > lo:
            ts.append(t)
            ys.append(sum(ok for _, ok in pts[lo:hi]) / (hi - lo))
        t += step_s
    return ts, ys


def ratio_steps(
    records: Sequence[Mapping[str, Any]], t0_wall: float, initial: tuple[int, int]
) -> list[tuple[float, int, int, str]]:
    """Changes [(t, prefill, decode, label)] from decision-log records: the initial ratio at
    t = 0, then one entry per `done` record (its wall time minus `t0_wall`)."""
    out = [(0.0, initial[0], initial[1], "start")]
    for r in records:
        if r.get("event") == "done":
            label = f"{r['action']} {r.get('address') or ''} -> {r.get('to_role') or 'gone'}"
            out.append((r["wall_time"] - t0_wall, r["prefill_workers"], r["decode_workers"], label))
    return out


def plot_timeline(
    series: Mapping[str, Sequence[tuple[float, bool]]],
    changes: Sequence[tuple[float, int, int, str]],
    path: Path,
    target: float = 0.9,
    window_s: float = 10.0,
    phases: Sequence[tuple[float, str]] = (),
    title: str = "",
) -> Path:
    """Write the two-panel timeline PNG to `path` (module docstring); return `path`."""
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(10, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]}
    )
    for label, pts in series.items():
        ts, ys = rolling(pts, window_s)
        top.plot(ts, ys, label=label, lw=1.6 if label == "adaptive" else 1.0)
    top.axhline(target, color="grey", ls=":", lw=1, label=f"target {target:.0%}")
    top.set_ylabel(f"attainment, last {window_s:g} s")
    top.set_ylim(-0.02, 1.02)
    top.legend(loc="lower left", fontsize=8)
    if title:
        top.set_title(title)
    if changes:
        end = max([max((p[0] for p in pts), default=0.0) for pts in series.values()] + [1.0])
        ts = [c[0] for c in changes] + [end]
        pre = [c[1] for c in changes] + [changes[-1][1]]
        dec = [c[2] for c in changes] + [changes[-1][2]]
        bottom.step(ts, pre, where="post", label="prefill workers")
        bottom.step(ts, dec, where="post", label="decode workers")
        bottom.plot([c[0] for c in changes[1:]], [c[1] for c in changes[1:]], "k|", ms=12)
        bottom.set_ylim(0, max(pre + dec) + 1)
    bottom.set_ylabel("workers (adaptive)")
    bottom.set_xlabel("time since the run started (s)")
    bottom.legend(loc="upper left", fontsize=8)
    for ax in (top, bottom):
        for start, name in phases:
            ax.axvline(start, color="black", lw=0.6, alpha=0.5)
            if ax is top:
                ax.text(start, 1.0, f" {name}", va="top", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
