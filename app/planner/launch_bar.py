"""What the Planner page does with the plan shown: export it, or launch a job under it (the job wizard)."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from rigpilot.app.planner.export_bar import ExportBar
from rigpilot.app.widgets.icons import set_icon
from rigpilot.app.widgets.style import mark_primary, set_status


class LaunchBar(QWidget):
    sig_launch = Signal()  # "Launch with this plan…" clicked
    sig_exported = Signal(str, list)  # target, the paths written (str)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.exports = ExportBar()
        self.exports.sig_exported.connect(self._exported)
        self.launch_button = QPushButton("Launch with this plan…")
        set_icon(self.launch_button, "launch")
        mark_primary(self.launch_button)
        self.launch_button.setObjectName("launchPlan")
        self.launch_button.setEnabled(False)
        self.launch_button.clicked.connect(lambda _=False: self.sig_launch.emit())
        self.launch_note = QLabel("")
        self.launch_note.setObjectName("launchNote")
        self.launch_note.setWordWrap(True)
        set_status(self.launch_note, "bad")
        self.launch_note.hide()
        self.export_note = QLabel("")
        self.export_note.setObjectName("exportNote")
        self.export_note.setWordWrap(True)
        self.export_note.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        # Two rows, so five export buttons and the launch button fit a 1024-pixel-wide screen.
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.exports)
        launch_row = QHBoxLayout()
        launch_row.addWidget(self.launch_note, 1)
        launch_row.addWidget(self.launch_button)
        layout.addLayout(launch_row)
        layout.addWidget(self.export_note)

    def set_plan(self, plan: dict[str, Any] | None) -> None:
        """The plan the exports write."""
        self.exports.set_plan(plan)

    def offer_launch(self, launchable: bool, reason: str = "") -> None:
        """Launch only a plan the engine runs here; for one it does not, say why beside the disabled button."""
        self.launch_button.setEnabled(launchable)
        self.launch_button.setToolTip(reason or "Open the job wizard filled from this plan")
        self.launch_note.setText(reason)
        self.launch_note.setToolTip(reason)
        self.launch_note.setVisible(bool(reason))

    def _exported(self, target: str, paths: list[str]) -> None:
        self.export_note.setText("Saved " + " and ".join(paths))
        self.sig_exported.emit(target, paths)
