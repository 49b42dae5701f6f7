"""A one-line label that elides what does not fit (the whole text in its tooltip) and never asks for more width."""

from __future__ import annotations

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QResizeEvent
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget


class ElidedLabel(QLabel):
    """A QLabel asks for its text's whole width, so one long file name can widen a window past the screen;
    this one shows as much as fits, ending in "…", and keeps the full text for `text()` and the tooltip."""

    def __init__(
        self, text: str = "", parent: QWidget | None = None, *, mode: Qt.TextElideMode = Qt.TextElideMode.ElideRight
    ):
        super().__init__(parent)
        self._full = ""
        self._mode = mode
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.setTextFormat(Qt.TextFormat.PlainText)
        self.setText(text)

    def setText(self, text: str) -> None:
        self._full = text
        self.setToolTip(text)
        self.setAccessibleName(text)
        self._elide()

    def text(self) -> str:
        return self._full

    def shown_text(self) -> str:
        """What fits, as drawn."""
        return super().text()

    def minimumSizeHint(self) -> QSize:
        return QSize(self.fontMetrics().horizontalAdvance("…") * 3, super().minimumSizeHint().height())

    def sizeHint(self) -> QSize:
        return QSize(self.fontMetrics().horizontalAdvance(self._full) + 8, super().sizeHint().height())

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        self._elide()

    def _elide(self) -> None:
        width = max(self.contentsRect().width(), 1)
        super().setText(self.fontMetrics().elidedText(self._full, self._mode, width))
