"""The "Machine check" view: the last check of this machine's GPUs and links, and the button that runs one.

A header (when it was measured, whether the machine is simulated, the worst status), what the check found in
the words `describe` gives, a table per GPU and one per GPU pair. "Check this machine" asks the engine for a
check (`doctor_start`: a job of kind "doctor"); while it runs the view shows its progress and Cancel cancels
its job through the ordinary `cancel` request. Everything comes from a CheckSource (source.py) and the
pure functions of model.py.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QEvent, Qt, Signal
from PySide6.QtGui import QBrush
from PySide6.QtWidgets import (
    QAbstractItemView,
    QAbstractScrollArea,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.doctor.model import CheckState, finding_lines, headline, measured_line, progress_line, simulated_line
from rigpilot.app.doctor.source import CheckSource
from rigpilot.app.widgets.icons import set_icon
from rigpilot.app.widgets.palette import status_text
from rigpilot.app.widgets.style import STATUS_COLORS, heading, mark_primary, set_role, set_status
from rigpilot.engine.hardware.doctor_table import (
    GPU_COLUMNS,
    PAIR_COLUMNS,
    Cell,
    action_line,
    gpu_rows,
    group_lines,
    pair_rows,
)

STATUS_ROLE = Qt.ItemDataRole.UserRole + 1


def start_refusal(error: BaseException) -> str:
    """Why the engine would not start a check, in one line (by its reason, never its sentence)."""
    reason, fields = getattr(error, "reason", None), getattr(error, "fields", None) or {}
    if reason == "doctor_running":
        return f"A machine check is already running (job {fields.get('job', '?')})."
    if reason == "doctor_imported_machine":
        return "The engine serves an imported machine, a description rather than this computer: nothing to check."
    if reason == "doctor_no_gpus":
        return "This machine has no GPUs to check."
    return f"Could not start the machine check: {error}"


def _label(name: str, *, wrap: bool = True) -> QLabel:
    label = QLabel()
    label.setObjectName(name)
    label.setWordWrap(wrap)
    label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    return label


class CheckTable(QTableWidget):
    """A read-only table of Cells, as tall as its rows (the page around it scrolls), coloured by status."""

    def __init__(self, name: str, columns: list[str], parent: QWidget | None = None):
        super().__init__(0, len(columns), parent)
        self.setObjectName(name)
        self.setHorizontalHeaderLabels(columns)
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.setTabKeyNavigation(False)
        self.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.verticalHeader().hide()
        header = self.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setStretchLastSection(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizeAdjustPolicy(QAbstractScrollArea.SizeAdjustPolicy.AdjustToContents)

    def show_rows(self, rows: list[list[Cell]]) -> None:
        self.setRowCount(len(rows))
        for r, row in enumerate(rows):
            for c, cell in enumerate(row):
                item = QTableWidgetItem(cell.text)
                item.setToolTip(cell.tooltip)
                item.setData(STATUS_ROLE, cell.status)
                self.setItem(r, c, item)
        self._colour()

    def cell_text(self, row: int, column: int) -> str:
        item = self.item(row, column)
        return item.text() if item is not None else ""

    def cell_status(self, row: int, column: int) -> str | None:
        item = self.item(row, column)
        return item.data(STATUS_ROLE) if item is not None else None

    def _colour(self) -> None:
        pal = self.palette()
        for r in range(self.rowCount()):
            for c in range(self.columnCount()):
                item = self.item(r, c)
                status = item.data(STATUS_ROLE) if item is not None else None
                if item is not None:
                    color = STATUS_COLORS.get(status) if status else None
                    item.setForeground(QBrush(status_text(color, pal)) if color is not None else QBrush())
                    font = item.font()
                    font.setBold(status == "bad")
                    item.setFont(font)

    def changeEvent(self, event: QEvent) -> None:
        super().changeEvent(event)
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange):
            self._colour()


class MachineCheckView(QWidget):
    sig_started = Signal(dict)  # the doctor job doctor_start submitted
    sig_shown = Signal(object)  # the CheckState now shown
    sig_message = Signal(str)  # a line for the user: a refusal, a cancel that failed

    def __init__(self, link: Any, parent: QWidget | None = None, *, source: CheckSource | None = None):
        super().__init__(parent)
        self.setObjectName("machineCheck")
        self.link = link
        self.source = source or CheckSource(link, self, follow_progress=True)

        self.headline = _label("checkHeadline")
        font = self.headline.font()
        font.setBold(True)
        self.headline.setFont(font)
        self.check_button = QPushButton("Check this machine")
        self.check_button.setObjectName("checkMachine")
        set_icon(self.check_button, "check-machine")
        mark_primary(self.check_button)
        self.check_button.setToolTip(
            "Measure each GPU and each pair's link (a job of a minute or so on a real machine); where peer-to-peer "
            "copies are broken or slow, jobs on those GPUs then run with NCCL_P2P_DISABLE=1"
        )
        self.check_button.clicked.connect(self.start_check)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setObjectName("cancelCheck")
        set_icon(self.cancel_button, "cancel")
        self.cancel_button.clicked.connect(self.cancel_check)
        self.cancel_button.hide()
        head = QHBoxLayout()
        head.addWidget(self.headline, 1)
        head.addWidget(self.cancel_button)
        head.addWidget(self.check_button)

        self.measured = _label("checkMeasured")
        set_role(self.measured, "muted")
        self.simulated = _label("checkSimulated")
        set_status(self.simulated, "warn")
        self.progress = _label("checkProgress")
        set_status(self.progress, "info")
        self.message = _label("checkMessage")
        set_status(self.message, "bad")
        self.message.hide()  # until the engine refuses or fails something asked here
        self.findings_box = QWidget()
        self.findings_box.setObjectName("checkFindings")
        self.findings_layout = QVBoxLayout(self.findings_box)
        self.findings_layout.setContentsMargins(0, 0, 0, 0)
        self.findings_layout.setSpacing(2)
        self.finding_labels: list[QLabel] = []
        self.action = _label("checkAction")
        self.gpu_title = heading("Per GPU")
        self.gpu_table = CheckTable("checkGpus", GPU_COLUMNS)
        self.gpu_table.setAccessibleName("Machine check per GPU")
        self.pair_title = heading("Per GPU pair")
        self.pair_table = CheckTable("checkPairs", PAIR_COLUMNS)
        self.pair_table.setAccessibleName("Machine check per GPU pair")
        self.groups = _label("checkGroups")

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(head)
        for w in (self.measured, self.simulated, self.progress, self.message, self.findings_box, self.action,
                  self.gpu_title, self.gpu_table, self.pair_title, self.pair_table, self.groups):  # fmt: skip
            layout.addWidget(w)

        self.source.sig_changed.connect(self.show_state)
        self.source.sig_progress.connect(self._show_progress)
        self.show_state(self.source.state if self.source.loaded else None)

    # -- showing ------------------------------------------------------------------------------------
    def show_state(self, state: CheckState | None) -> None:
        if state is None:  # no answer yet
            self.headline.setText("Asking the engine for the last machine check…")
            set_status(self.headline, None)
            self._show_report(None)
            self._show_running(None)
            return
        status, line = headline(state)
        self.headline.setText(line)
        set_status(self.headline, status)  # type: ignore[arg-type]
        self._show_report(state)
        self._show_running(state.running)
        self.sig_shown.emit(state)

    def _show_report(self, state: CheckState | None) -> None:
        report = state.report if state is not None else None
        has = report is not None
        for w in (self.gpu_title, self.gpu_table, self.pair_title, self.pair_table):
            w.setVisible(has)
        for label in self.finding_labels:
            self.findings_layout.removeWidget(label)
            label.deleteLater()
        self.finding_labels = []
        if report is None:
            self.measured.setVisible(state is not None and state.why == "driver_changed")
            self.measured.setText("A check made on another driver does not stand for this one.")
            for w in (self.simulated, self.action, self.groups):
                w.hide()
            return
        self.measured.setText(measured_line(report))
        self.measured.show()
        self.simulated.setText(simulated_line(report))
        self.simulated.setVisible(report.simulated)
        lines = finding_lines(report) or [("good", "Found nothing wrong.")]
        for status, words in lines:
            label = _label("checkFinding")
            label.setText(f"{'✗' if status == 'bad' else '!' if status == 'warn' else '·'} {words}")
            set_status(label, status)  # type: ignore[arg-type]
            self.findings_layout.addWidget(label)
            self.finding_labels.append(label)
        self.action.setText(action_line(report))
        self.action.setVisible(bool(self.action.text()))
        self.gpu_table.show_rows(gpu_rows(report))
        self.pair_table.show_rows(pair_rows(report))
        self.pair_title.setVisible(bool(report.pairs))
        self.pair_table.setVisible(bool(report.pairs))
        groups = group_lines(report)
        self.groups.setText("\n".join(text for _, text in groups))
        set_status(self.groups, "bad" if any(s == "bad" for s, _ in groups) else None)
        self.groups.setVisible(bool(groups))

    def _show_running(self, job_id: str | None) -> None:
        running = job_id is not None
        self.check_button.setVisible(not running)
        self.check_button.setEnabled(True)
        self.cancel_button.setVisible(running)
        self.cancel_button.setEnabled(running)
        self.progress.setVisible(running)
        if running:
            self._show_progress()

    def _show_progress(self) -> None:
        if self.source.state.running is not None:
            self.progress.setText(progress_line(self.source.job, self.source.status))

    # -- actions ----------------------------------------------------------------------------------
    def start_check(self) -> None:
        self.check_button.setEnabled(False)
        self.message.hide()
        self.progress.setText(progress_line(None))
        self.progress.show()
        self.link.call("doctor_start", on_done=self._on_started, on_error=self._on_start_refused)

    def _on_started(self, reply: dict[str, Any]) -> None:
        job = reply.get("job") if isinstance(reply, dict) else None
        if not isinstance(job, dict) or not job.get("id"):
            self._on_start_refused(ValueError("the engine's answer names no job"))
            return
        job = {**job, "kind": job.get("kind") or "doctor"}
        self.source.started(job)
        self.sig_started.emit(job)

    def _on_start_refused(self, error: BaseException) -> None:
        self.check_button.setEnabled(True)
        self.progress.setVisible(self.source.state.running is not None)
        self._say(start_refusal(error))
        if getattr(error, "reason", None) == "doctor_running":
            self.source.refresh()  # show the one that runs, with its Cancel

    def cancel_check(self) -> None:
        job_id = self.source.state.running
        if job_id is None:
            return
        self.cancel_button.setEnabled(False)
        self.link.call("cancel", job=job_id, on_done=self._on_cancelled, on_error=self._on_cancel_failed)

    def _on_cancelled(self, reply: dict[str, Any]) -> None:
        job = reply.get("job") if isinstance(reply, dict) else None
        if isinstance(job, dict):
            self.source.on_job({**job, "kind": job.get("kind") or "doctor"})

    def _on_cancel_failed(self, error: BaseException) -> None:
        self.cancel_button.setEnabled(True)
        self._say(f"Could not cancel the machine check: {error}")

    def _say(self, line: str) -> None:
        self.message.setText(line)
        self.message.show()
        self.sig_message.emit(line)
