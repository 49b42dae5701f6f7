"""Choosing a second run whose loss is drawn over the shown job's, step for step."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QWidget

NONE = ""


class ComparePicker(QWidget):
    sig_compare_changed = Signal(str)  # the job id to overlay, or "" for none

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.box = QComboBox()
        self.box.setObjectName("compareWith")
        self.box.setAccessibleName("Compare loss with")
        self.box.setToolTip("Draw another job's loss on the same chart")
        self.box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToContents)
        self.box.addItem("no other job", NONE)
        self.box.currentIndexChanged.connect(lambda _: self.sig_compare_changed.emit(self.job_id))
        label = QLabel("&Compare with")
        label.setBuddy(self.box)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(label)
        layout.addWidget(self.box)

    @property
    def job_id(self) -> str:
        return self.box.currentData() or NONE

    def set_jobs(self, jobs: list[dict[str, Any]], exclude: str | None) -> None:
        """Offer the jobs that have metrics to compare (not the shown one, not the never-started)."""
        choices = [(j["id"], f"{j.get('name') or j['id']} ({j['id']})") for j in jobs
                   if j["id"] != exclude and j.get("state") != "queued"]  # fmt: skip
        have = [(self.box.itemData(i), self.box.itemText(i)) for i in range(1, self.box.count())]
        if choices == have:
            return
        current = self.job_id
        self.box.blockSignals(True)
        self.box.clear()
        self.box.addItem("no other job", NONE)
        for job_id, text in choices:
            self.box.addItem(text, job_id)
        index = self.box.findData(current)
        self.box.setCurrentIndex(max(index, 0))
        self.box.blockSignals(False)
        if index < 0 and current:
            self.sig_compare_changed.emit(NONE)  # the compared job went away

    def set_job(self, job_id: str) -> bool:
        """Show `job_id` as chosen without announcing it (the caller acts on it); False if not offered."""
        index = self.box.findData(job_id or NONE)
        if index < 0:
            return False
        self.box.blockSignals(True)
        self.box.setCurrentIndex(index)
        self.box.blockSignals(False)
        return True
