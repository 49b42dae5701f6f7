"""A horizontal fill bar with text, painted from the palette.

Used instead of QProgressBar, whose setValue repaints synchronously (about a
millisecond each with some styles): a dashboard with ten of them updating every
half second spent most of its time there.
"""

from __future__ import annotations

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QPainter, QPaintEvent, QPalette, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

from rigpilot.app.widgets.units import NA


class Meter(QWidget):
    def __init__(self, accessible_name: str = "", parent: QWidget | None = None):
        super().__init__(parent)
        self._fraction: float | None = None
        self._text = NA
        self.setAccessibleName(accessible_name)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setFixedHeight(self.fontMetrics().height() + 6)

    def sizeHint(self) -> QSize:
        return QSize(160, self.fontMetrics().height() + 6)

    def set_value(self, fraction: float | None, text: str) -> None:
        """`fraction` of the bar filled (None: no reading) and the text written over it."""
        fraction = None if fraction is None else min(max(fraction, 0.0), 1.0)
        if fraction == self._fraction and text == self._text:
            return
        self._fraction, self._text = fraction, text
        self.setAccessibleDescription(text)
        self.update()

    def text(self) -> str:
        return self._text

    def paintEvent(self, event: QPaintEvent) -> None:
        pal = self.palette()
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        r = QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5)
        painter.setPen(QPen(pal.color(QPalette.ColorRole.Mid), 1))
        painter.setBrush(pal.color(QPalette.ColorRole.Base))
        painter.drawRoundedRect(r, 3, 3)
        if self._fraction:
            fill = QRectF(r.left(), r.top(), r.width() * self._fraction, r.height())
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(pal.color(QPalette.ColorRole.Highlight))
            painter.drawRoundedRect(fill, 3, 3)
        painter.setPen(pal.color(QPalette.ColorRole.Text))
        painter.drawText(r, Qt.AlignmentFlag.AlignCenter, self._text)
        painter.end()
