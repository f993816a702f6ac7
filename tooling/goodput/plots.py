"""PNG plots of a goodput report (matplotlib, Agg backend: no display needed).

Runs in the orchestrator / `pdserve report`. Each function takes plain data keyed by series
label (a configuration, or `run:configuration` when comparing saved runs), writes one PNG and
returns its path:

- `plot_attainment`: attainment (both SLOs, TTFT only, TPOT only) vs offered rate, one line per
  series, the target as a dashed line;
- `plot_cdfs`: empirical CDFs of TTFT and TPOT per series at one rate, SLOs as dashed lines,
  log axes labelled with plain numbers (`cdf_figure` builds the figure);
- `plot_breakdown`: mean server-side TTFT components per series as stacked bars from zero,
  each series' label on two lines (`breakdown_figure` builds the figure).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

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


def _log_ticks(ax: Axes) -> None:
    """Plain-number labels on a log x axis, few enough not to overlap.

    matplotlib's default labels every minor tick of a short range as `3x10^2`, side by side;
    here majors are 1-2-3-5 (one decade or less), 1-2-5 (up to about three) or powers of ten,
    written as plain numbers (`300`, `1000`), and minor ticks get no label."""
    lo, hi = ax.get_xlim()
    decades = np.log10(hi / lo) if lo > 0 and hi > lo else 1.0
    subs = (1.0, 2.0, 3.0, 5.0) if decades <= 1.2 else (1.0, 2.0, 5.0) if decades <= 3 else (1.0,)
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


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
    return _save(cdf_figure(data, slo, title), path)


def cdf_figure(
    data: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    slo: tuple[float, float],
    title: str = "",
) -> Figure:
    """The figure `plot_cdfs` saves (the caller closes it)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for label, (ttft, tpot) in data.items():
        _cdf(axes[0], ttft, label)
        _cdf(axes[1], tpot, label)
    for ax, name, limit in zip(axes, ("TTFT", "TPOT"), slo, strict=True):
        ax.axvline(limit, color="grey", linestyle="--", linewidth=1, label=f"SLO {limit:g} ms")
        ax.set_xscale("log")
        _log_ticks(ax)
        ax.set_xlabel(f"{name} (ms, log scale)")
        ax.set_ylabel("fraction of successful requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_breakdown(data: Mapping[str, Mapping[str, float]], path: Path, title: str = "") -> Path:
    """Stacked bars of mean TTFT components (ms) per series."""
    return _save(breakdown_figure(data, title), path)


def breakdown_figure(data: Mapping[str, Mapping[str, float]], title: str = "") -> Figure:
    """The figure `plot_breakdown` saves (the caller closes it)."""
    labels = list(data)
    parts: list[str] = []
    for comp in data.values():
        parts += [p for p in comp if p not in parts]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.8 * len(labels) + 3), 4))
    x = np.arange(len(labels))
    bottom = np.zeros(len(labels))
    for part in parts:
        vals = np.array([data[lab].get(part, 0.0) for lab in labels])
        ax.bar(x, vals, width=0.6, bottom=bottom, label=part.removesuffix("_ms").replace("_", " "))
        bottom += vals
    # "config @ rate" on two lines, so neighbouring labels never run into each other.
    ax.set_xticks(x, [lab.replace(" @ ", "\n@ ") for lab in labels], fontsize=9)
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=6, min_n_ticks=3))
    ax.set_ylabel("mean TTFT component (ms)")
    handles, names = ax.get_legend_handles_labels()  # top of the stack first, as drawn
    ax.legend(handles[::-1], names[::-1], fontsize=8, bbox_to_anchor=(1.02, 1), loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
