"""The one plotting path of the benchmarks: matplotlib (the `bench` extra), headless, the format by
the file's suffix (.svg or .png). Where matplotlib is missing (the GPU machine) nothing is drawn and
a line says so: the `plot` sub-commands draw the charts later from the result JSON.
"""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    return plt


def _save(fig, plt, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"plot: {path}")
    return path


def bars(labels, values, path, *, title: str, ylabel: str, notes=None) -> Path | None:
    """One bar per label, `notes[i]` (text) above bar i."""
    plt = _pyplot()
    if plt is None:
        print(f"matplotlib is not installed: no plot {path}")
        return None
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(labels)), 3.6))
    drawn = ax.bar(labels, values, color="tab:blue")
    if notes:
        ax.bar_label(drawn, labels=notes, padding=2, fontsize=9)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.margins(y=0.15)
    return _save(fig, plt, Path(path))


def stacked(labels, parts: dict, path, *, title: str, ylabel: str) -> Path | None:
    """One bar per label, stacked from `parts` {part: [value per label]} in their order, with a
    legend."""
    plt = _pyplot()
    if plt is None:
        print(f"matplotlib is not installed: no plot {path}")
        return None
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(labels)) + 1.6, 3.6))
    bottom = [0.0] * len(labels)
    for name, values in parts.items():
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    return _save(fig, plt, Path(path))


def lines(panels: dict, path, *, title: str, xlabel: str, ylabel: str, logx: bool = True,
          hline: float | None = None) -> Path | None:
    """One subplot per panel {panel title: {series label: (xs, ys)}}, side by side, shared y axis;
    `hline`: a dashed reference line (e.g. 1.0 for a ratio)."""
    plt = _pyplot()
    if plt is None:
        print(f"matplotlib is not installed: no plot {path}")
        return None
    n = len(panels)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols + 1.6, 3.4 * rows), sharey=True, squeeze=False)
    for ax, (name, series) in zip(axes.flat, panels.items()):
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
        if logx:
            ax.set_xscale("log", base=2)
        if hline is not None:
            ax.axhline(hline, color="gray", linestyle="--", linewidth=1)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.suptitle(title)
    return _save(fig, plt, Path(path))
