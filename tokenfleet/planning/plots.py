"""CSV and matplotlib plots of simulation results (matplotlib: ``pip install tokenfleet[sim]``)."""

from __future__ import annotations

import csv
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def write_csv(rows: Sequence[dict[str, Any]], path: str | Path) -> None:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the install
        raise SystemExit("plots need matplotlib: pip install 'tokenfleet[sim]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_plot(rows: Sequence[dict[str, Any]], x: str, ys: Sequence[tuple[str, str, float | None]],
              series: Callable[[dict[str, Any]], str], path: str | Path, title: str, xlabel: str) -> None:
    """One panel per (metric, axis label, objective line), one line per series; PNG or SVG by suffix."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(ys), figsize=(5 * len(ys), 3.8), squeeze=False)
    names = sorted({series(r) for r in rows})
    for ax, (key, label, objective) in zip(axes[0], ys, strict=True):
        for name in names:
            points = sorted((r[x], r[key]) for r in rows if series(r) == name and r.get(key) is not None)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=name)
        if objective is not None:
            ax.axhline(objective, color="red", linestyle="--", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def bar_plot(labels: Sequence[str], values: Sequence[float], path: str | Path, title: str, ylabel: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    bars = ax.bar(labels, values, color="#4878a8")
    for bar, value in zip(bars, values, strict=True):
        ax.annotate(f"{value:g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
