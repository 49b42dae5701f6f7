"""Why a job failed, where nobody can miss it: which rank, how it ended, its last log lines,
for out-of-memory the fix the planner suggests, and for a full disk how much room to free where.

The cause comes from the job record (`exit_reason`, `failed_rank`, `last_log`,
`error`), which the engine fills when the job ends; an out-of-memory error
record in the metrics shows here as soon as it arrives, before the job has ended.
"""

from __future__ import annotations

from html import escape
from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget

from rigpilot.app.widgets.icons import set_icon
from rigpilot.app.widgets.style import set_banner
from rigpilot.app.widgets.units import gib
from rigpilot.engine.diskspace import human_size
from rigpilot.engine.jobs.store import FAILED, INTERRUPTED

GENERIC_OOM_FIX = (
    "re-plan the job on the Planner page for this machine, or turn on activation checkpointing "
    "and halve the micro-batch"
)
# Byte counts an out-of-memory record may carry (engine/workers/__main__.py and older names).
OOM_NUMBERS = (
    ("allocated", "allocated"), ("allocated_bytes", "allocated"), ("reserved", "reserved"),
    ("reserved_bytes", "reserved"), ("tried_bytes", "tried to allocate"), ("total", "GPU total"),
    ("total_bytes", "GPU total"),
)  # fmt: skip


def oom_of(record: dict[str, Any], streamed: dict[str, Any] | None) -> dict[str, Any] | None:
    """The out-of-memory error of a job, from its record or, while it still runs, its metrics."""
    error = record.get("error")
    if isinstance(error, dict) and error.get("error") == "out_of_memory":
        return error
    return streamed


def disk_full_of(record: dict[str, Any]) -> dict[str, Any] | None:
    """The disk-full error of a job (a rank or the engine could not write), with its folder and byte counts."""
    error = record.get("error")
    return error if isinstance(error, dict) and error.get("error") == "disk_full" else None


def disk_full_fix(error: dict[str, Any]) -> str:
    """What to do about a full disk, worded from the error's fields."""
    needed, free = error.get("needed_bytes"), error.get("free_bytes")
    folder = error.get("folder") or "the job's folder"
    room = f"at least {human_size(needed)}" if isinstance(needed, int | float) else "room"
    had = f" ({human_size(free)} were free)" if isinstance(free, int | float) else ""
    return (
        f"free {room} on the disk of {folder}{had}, then resume the job: it continues from its last "
        "complete checkpoint"
    )


def suggested_fix(record: dict[str, Any], oom: dict[str, Any]) -> str:
    for source in (oom.get("predicted"), record.get("predicted")):
        if isinstance(source, dict) and source.get("suggestion"):
            return str(source["suggestion"])
    return GENERIC_OOM_FIX


class FailurePanel(QFrame):
    sig_show_log = Signal(int)  # the rank whose full log the user wants to read

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("failurePanel")
        set_banner(self, "bad")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.title = QLabel()
        self.title.setObjectName("failureTitle")
        self.title.setWordWrap(True)
        font = self.title.font()
        font.setBold(True)
        font.setPointSizeF(font.pointSizeF() * 1.25)
        self.title.setFont(font)
        self.reason = QLabel()
        self.reason.setObjectName("failureReason")
        self.reason.setWordWrap(True)
        self.fix = QLabel()
        self.fix.setObjectName("failureFix")
        self.fix.setWordWrap(True)
        self.last_log = QPlainTextEdit()
        self.last_log.setObjectName("failureLastLog")
        self.last_log.setAccessibleName("Last log lines of the failed rank")
        self.last_log.setReadOnly(True)
        self.last_log.setTabChangesFocus(True)
        self.last_log.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.last_log.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.last_log.setMaximumHeight(150)
        self.show_log = QPushButton("Open the full log")
        set_icon(self.show_log, "log")
        self.show_log.setObjectName("failureShowLog")
        self.show_log.clicked.connect(lambda: self.sig_show_log.emit(self._rank if self._rank is not None else -1))
        self._rank: int | None = None

        row = QHBoxLayout()
        row.addWidget(self.title, 1)
        row.addWidget(self.show_log)
        layout = QVBoxLayout(self)
        layout.addLayout(row)
        layout.addWidget(self.reason)
        layout.addWidget(self.fix)
        layout.addWidget(self.last_log)
        self.hide()

    def show_job(self, record: dict[str, Any], streamed_oom: dict[str, Any] | None = None) -> None:
        """Show the cause when the job failed or a rank ran out of memory; hide otherwise."""
        state = record.get("state")
        oom = oom_of(record, streamed_oom)
        if state not in (FAILED, INTERRUPTED) and oom is None:
            self.hide()
            return
        rank = record.get("failed_rank")
        if oom is not None and isinstance(oom.get("rank"), int):
            rank = oom["rank"]
        self._rank = rank if isinstance(rank, int) else None
        where = f" on rank {rank}" if isinstance(rank, int) else ""
        full = disk_full_of(record)
        if oom is not None:
            self.title.setText(f"Out of GPU memory{where}")
        elif full is not None:
            self.title.setText(f"Disk full{where}")
        elif state == INTERRUPTED:
            self.title.setText("Interrupted: the engine stopped while the job ran")
        else:
            self.title.setText(f"Failed{where}")
        self.reason.setText(self._reason(record, oom))
        if oom is not None or full is not None:
            fix = suggested_fix(record, oom) if oom is not None else disk_full_fix(full or {})
            self.fix.setText(f"<b>Suggested fix:</b> {escape(fix)}")
            self.fix.show()
        else:
            self.fix.hide()
        lines = [str(x) for x in record.get("last_log") or []]
        self.last_log.setPlainText("\n".join(lines))
        self.last_log.setVisible(bool(lines))
        self.show_log.setText(f"Open rank {rank}'s log" if isinstance(rank, int) else "Open the launcher's log")
        self.show()

    @staticmethod
    def _reason(record: dict[str, Any], oom: dict[str, Any] | None) -> str:
        if record.get("exit_reason"):
            return str(record["exit_reason"])
        if oom is None:
            return "No cause recorded; see the log."
        parts = [str(oom.get("message") or "CUDA out of memory")]
        for key, label in OOM_NUMBERS:
            if isinstance(oom.get(key), int | float):
                parts.append(f"{label} {gib(oom[key], 2)}")
        predicted = (record.get("predicted") or {}).get("peak_memory_bytes")
        if isinstance(predicted, int | float):
            parts.append(f"the plan predicted {gib(predicted, 2)} per GPU")
        return "; ".join(parts)
