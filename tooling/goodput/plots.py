"""PNG plots of a goodput report (matplotlib, Agg backend: no display needed).

Runs in the orchestrator / `pdserve report`. Each function takes plain data keyed by series
label (a configuration, or `run:configuration` when comparing saved runs), writes one PNG and
returns its path:

- `plot_attainment`: attainment (both SLOs, TTFT only, TPOT only) vs offered rate, one line per
  series, the target as a dashed line;
- `plot_cdfs`: empirical CDFs of TTFT and TPOT per series at one rate, SLOs as dashed lines;
- `plot_breakdown`: mean server-side TTFT components per series as stacked bars.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes

Point = tuple[float, float, float, float]  # (rate, both, ttft-only, tpot-only)


def plot_attainment(
    series: Mapping[str, Sequence[Point]], target: float, path: Path, title: str = ""
) -> Path:
    """Attainment vs rate: three panels (both SLOs, TTFT only, TPOT only)."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
    for label, pts in series.items():
        pts = sorted(pts)
        rates = [p[0] for p in pts]
        for ax, col in zip(axes, (1, 2, 3), strict=True):
            ax.plot(rates, [100 * p[col] for p in pts], marker="o", label=label)
    for ax, name in zip(axes, ("both SLOs", "TTFT only", "TPOT only"), strict=True):
        ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"attainment: {name}")
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("requests meeting the SLO (%)")
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cdf(ax: Axes, values: Sequence[float], label: str) -> None:
    if not values:
        return
    v = np.sort(np.asarray(values, dtype=float))
    ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=label)


def plot_cdfs(
    data: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    slo: tuple[float, float],
    path: Path,
    title: str = "",
) -> Path:
    """CDFs of TTFT and TPOT (ms) per series; `slo` = (TTFT SLO, TPOT SLO) in ms."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for label, (ttft, tpot) in data.items():
        _cdf(axes[0], ttft, label)
        _cdf(axes[1], tpot, label)
    for ax, name, limit in zip(axes, ("TTFT", "TPOT"), slo, strict=True):
        ax.axvline(limit, color="grey", linestyle="--", linewidth=1, label=f"SLO {limit:g} ms")
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms, log scale)")
        ax.set_ylabel("fraction of successful requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_breakdown(data: Mapping[str, Mapping[str, float]], path: Path, title: str = "") -> Path:
    """Stacked bars of mean TTFT components (ms) per series."""
    labels = list(data)
    parts: list[str] = []
    for comp in data.values():
        parts += [p for p in comp if p not in parts]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(labels) + 3), 4))
    bottom = np.zeros(len(labels))
    for part in parts:
        vals = np.array([data[lab].get(part, 0.0) for lab in labels])
        ax.bar(labels, vals, bottom=bottom, label=part.removesuffix("_ms"))
        bottom += vals
    ax.set_ylabel("mean TTFT component (ms)")
    ax.legend(fontsize=8, bbox_to_anchor=(1.02, 1), loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
