"""The job list as a Qt table model, and how its cells read.

One row per job record (the engine's `Supervisor.view`), newest submission
first by default. Each column gives its text for display and a number or
string for sorting (SORT_ROLE), so "2 min" sorts before "1 h".
"""

from __future__ import annotations

import math
import time
from typing import Any

from PySide6.QtCore import QModelIndex, QSortFilterProxyModel, Qt
from PySide6.QtGui import QBrush, QPalette
from PySide6.QtWidgets import QApplication

from rigpilot.app.jobs.slurm_state import slurm_detail, slurm_state_text
from rigpilot.app.widgets.palette import BAD, GOOD, WARN, tint
from rigpilot.app.widgets.table_model import ColumnsModel, Index
from rigpilot.app.widgets.units import NA
from rigpilot.engine.jobs.store import COMPLETED, FAILED, INTERRUPTED, QUEUED, RUNNING, STARTING
from rigpilot.engine.schema import UNFINISHED_STATES, JobState

STATES = tuple(s.value for s in JobState)
ACTIVE = tuple(s.value for s in UNFINISHED_STATES)  # not ended yet
STATE_COLORS = {RUNNING: GOOD, STARTING: WARN, QUEUED: WARN, FAILED: BAD, INTERRUPTED: BAD}

COLUMNS = ["Job", "State", "Progress", "ETA", "GPUs", "Submitted"]
JOB, STATE, PROGRESS, ETA, GPUS, SUBMITTED = range(len(COLUMNS))
SORT_ROLE = Qt.ItemDataRole.UserRole
ID_ROLE = Qt.ItemDataRole.UserRole + 1
FRACTION_ROLE = Qt.ItemDataRole.UserRole + 2  # 0..1 or None, for the progress bar delegate



def duration(seconds: float | None) -> str:
    """'45 s', '12 min', '3 h 05 min', '2 d 4 h'; n/a when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return NA
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def gpus_text(gpus: list[int] | None) -> str:
    return ", ".join(str(g) for g in gpus) if gpus else "CPU"


def progress_of(job: dict[str, Any]) -> tuple[float | None, str]:
    """The fraction done (None when the job does not know its length) and how it reads."""
    p = job.get("progress") or {}
    fraction = p.get("fraction")
    step, max_steps = p.get("step"), p.get("max_steps")
    if job.get("state") == COMPLETED:
        fraction = 1.0 if fraction is None else fraction
    if isinstance(fraction, int | float):
        steps = f" ({step}/{max_steps})" if step is not None and max_steps else ""
        return float(fraction), f"{fraction * 100:.0f} %{steps}"
    if step is not None:
        return None, f"step {step}"
    if job.get("state") == STARTING and job.get("startup_phase"):
        return None, f"starting: {job['startup_phase']}…"  # launching, importing, loading weights, compiling, first step
    return None, NA if job.get("state") not in (QUEUED, STARTING) else ""


def eta_of(job: dict[str, Any]) -> float | None:
    if job.get("state") not in (STARTING, RUNNING):
        return None
    eta = (job.get("progress") or {}).get("eta_s")
    return float(eta) if isinstance(eta, int | float) else None


class JobListModel(ColumnsModel):
    columns = COLUMNS

    def __init__(self, parent: Any = None):
        super().__init__(parent)
        self._jobs: list[dict[str, Any]] = []
        self._rows: dict[str, int] = {}

    # -- contents -------------------------------------------------------------------------
    def set_jobs(self, jobs: list[dict[str, Any]]) -> None:
        self.beginResetModel()
        self._jobs = [dict(j) for j in jobs if j.get("id")]
        self._reindex()
        self.endResetModel()

    def upsert(self, job: dict[str, Any]) -> None:
        """Add a job or merge a newer record of it in (events may carry fewer fields than a full view)."""
        row = self._rows.get(job["id"])
        if row is None:
            self.beginInsertRows(QModelIndex(), len(self._jobs), len(self._jobs))
            self._jobs.append(dict(job))
            self._rows[job["id"]] = len(self._jobs) - 1
            self.endInsertRows()
            return
        self._jobs[row] = {**self._jobs[row], **job}
        self.dataChanged.emit(self.index(row, 0), self.index(row, len(COLUMNS) - 1))

    def remove(self, job_id: str) -> None:
        row = self._rows.get(job_id)
        if row is None:
            return
        self.beginRemoveRows(QModelIndex(), row, row)
        del self._jobs[row]
        self._reindex()
        self.endRemoveRows()

    def _reindex(self) -> None:
        self._rows = {j["id"]: i for i, j in enumerate(self._jobs)}

    def job(self, job_id: str) -> dict[str, Any] | None:
        row = self._rows.get(job_id)
        return self._jobs[row] if row is not None else None

    def jobs(self) -> list[dict[str, Any]]:
        return list(self._jobs)

    def row_of(self, job_id: str) -> int | None:
        return self._rows.get(job_id)

    # -- QAbstractTableModel ------------------------------------------------------------------
    def row_count(self) -> int:
        return len(self._jobs)

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        job = self._jobs[index.row()]
        col = index.column()
        if role == ID_ROLE:
            return job["id"]
        if role == Qt.ItemDataRole.DisplayRole:
            return self._text(job, col)
        if role == SORT_ROLE:
            return self._sort_key(job, col)
        if role == FRACTION_ROLE and col == PROGRESS:
            return progress_of(job)[0]
        if role == Qt.ItemDataRole.ToolTipRole:
            if col == STATE and job.get("exit_reason"):
                return job["exit_reason"]
            if col == STATE and job.get("slurm"):
                return slurm_detail(job)
            if col == JOB:
                return f"{job.get('name') or job['id']} — id {job['id']}"
        if role == Qt.ItemDataRole.BackgroundRole and col == STATE and job.get("state") in STATE_COLORS:
            return QBrush(tint(STATE_COLORS[job["state"]], QApplication.palette(), 0.3))
        if role == Qt.ItemDataRole.ForegroundRole and col == STATE and job.get("state") in STATE_COLORS:
            return QBrush(QApplication.palette().color(QPalette.ColorRole.Text))
        if role == Qt.ItemDataRole.TextAlignmentRole and col in (PROGRESS, ETA):
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        return None

    @staticmethod
    def _text(job: dict[str, Any], col: int) -> str:
        if col == JOB:
            return f"{job.get('name') or job['id']}  ({job['id']})"
        if col == STATE:
            state = job.get("state") or NA
            if state in ACTIVE and job.get("cancel_requested"):
                return f"{state} (cancelling)"
            restarted = len(job.get("restarts") or [])
            if restarted:
                state = f"{state} · restarted {restarted}×"
            if job.get("state") in ACTIVE and job.get("slurm"):
                return f"{state} · {slurm_state_text(job)}"
            return state
        if col == PROGRESS:
            return progress_of(job)[1]
        if col == ETA:
            eta = eta_of(job)
            return duration(eta) if eta is not None else ""
        if col == GPUS:
            return gpus_text(job.get("gpus"))
        created = job.get("created")
        if isinstance(created, int | float):
            return time.strftime("%Y-%m-%d %H:%M", time.localtime(created))
        return ""

    @staticmethod
    def _sort_key(job: dict[str, Any], col: int) -> Any:
        if col == JOB:
            return (job.get("name") or job["id"]).lower()
        if col == STATE:
            state = job.get("state")
            return STATES.index(state) if state in STATES else len(STATES)
        if col == PROGRESS:
            fraction = progress_of(job)[0]
            return -1.0 if fraction is None else fraction
        if col == ETA:
            eta = eta_of(job)
            return math.inf if eta is None else eta
        if col == GPUS:
            return tuple(job.get("gpus") or ())
        return float(job.get("created") or 0.0)


class JobFilterModel(QSortFilterProxyModel):
    """Shows the jobs whose state is in the chosen set (all when None); sorts by SORT_ROLE."""

    def __init__(self, parent: Any = None):
        super().__init__(parent)
        self._states: frozenset[str] | None = None
        self.setSortRole(SORT_ROLE)
        self.setDynamicSortFilter(True)

    @property
    def states(self) -> frozenset[str] | None:
        return self._states

    def set_states(self, states: frozenset[str] | set[str] | None) -> None:
        wanted = frozenset(states) if states is not None else None
        if not hasattr(self, "beginFilterChange"):  # Qt before 6.9
            self._states = wanted
            self.invalidateRowsFilter()
            return
        self.beginFilterChange()
        self._states = wanted
        self.endFilterChange(QSortFilterProxyModel.Direction.Rows)

    def filterAcceptsRow(self, source_row: int, source_parent: Index) -> bool:
        if self._states is None:
            return True
        index = self.sourceModel().index(source_row, STATE, source_parent)
        job = self.sourceModel().job(self.sourceModel().data(index, ID_ROLE))
        return job is not None and job.get("state") in self._states

    def lessThan(self, left: Index, right: Index) -> bool:
        a, b = left.data(SORT_ROLE), right.data(SORT_ROLE)
        try:
            return a < b
        except TypeError:
            return str(a) < str(b)
