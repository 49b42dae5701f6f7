"""The pyqtgraph plot every chart of the app is drawn in: the wheel scrolls the page, Ctrl+wheel zooms.

pyqtgraph hands every wheel turn to the plot, so a page of charts could not be
scrolled with the mouse over one of them: the chart zoomed instead. Here an
unmodified wheel turn is left unaccepted, and Qt passes it on to the widget
that holds the chart (the page's scroll area); only with Ctrl held does it
reach the plot and zoom it (where the chart lets itself be zoomed).
"""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QWheelEvent

ZOOM_MODIFIER = Qt.KeyboardModifier.ControlModifier
ZOOM_HINT = "Ctrl+wheel zooms; the wheel alone scrolls the page"


class ChartView(pg.PlotWidget):
    def wheelEvent(self, event: QWheelEvent) -> None:
        if event.modifiers() & ZOOM_MODIFIER:
            super().wheelEvent(event)
            event.accept()  # a chart that cannot zoom swallows it too: Ctrl+wheel must not scroll the page
            return
        event.ignore()
