"""The report as a chart: one bar per (case, peer), the ratio on a log axis (bench.png)."""

from __future__ import annotations

from pathlib import Path

from .results import Report

FASTER, SLOWER = "tab:green", "tab:red"


def plot_ratios(report: Report, path: Path, *, footer: str = "") -> str | None:
    """Write the chart of ratios; returns why not when it cannot (matplotlib missing).

    One bar per (case, peer), drawn from 1.0 to the ratio on a log axis, so that "2x faster" and
    "2x slower" are bars of the same length on either side; green where modstate is faster, red
    where it is slower; a whisker spans the ratio's range from the quartiles of both sides.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return "bench.png not written: matplotlib is not installed (pip install 'modstate[bench]')"
    bars = [
        (f"{case.case}  vs {peer.impl}", peer)
        for case in report.cases
        for peer in case.peers
        if peer.ratio is not None
    ]
    if not bars:
        return "bench.png not written: no case has both modstate and a peer"
    labels = [label for label, _ in reversed(bars)]
    peers = [peer for _, peer in reversed(bars)]
    ratios = [float(peer.ratio or 1.0) for peer in peers]
    # about 7 inches for the bars, whatever the labels take
    label_inches = 0.065 * max(len(label) for label in labels)
    figure, axes = plt.subplots(figsize=(7.5 + label_inches, 1.9 + 0.32 * len(bars)))
    colors = [FASTER if ratio <= 1 else SLOWER for ratio in ratios]
    rows = range(len(ratios))
    axes.barh(rows, [ratio - 1 for ratio in ratios], left=1.0, color=colors, height=0.7)
    for row, peer in zip(rows, peers, strict=True):
        if peer.ratio_low is not None and peer.ratio_high is not None:
            axes.plot([peer.ratio_low, peer.ratio_high], [row, row], color="black", linewidth=0.8)
    axes.set_yticks(list(rows), labels, fontsize=8)
    axes.axvline(1.0, color="black", linewidth=1)
    axes.set_xscale("log")
    extremes = ratios + [p.ratio_low or 1.0 for p in peers] + [p.ratio_high or 1.0 for p in peers]
    low = min(min(extremes), 1.0) / 2.5  # room for the labels past the bars
    high = max(max(extremes), 1.0) * 2.5
    axes.set_xlim(low, high)
    axes.set_ylim(-0.6, len(ratios) - 0.4)
    fine = (0.1, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5, 10)
    coarse = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100)
    ticks = [t for t in (fine if high / low <= 60 else coarse) if low <= t <= high]
    axes.minorticks_off()
    axes.set_xticks(ticks, [f"{t:g}" for t in ticks])
    for row, peer, ratio in zip(rows, peers, ratios, strict=True):
        # the label sits past the bar's end and past its whisker
        if ratio > 1:
            x, align = max(ratio, peer.ratio_high or ratio), "left"
        else:
            x, align = min(ratio, peer.ratio_low or ratio), "right"
        axes.text(x, row, f" {ratio:.2f} ", va="center", ha=align, fontsize=7)
    axes.set_xlabel("modstate time / peer time (median over interleaved rounds, log scale)")
    axes.set_title("modstate vs peers: bars from 1.0; left of the line, modstate is faster")
    axes.legend(
        handles=[
            Patch(color=FASTER, label="modstate faster (ratio < 1)"),
            Patch(color=SLOWER, label="modstate slower (ratio > 1)"),
            plt.Line2D([], [], color="black", linewidth=0.8, label="range from the quartiles"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
    )
    if footer:
        figure.text(0.01, 0.005, footer, fontsize=8, color="dimgray", ha="left", va="bottom")
    figure.tight_layout(rect=(0, 0.03 if footer else 0, 1, 1))
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return None
