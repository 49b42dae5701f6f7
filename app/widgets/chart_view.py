"""The pyqtgraph plot every chart of the app is drawn in: the wheel scrolls the page, Ctrl+wheel zooms.

pyqtgraph hands every wheel turn to the plot, so a page of charts could not be
scrolled with the mouse over one of them: the chart zoomed instead. Here an
unmodified wheel turn is left unaccepted, and Qt passes it on to the widget
that holds the chart (the page's scroll area); only with Ctrl held does it
reach the plot and zoom it (where the chart lets itself be zoomed).
"""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import QEvent, Qt
from PySide6.QtGui import QFont, QFontMetricsF, QResizeEvent, QWheelEvent

from rigpilot.app.widgets.palette import apply_plot_theme

ZOOM_MODIFIER = Qt.KeyboardModifier.ControlModifier
ZOOM_HINT = "Ctrl+wheel zooms; the wheel alone scrolls the page"
TITLE_POINTS = 9
TITLE_MARGIN_PX = 12


class ChartView(pg.PlotWidget):
    _titles: tuple[str, str] | None = None

    def set_title(self, full: str, short: str | None = None) -> None:
        """A title that is never cut: `full` where the chart is wide enough for it, else `short`.

        The caller keeps what `full` adds in the tooltip, so a narrow chart loses no information.
        """
        self._titles = (full, short or full)
        self._fit_title()

    def title_text(self) -> str:
        return self.getPlotItem().titleLabel.text

    def _fit_title(self) -> None:
        if self._titles is None:
            return
        full, short = self._titles
        font = QFont(self.font())
        font.setPointSizeF(TITLE_POINTS)
        fits = QFontMetricsF(font).horizontalAdvance(full) + TITLE_MARGIN_PX <= self.width()
        text = full if fits else short
        item = self.getPlotItem()
        if item.titleLabel.text != text:
            item.setTitle(text, size=f"{TITLE_POINTS}pt")

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        self._fit_title()

    def changeEvent(self, event: QEvent) -> None:
        # Every chart follows the theme it is shown in: one left to set its own kept the light background in dark.
        # (GraphicsView's own set-up changes the palette before the plot item exists.)
        themed = event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange)
        if themed and getattr(self, "plotItem", None) is not None:
            apply_plot_theme(self, self.palette())
        super().changeEvent(event)

    def viewportEvent(self, event: QEvent | None) -> bool:
        # QGraphicsView (de)activates its scene on every show and hide of its viewport, an event to each of
        # the plot's items; pyqtgraph's items need no activation, and holding a job's eight charts back
        # while they are drawn (JobCharts.hold_until_drawn) spent milliseconds of the click on it.
        if event is not None and event.type() in (QEvent.Type.Show, QEvent.Type.Hide):
            return False
        return super().viewportEvent(event)

    def wheelEvent(self, event: QWheelEvent) -> None:
        if event.modifiers() & ZOOM_MODIFIER:
            super().wheelEvent(event)
            event.accept()  # a chart that cannot zoom swallows it too: Ctrl+wheel must not scroll the page
            return
        event.ignore()
