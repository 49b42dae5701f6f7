"""An inference job's prompts and completions: a table to read, copy (Ctrl+C: the selected rows) and export.

The completions come from the engine's `results` request (engine/jobs/results.py), paged;
above them the job's generated tokens/s and the peak memory each rank reached.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QAbstractItemView,
    QApplication,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.jobs.outcome import backend_of
from rigpilot.app.widgets.icons import set_icon
from rigpilot.app.widgets.table_model import ColumnsModel, Index
from rigpilot.app.widgets.units import NA, gib, si

COLUMNS = ["#", "Prompt", "Completion", "New tokens"]
MAX_ROWS = 10_000  # a results file past this is read from its file; the table would not be read anyway
FIT_ROWS = 500  # rows sized to their text; past this, one line each (the tooltip has the rest)


class CompletionsModel(ColumnsModel):
    columns = COLUMNS

    def __init__(self, parent: Any = None):
        super().__init__(parent)
        self.rows: list[dict[str, Any]] = []

    def set_rows(self, rows: list[dict[str, Any]]) -> None:
        self.beginResetModel()
        self.rows = list(rows)
        self.endResetModel()

    def row_count(self) -> int:
        return len(self.rows)

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        row = self.rows[index.row()]
        if role in (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.ToolTipRole):
            return cells(row)[index.column()]
        if role == Qt.ItemDataRole.TextAlignmentRole and index.column() in (0, 3):
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignTop)
        if role == Qt.ItemDataRole.TextAlignmentRole:
            return int(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)
        return None


def cells(row: dict[str, Any]) -> list[str]:
    tokens = row.get("new_tokens")
    return [str(int(row.get("index", 0)) + 1), row.get("prompt", ""), row.get("completion", ""),
            "" if tokens is None else str(tokens)]  # fmt: skip


def as_tsv(rows: list[dict[str, Any]]) -> str:
    """Rows as tab-separated text with a header, the way spreadsheets paste it (fields quoted as needed)."""
    buf = io.StringIO()
    w = csv.writer(buf, delimiter="\t", lineterminator="\n")
    w.writerow(COLUMNS)
    w.writerows(cells(r) for r in rows)
    return buf.getvalue()


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["index", "prompt", "completion", "new_tokens"])
        for r in rows:
            w.writerow([r.get("index"), r.get("prompt", ""), r.get("completion", ""), r.get("new_tokens")])


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            keys = ("index", "prompt", "completion", "new_tokens")
            f.write(json.dumps({k: r.get(k) for k in keys}, ensure_ascii=False) + "\n")


def speed_line(job: dict[str, Any]) -> str:
    """Generated tokens/s and the peak memory of each rank (its GPU), from the job's progress."""
    progress = job.get("progress") or job.get("measured") or {}
    gpus = list(job.get("gpus") or [])
    parts = [f"Generated {si(progress.get('tokens_per_s'), 'tokens/s')}"]
    peaks = progress.get("peak_memory_by_rank") or {}
    where = "CPU rank" if job.get("simulated") else "GPU"
    mem = []
    for rank, value in sorted(peaks.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0):
        r = int(rank) if str(rank).isdigit() else 0
        name = f"{where} {gpus[r]}" if r < len(gpus) else f"rank {rank}"
        mem.append(f"{name} {gib(value, 2)}")
    parts.append("peak memory: " + (", ".join(mem) if mem else NA))
    if job.get("simulated"):
        parts.append("simulated machine: CPU ranks stand in for the GPUs")
    return " · ".join(parts)


class ResultsView(QWidget):
    sig_message = Signal(str)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.link: Any = None
        self.job_id: str | None = None
        self._serial = 0
        self._loaded: list[dict[str, Any]] = []
        self._asked = False  # completions are asked for once per job, when it has completed
        self.speed = QLabel()
        self.speed.setObjectName("inferSpeed")
        self.speed.setWordWrap(True)
        self.speed.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.backend = QLabel()  # which generator ran and why: inference jobs have no Summary tab
        self.backend.setObjectName("inferBackend")
        self.backend.setWordWrap(True)
        self.backend.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.status = QLabel()
        self.status.setObjectName("resultsStatus")
        self.status.setWordWrap(True)
        self.model = CompletionsModel(self)
        self.table = QTableView()
        self.table.setObjectName("completionsTable")
        self.table.setAccessibleName("Prompts and completions")
        self.table.setModel(self.model)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setWordWrap(True)
        self.table.setTabKeyNavigation(False)
        self.table.verticalHeader().hide()
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        header.setSectionResizeMode(2, QHeaderView.ResizeMode.Stretch)
        header.setSectionResizeMode(3, QHeaderView.ResizeMode.ResizeToContents)
        copy = QShortcut(QKeySequence.StandardKey.Copy, self.table, self.copy_selection)
        copy.setContext(Qt.ShortcutContext.WidgetShortcut)
        self.copy_button = QPushButton("&Copy rows")
        set_icon(self.copy_button, "copy")
        self.copy_button.setObjectName("copyCompletions")
        self.copy_button.setToolTip("Copy the selected rows (all rows when none is selected) as tab-separated text")
        self.copy_button.clicked.connect(lambda: self.copy_selection(all_if_none=True))
        self.csv_button = QPushButton("Export C&SV…")
        set_icon(self.csv_button, "export")
        self.csv_button.setObjectName("exportCsv")
        self.csv_button.clicked.connect(lambda: self.export("csv"))
        self.jsonl_button = QPushButton("Export &JSONL…")
        set_icon(self.jsonl_button, "export")
        self.jsonl_button.setObjectName("exportJsonl")
        self.jsonl_button.clicked.connect(lambda: self.export("jsonl"))
        buttons = QHBoxLayout()
        buttons.addWidget(self.speed, 1)
        for b in (self.copy_button, self.csv_button, self.jsonl_button):
            buttons.addWidget(b)
        layout = QVBoxLayout(self)
        layout.addLayout(buttons)
        layout.addWidget(self.backend)
        layout.addWidget(self.status)
        layout.addWidget(self.table, 1)
        self._set_buttons()

    # -- contents ---------------------------------------------------------------------------------
    def show_job(self, link: Any, job: dict[str, Any]) -> None:
        """Show `job`'s speed and, once it completed, its completions (asked once per job)."""
        self.speed.setText(speed_line(job))
        backend = backend_of(job)
        self.backend.setText(f"Backend: {backend}" if backend else "")
        self.backend.setVisible(bool(backend))
        job_id = job.get("id")
        if job_id != self.job_id:
            self.job_id = job_id
            self.link = link
            self._loaded = []
            self._asked = False
            self._serial += 1
            self.model.set_rows([])
            self.status.setText("")
            self._set_buttons()
        if job.get("state") != "completed":
            if not self.model.rows:
                self.status.setText("Completions appear here when the job has finished generating.")
            return
        if not self._asked:
            self.load()

    def load(self) -> None:
        """Ask the engine for the completions, page by page."""
        if self.link is None or self.job_id is None:
            return
        self._serial += 1
        self._loaded = []
        self._asked = True
        self.status.setText("Loading completions…")
        self._ask(self._serial, 0)

    def _ask(self, serial: int, start: int) -> None:
        job_id = self.job_id

        def done(reply: dict[str, Any]) -> None:
            if serial != self._serial or job_id != self.job_id:
                return
            self._loaded += reply.get("results") or []
            more = bool(reply.get("more")) and bool(reply.get("results"))
            if more and len(self._loaded) < MAX_ROWS:
                self._ask(serial, len(self._loaded))
                return
            self.model.set_rows(self._loaded)
            if len(self._loaded) <= FIT_ROWS:  # measuring every wrapped row of a long file would stall the GUI
                self.table.resizeRowsToContents()
            n = len(self._loaded)
            where = reply.get("path") or "the job's output folder"
            self.status.setText(
                f"{n} completion{'s' if n != 1 else ''}" + (f"; the rest are in {where}" if more else f" · {where}")
            )
            self._set_buttons()

        def failed(error: BaseException) -> None:
            if serial == self._serial and job_id == self.job_id:
                self.status.setText(f"No completions to show: {error}")

        self.link.call("results", job=job_id, start=start, on_done=done, on_error=failed)

    def _set_buttons(self) -> None:
        has = bool(self.model.rows)
        for b in (self.copy_button, self.csv_button, self.jsonl_button):
            b.setEnabled(has)

    # -- copy and export ------------------------------------------------------------------------------
    def selected_rows(self) -> list[dict[str, Any]]:
        rows = sorted({i.row() for i in self.table.selectionModel().selectedRows()})
        return [self.model.rows[r] for r in rows]

    def copy_selection(self, all_if_none: bool = False) -> str:
        rows = self.selected_rows() or (self.model.rows if all_if_none else [])
        if not rows:
            return ""
        text = as_tsv(rows)
        QApplication.clipboard().setText(text)
        return text

    def export(self, fmt: str, path: str | None = None) -> Path | None:
        if not self.model.rows:
            return None
        if path is None:
            suggested = f"completions-{self.job_id}.{fmt}"
            path, _ = QFileDialog.getSaveFileName(
                self, "Export completions", suggested, "CSV (*.csv)" if fmt == "csv" else "JSON lines (*.jsonl)"
            )
            if not path:
                return None
        target = Path(path)
        try:
            (write_csv if fmt == "csv" else write_jsonl)(target, self.model.rows)
        except OSError as e:
            self.sig_message.emit(f"Could not write {target}: {e.strerror or e}")
            return None
        self.status.setText(f"{len(self.model.rows)} completions written to {target}")
        return target
