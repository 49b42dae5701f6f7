"""A row of export buttons for one plan: a save dialog, then the file is written off the GUI thread."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QFileDialog, QHBoxLayout, QLabel, QPushButton, QWidget

from rigpilot.app.planner.exports import EXPORT_TARGETS, TARGETS, unsupported, write_export
from rigpilot.app.planner.model import error_text
from rigpilot.app.tasks import run_in_background
from rigpilot.app.widgets.icons import set_icon


class ExportBar(QWidget):
    sig_exported = Signal(str, list)  # target, the paths written (str)
    sig_export_failed = Signal(str)  # the message shown

    def __init__(self, parent: QWidget | None = None, *, title: str = "Export:"):
        super().__init__(parent)
        self.plan: dict[str, Any] | None = None
        self.folder = str(Path.home())
        self.buttons: dict[str, QPushButton] = {}
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        if title:
            layout.addWidget(QLabel(title))
        for t in EXPORT_TARGETS:
            button = QPushButton(t.label + "…")
            set_icon(button, "export")
            button.setObjectName(f"export-{t.key}")
            button.setToolTip(f"Save the plan as {t.label} ({t.default_name})")
            button.clicked.connect(lambda _=False, key=t.key: self.ask_export(key))
            self.buttons[t.key] = button
            layout.addWidget(button)
        layout.addStretch(1)
        self.set_plan(None)

    def set_plan(self, plan: dict[str, Any] | None) -> None:
        """Offer the exports that can express `plan`; a disabled button's tooltip says why not."""
        self.plan = plan
        for key, button in self.buttons.items():
            why_not = None if plan is None else unsupported(plan, key)
            button.setEnabled(plan is not None and why_not is None)
            button.setToolTip(why_not or f"Save the plan as {TARGETS[key].label} ({TARGETS[key].default_name})")

    def ask_export(self, target: str) -> None:
        if self.plan is None:
            return
        t = TARGETS[target]
        path, _ = QFileDialog.getSaveFileName(
            self, f"Export plan as {t.label}", str(Path(self.folder) / t.default_name), t.file_filter
        )
        if path:
            self.export_to(target, path)

    def export_to(self, target: str, path: str) -> None:
        """Write the current plan as `target` to `path` in the background; a signal says how it went."""
        if self.plan is None:
            return
        plan = self.plan
        self.folder = str(Path(path).parent)
        run_in_background(
            lambda: [str(p) for p in write_export(plan, target, path)],
            lambda written: self.sig_exported.emit(target, written),
            lambda e: self.sig_export_failed.emit(f"Could not export {TARGETS[target].label}: {error_text(e)}"),
        )
