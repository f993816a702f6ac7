"""The goodput report's plots are readable: tick labels never overlap, numbers are plain, the
TTFT breakdown starts at a labelled zero. Checked on the drawn figures (label bounding boxes)."""

from __future__ import annotations

import itertools

import matplotlib.pyplot as plt
import pytest
from matplotlib.axis import Axis
from matplotlib.figure import Figure

from tooling.goodput.plots import breakdown_figure, cdf_figure


def _visible_labels(fig: Figure, axis: Axis) -> list[tuple[str, object]]:
    """(text, window bbox) of the axis' labelled ticks inside the view."""
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    lo, hi = sorted(axis.get_view_interval())
    out = []
    for tick in axis.get_major_ticks() + axis.get_minor_ticks():
        label = tick.label1
        if label.get_visible() and label.get_text() and lo <= tick.get_loc() <= hi:
            out.append((label.get_text(), label.get_window_extent(renderer)))
    return out


def _assert_no_overlap(labels: list[tuple[str, object]]) -> None:
    for (a, box_a), (b, box_b) in itertools.combinations(labels, 2):
        assert not box_a.overlaps(box_b), f"tick labels {a!r} and {b!r} overlap"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "ttft",
    [
        [280.0, 400.0, 900.0, 2400.0],  # the demo's range: under one decade
        [90.0, 450.0, 2500.0, 9000.0],  # two decades
        [3.0, 80.0, 5000.0, 90000.0],  # four decades
    ],
)
def test_cdf_log_axes_have_plain_non_overlapping_labels(ttft: list[float]) -> None:
    data = {
        "colocated @ 1.67/s": (ttft, [20.0, 35.0, 90.0, 190.0]),
        "disagg @ 1.67/s": ([t * 1.4 for t in ttft], [22.0, 25.0, 28.0, 33.0]),
    }
    fig = cdf_figure(data, (2872.6, 82.6))
    try:
        fig.canvas.draw()
        for ax in fig.axes:
            labels = _visible_labels(fig, ax.xaxis)
            assert len(labels) >= 3, [t for t, _ in labels]
            _assert_no_overlap(labels)
            for text, _ in labels:
                float(text)  # plain numbers, no `3\times10^{2}` mathtext
    finally:
        plt.close(fig)


def test_breakdown_starts_at_a_labelled_zero_and_series_labels_do_not_collide() -> None:
    parts = {"prefill_queue_ms": 42.5, "prefill_compute_ms": 612.8, "server_other_ms": 113.1}
    data = {
        "colocated @ 1.67/s": parts,
        "colocated-nochunk @ 1.67/s": {**parts, "prefill_compute_ms": 336.3},
        "disagg @ 1.67/s": {**parts, "kv_transfer_ms": 132.7, "prefill_queue_ms": 270.2},
    }
    fig = breakdown_figure(data, "server-side TTFT breakdown")
    try:
        fig.canvas.draw()
        ax = fig.axes[0]
        assert ax.get_ylim()[0] == 0.0
        y_labels = [text for text, _ in _visible_labels(fig, ax.yaxis)]
        assert y_labels[0] == "0", y_labels
        x_labels = _visible_labels(fig, ax.xaxis)
        assert len(x_labels) == 3
        _assert_no_overlap(x_labels)
    finally:
        plt.close(fig)
