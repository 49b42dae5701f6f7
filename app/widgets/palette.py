"""Colours that follow the system's light or dark palette.

Nothing in the pages hard-codes a background: plots take theirs from the
palette's Base role and their ink from Text, and category colours are blended
into the palette so they stay legible in both themes.
"""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtGui import QColor, QPalette

# Tableau 10: distinct hues with similar weight, readable on white and on near-black.
SERIES_COLORS = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
    "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
]  # fmt: skip

# Colours with a meaning (fine, attention, bad, neutral), blended into the palette where used.
GOOD = QColor("#2e9d4f")
WARN = QColor("#d9a400")
BAD = QColor("#d1495b")
ACCENT = QColor("#4e79a7")


def series_color(index: int) -> QColor:
    return QColor(SERIES_COLORS[index % len(SERIES_COLORS)])


def blend(color: QColor, background: QColor, amount: float) -> QColor:
    """`amount` of `color` over `background` (0 = background, 1 = color), opaque."""
    a = max(0.0, min(1.0, amount))
    return QColor.fromRgbF(
        color.redF() * a + background.redF() * (1 - a),
        color.greenF() * a + background.greenF() * (1 - a),
        color.blueF() * a + background.blueF() * (1 - a),
    )


def tint(color: QColor, palette: QPalette, amount: float = 0.35) -> QColor:
    """A background for cells and boxes: the colour faded into the palette's base."""
    return blend(color, palette.color(QPalette.ColorRole.Base), amount)


def apply_plot_theme(plot: pg.PlotWidget, palette: QPalette) -> None:
    """Background and axes of a pyqtgraph plot from the widget palette."""
    plot.setBackground(palette.color(QPalette.ColorRole.Base))
    ink = palette.color(QPalette.ColorRole.Text)
    faint = palette.color(QPalette.ColorRole.PlaceholderText)
    for name in ("left", "bottom", "right", "top"):
        axis = plot.getPlotItem().getAxis(name)
        axis.setPen(pg.mkPen(faint))
        axis.setTextPen(pg.mkPen(ink))


def status_text(color: QColor, palette: QPalette) -> QColor:
    """A status colour as text that reads on the palette's background: drawn towards its ink (darker on a light
    theme, lighter on a dark one), so warnings in yellow stay legible on white."""
    return blend(color, palette.color(QPalette.ColorRole.Text), 0.72)
