"""Markdown summaries and PNG plots that sit next to every JSON report.

A release engineer should be able to look, not read: each report directory holds the
machine form (JSON), a markdown page and the plots that page embeds.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: reports are written on CI machines with no display
import matplotlib.pyplot as plt  # noqa: E402


def md_table(headers: list[str], rows: list[list]) -> str:
    def cell(value) -> str:
        if isinstance(value, bool):
            return "yes" if value else "**NO**"
        if isinstance(value, float):
            return f"{value:.3g}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def histogram_plot(path: Path, series: dict[str, list], *, title: str, xlabel: str, marker: float | None = None) -> Path:
    """Overlaid histograms, one per named series (each a list of 1-D arrays or numbers)."""
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, chunks in series.items():
        values = np.concatenate([np.ravel(c) for c in chunks]) if chunks else np.zeros(0)
        if values.size:
            ax.hist(values, bins=60, alpha=0.55, label=label)
    if marker is not None:
        ax.axvline(marker, color="red", linestyle="--", label="tolerance")
    ax.set(title=title, xlabel=xlabel, ylabel="count")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def scatter_plot(path: Path, points: list[tuple[str, float, float, bool]], *, title: str, xlabel: str, ylabel: str) -> Path:
    """Labelled points (label, x, y, highlighted), named in a legend: recipes of near-equal
    size and error share one spot, where on-plot labels would overprint. Highlighted points
    get a thick red ring."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (label, x, y, highlighted) in enumerate(points):
        ax.scatter([x], [y], color=plt.cm.tab10(i % 10), s=60, label=label,
                   edgecolors="red" if highlighted else "none", linewidths=2.5 if highlighted else 0)
    ax.set_yscale("symlog", linthresh=1e-4)
    return _save_with_side_legend(fig, ax, path, title=title, xlabel=xlabel, ylabel=ylabel, fontsize=8)


def line_plot(path: Path, series: dict[str, tuple[list, list, bool]], *, title: str, xlabel: str, ylabel: str,
              hlines: dict[str, float]) -> Path:
    """Named series (x, y, dashed) on a log y axis (None values left out), with labelled
    horizontal limits in red."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (label, (xs, ys, dashed)) in enumerate(series.items()):
        points = [(x, y) for x, y in zip(xs, ys) if y is not None and y > 0]
        if points:
            ax.plot(*zip(*points), marker="o", markersize=3, linestyle="--" if dashed else "-",
                    color=plt.cm.tab10(i % 10), label=label)
    for j, (label, value) in enumerate(hlines.items()):
        ax.axhline(value, color="red", linestyle="-" if j == 0 else ":", label=label)
    ax.set_yscale("log")
    return _save_with_side_legend(fig, ax, path, title=title, xlabel=xlabel, ylabel=ylabel, fontsize=7)


def _save_with_side_legend(fig, ax, path: Path, *, title: str, xlabel: str, ylabel: str, fontsize: int) -> Path:
    """Titles, a light grid and the legend beside the axes (many series would cover the data)."""
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=fontsize, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
