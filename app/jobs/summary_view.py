"""A finished job's summary: its figures, a rising eval loss flagged, where the model went and how to load it;
and the table of settings that differ between compared runs."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import (
    QAbstractItemView,
    QApplication,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.jobs.energy_view import EnergySection
from rigpilot.app.jobs.outcome import eval_trend, load_snippets, model_of, output_of, settings_diff, summary_rows
from rigpilot.app.widgets.form_row import form_texts
from rigpilot.app.widgets.icons import set_icon
from rigpilot.app.widgets.style import set_banner


class SummaryPanel(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.heading = QLabel()
        self.heading.setObjectName("summaryHeading")
        self.heading.setWordWrap(True)
        self.warning = QLabel()
        self.warning.setObjectName("evalWarning")
        set_banner(self.warning, "warn")
        self.warning.setWordWrap(True)
        self.warning.hide()
        self.form = QFormLayout()
        self.form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        self.model_note = QLabel()
        self.model_note.setObjectName("modelNote")
        self.model_note.setWordWrap(True)
        self.snippets_box = QVBoxLayout()
        layout = QVBoxLayout(self)
        layout.addWidget(self.heading)
        layout.addWidget(self.warning)
        layout.addLayout(self.form)
        layout.addWidget(self.model_note)
        layout.addLayout(self.snippets_box)
        self.energy = EnergySection()
        layout.addWidget(self.energy)
        layout.addStretch(1)
        self.snippets: list[QPlainTextEdit] = []
        self._shown: Any = None

    def show_job(self, job: dict[str, Any], series: Any) -> None:
        key = (id(job), series.revision)
        if key == self._shown:
            return
        self._shown = key
        state = job.get("state") or ""
        self.heading.setText(f"<b>{job.get('kind') or 'job'} job {state}</b>" if state else "<b>No summary yet</b>")
        while self.form.rowCount():
            self.form.removeRow(0)
        for label, value in summary_rows(job, series):
            field = QLabel(value)
            field.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            field.setWordWrap(True)
            self.form.addRow(label, field)
        trend = eval_trend(*series.eval_loss())
        self.warning.setText(f"⚠ {trend}" if trend else "")
        self.warning.setVisible(bool(trend))
        choice = model_of(job)
        saved = output_of(job).get("folder")
        if job.get("kind") == "train" and choice.path != saved:  # the saved folder is a row already
            self.model_note.setText(
                f"Use {choice.what}: {choice.path}" if choice.path else f"No model to use: {choice.why}."
            )
        else:
            self.model_note.setText("")
        self._show_snippets(load_snippets(job) if job.get("kind") == "train" else [])
        self.energy.show_job(job)

    def _show_snippets(self, snippets: list[tuple[str, str]]) -> None:
        if [s.toPlainText() for s in self.snippets] == [code for _, code in snippets]:
            return
        while self.snippets_box.count():
            item = self.snippets_box.takeAt(0)
            widget = item.widget() if item is not None else None
            if widget is not None:
                widget.deleteLater()
        self.snippets = []
        mono = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
        for title, code in snippets:
            box = QWidget()
            head = QHBoxLayout()
            head.addWidget(QLabel(f"How to load it with <b>{title}</b>"))
            head.addStretch(1)
            copy = QPushButton("Copy")
            set_icon(copy, "copy")
            copy.setObjectName("copySnippet")
            copy.setToolTip(f"Copy the {title} snippet")
            head.addWidget(copy)
            text = QPlainTextEdit(code)
            text.setObjectName("loadSnippet")
            text.setReadOnly(True)
            text.setFont(mono)
            text.setMaximumHeight(text.fontMetrics().lineSpacing() * (code.count("\n") + 2) + 12)
            copy.clicked.connect(lambda _=False, c=code: QApplication.clipboard().setText(c))
            inner = QVBoxLayout(box)
            inner.setContentsMargins(0, 6, 0, 0)
            inner.addLayout(head)
            inner.addWidget(text)
            self.snippets_box.addWidget(box)
            self.snippets.append(text)

    def rows(self) -> dict[str, str]:
        return form_texts(self.form)


class SettingsDiff(QTableWidget):
    """Only the settings that differ between the shown job and the compared ones: one column per job."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("settingsDiff")
        self.setAccessibleName("Settings that differ between the compared runs")
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.setTabKeyNavigation(False)
        self.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.hide()

    def show_jobs(self, jobs: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
        if len(jobs) < 2:
            self.hide()
            return []
        diff = settings_diff(jobs)
        if not diff:
            diff = [("Settings", ["the same" for _ in jobs])]
        self.clear()
        self.setColumnCount(len(jobs))
        self.setRowCount(len(diff))
        self.setHorizontalHeaderLabels([f"{j.get('name') or j['id']} ({j['id']})" for j in jobs])
        self.setVerticalHeaderLabels([label for label, _ in diff])
        for r, (_, values) in enumerate(diff):
            for c, value in enumerate(values):
                item = QTableWidgetItem(value)
                item.setToolTip(value)
                self.setItem(r, c, item)
        self.setMaximumHeight(self.horizontalHeader().height() + self.verticalHeader().length() + 6)
        self.show()
        return diff
