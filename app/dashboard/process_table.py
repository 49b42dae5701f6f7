"""GPU processes, as nvitop lists them: which program holds how much memory on which GPU."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableWidget, QTableWidgetItem, QWidget

from rigpilot.app.widgets.units import NA, mib

COLUMNS = ["GPU", "PID", "User", "GPU memory", "Command"]


class _NumberItem(QTableWidgetItem):
    """Sorts by the number it was given, not by its text."""

    def __init__(self, text: str, number: float):
        super().__init__(text)
        self.setData(Qt.ItemDataRole.UserRole, number)
        self.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)

    def __lt__(self, other: QTableWidgetItem) -> bool:
        return (self.data(Qt.ItemDataRole.UserRole) or 0) < (other.data(Qt.ItemDataRole.UserRole) or 0)


class ProcessTable(QTableWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(0, len(COLUMNS), parent)
        self.setObjectName("processTable")
        self.setAccessibleName("GPU processes")
        self.setHorizontalHeaderLabels(COLUMNS)
        self.verticalHeader().hide()
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.setTabKeyNavigation(False)  # Tab leaves the table, as everywhere else on the page
        self.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.setAlternatingRowColors(True)
        self.setSortingEnabled(True)
        self.horizontalHeader().setSectionResizeMode(len(COLUMNS) - 1, QHeaderView.ResizeMode.Stretch)
        self._shown: tuple[Any, ...] | None = None

    def show_processes(self, rows: list[tuple[int, dict[str, Any]]], empty_reason: str | None = None) -> None:
        """(GPU, process dict) rows; `empty_reason` explains an empty list that is not "nothing runs"."""
        key = (
            tuple((i, p.get("pid"), p.get("used_memory"), p.get("user"), p.get("command")) for i, p in rows),
            empty_reason,
        )
        if key == self._shown:
            return  # the list changes rarely; rebuilding it would reset the user's scroll and selection
        self._shown = key
        self.setSortingEnabled(False)
        self.setRowCount(0)
        if not rows:
            self.setRowCount(1)
            text = f"{NA}: {empty_reason}" if empty_reason else "No processes on the GPUs"
            item = QTableWidgetItem(text)
            item.setFlags(Qt.ItemFlag.ItemIsEnabled)
            self.setItem(0, 0, item)
            self.setSpan(0, 0, 1, len(COLUMNS))
            return
        self.clearSpans()
        self.setRowCount(len(rows))
        for r, (gpu, p) in enumerate(rows):
            used = p.get("used_memory")
            cells = [
                _NumberItem(str(gpu), gpu),
                _NumberItem(str(p.get("pid")), p.get("pid") or 0),
                QTableWidgetItem(p.get("user") or NA),
                _NumberItem(mib(used), used if used is not None else -1),
                QTableWidgetItem(p.get("command") or NA),
            ]
            if p.get("user") is None:
                cells[2].setToolTip("The driver did not say which user runs this process")
            if used is None:
                cells[3].setToolTip("Not reported (e.g. a graphics process on some drivers)")
            cells[4].setToolTip(p.get("command") or "")
            for c, item in enumerate(cells):
                self.setItem(r, c, item)
        self.setSortingEnabled(True)
