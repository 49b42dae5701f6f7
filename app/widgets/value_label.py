"""A label for one reading that says "n/a", with the reason as its tooltip, when the GPU cannot tell."""

from __future__ import annotations

from PySide6.QtWidgets import QLabel, QWidget

from rigpilot.app.widgets.units import NA


class ValueLabel(QLabel):
    """Shows a formatted value, or "n/a" whose tooltip is the reason; never a made-up 0."""

    def __init__(self, tooltip: str = "", parent: QWidget | None = None):
        super().__init__(NA, parent)
        self._tooltip = tooltip
        self.reason: str | None = None
        self.setToolTip(tooltip)

    def show_value(self, text: str | None, reason: str | None = None) -> None:
        if text is None or text == NA:
            self.reason = reason or "not reported"
            self.setText(NA)
            self.setToolTip(f"{self._tooltip}: {self.reason}" if self._tooltip else self.reason)
        else:
            self.reason = None
            self.setText(text)
            self.setToolTip(self._tooltip)
