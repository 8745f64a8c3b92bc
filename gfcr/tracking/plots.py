"""PNG plots of a report: one line per variant (mean over seeds), a band from min to max.

Figures are built with ``matplotlib.figure.Figure`` and written by the Agg canvas, never
through ``pyplot``: no global backend switch, no display needed, no figure left open.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from gfcr.tracking.report_variants import Curve


@dataclass(frozen=True)
class PlotSpec:
    """What a plot shows: its file name, title, axis labels and style."""

    name: str
    title: str
    xlabel: str
    ylabel: str
    caption: str = ""
    markers: bool = False  # evaluations are few: show each point
    diagonal: bool = False  # draw y = x for reference
    integer_x: bool = False  # steps: no tick at 0.5


def colour(index: int) -> tuple[float, ...]:
    """The colour of the ``index``-th variant, the same in every plot."""
    return colormaps["tab10"](index % 10)


def hex_colour(rgba: tuple[float, ...]) -> str:
    """``#1f77b4`` for an RGBA tuple of floats (the swatches of the reports' tables)."""
    return "#" + "".join(f"{round(c * 255):02x}" for c in rgba[:3])


def draw(curves: Sequence[Curve], spec: PlotSpec, out_dir: Path) -> Path:
    """Write ``<out_dir>/<spec.name>.png`` and return its path."""
    fig = Figure(figsize=(7.0, 4.4), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, curve in enumerate(curves):
        if not curve.x:
            continue
        ax.plot(curve.x, curve.y, color=colour(i), label=curve.label, marker="o" if spec.markers else None,
                markersize=4, linewidth=1.8)
        if curve.lo != curve.hi:
            ax.fill_between(curve.x, curve.lo, curve.hi, color=colour(i), alpha=0.18, linewidth=0)
    if spec.diagonal:  # spans the view without widening it
        ax.axline((0, 0), slope=1, color="grey", linestyle="--", linewidth=1, label="every generated token used")
    if spec.integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(title=spec.title, xlabel=spec.xlabel, ylabel=spec.ylabel)
    ax.grid(alpha=0.3)
    if any(c.x for c in curves):
        ax.legend(fontsize=8, loc="best")
    path = out_dir / f"{spec.name}.png"
    fig.savefig(path)
    return path
