"""Figures whose labels a reader must be able to read: no axis label drawn over another panel's
tick labels."""

from __future__ import annotations


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_stage_1_throughput_labels_do_not_overlap():
    """Stage 1's "Throughput over time": the right panel's "tokens/s" label sat on the left panel's
    tick labels (two panels in 7 inches without a layout)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from eagle3.synthesize import report

    tl = [{"t": 1000.0 + 30 * i, "completion_tokens": 4000 + 10 * i} for i in range(40)]
    fig = report._throughput_figure(tl)
    canvas = FigureCanvasAgg(fig)  # a Figure made without pyplot has no drawing canvas of its own
    canvas.draw()
    renderer = canvas.get_renderer()
    left, right = fig.axes
    drawn = left.get_tightbbox(renderer)  # the left panel with every tick label and label drawn
    right_label = right.yaxis.label.get_window_extent(renderer)
    assert not _overlap(right_label, drawn), (right_label, drawn)
    assert not _overlap(right.get_tightbbox(renderer), drawn)
