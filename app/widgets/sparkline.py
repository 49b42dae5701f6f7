"""A small line of recent values, painted directly: dozens fit on a dashboard without the cost of plot widgets."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPaintEvent, QPalette, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

from rigpilot.app.widgets.decimate import minmax_bins


class Sparkline(QWidget):
    """Draws `y` against `x` (NaN = gap) between fixed or data-driven bounds; no axes, no background of its own."""

    def __init__(
        self,
        color: QColor | None = None,
        y_range: tuple[float, float] | None = None,
        min_span: float = 1.0,
        parent: QWidget | None = None,
    ):
        """`y_range` fixes the vertical scale; without it the data sets it, but never narrower than `min_span`
        (so a steady 34 °C reads as a flat line, not as noise blown up to full height)."""
        super().__init__(parent)
        self._color = color
        self._y_range = y_range
        self._min_span = min_span
        self._x = np.empty(0)
        self._y = np.empty(0)
        self._x_span: tuple[float, float] | None = None
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMinimumWidth(60)
        self.setFixedHeight(22)

    def sizeHint(self) -> QSize:
        return QSize(140, 22)

    def set_y_range(self, y_range: tuple[float, float] | None) -> None:
        self._y_range = y_range

    def set_data(self, x: np.ndarray, y: np.ndarray, x_span: tuple[float, float] | None = None) -> None:
        """`x_span` pins the horizontal extent (a time window), so the line scrolls rather than stretches."""
        self._x, self._y, self._x_span = x, y, x_span
        self.update()

    def paintEvent(self, event: QPaintEvent) -> None:
        if len(self._x) < 2 or not np.isfinite(self._y).any():
            return
        x0, x1 = self._x_span or (float(self._x[0]), float(self._x[-1]))
        if self._y_range is not None:
            y0, y1 = self._y_range
        else:
            y0, y1 = float(np.nanmin(self._y)), float(np.nanmax(self._y))
            mid, half = (y0 + y1) / 2, max((y1 - y0) / 2, self._min_span / 2)
            y0, y1 = mid - half, mid + half
        if x1 - x0 <= 0 or y1 - y0 <= 0:
            return
        r = QRectF(self.rect()).adjusted(1, 2, -1, -2)
        # One point per pixel column is all a sparkline can show; the extremes keep spikes visible.
        x, y = minmax_bins(self._x, self._y[None, :], (x1 - x0) / max(r.width() / 2, 1))
        px = r.left() + (x - x0) * (r.width() / (x1 - x0))
        py = r.bottom() - (np.clip(y[0], y0, y1) - y0) * (r.height() / (y1 - y0))
        path = pg.arrayToQPath(px, py, connect="finite")
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setPen(QPen(self._color or self.palette().color(QPalette.ColorRole.Highlight), 1.2))
        painter.setBrush(Qt.BrushStyle.NoBrush)
        painter.drawPath(path)
        painter.end()
