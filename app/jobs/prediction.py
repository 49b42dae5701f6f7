"""The plan's predictions beside what the job measures: peak memory per GPU, tokens/s, step time.

Predictions come with the job record when a plan was attached at submission
(`predicted`, engine/jobs/submission.py); measurements from the job's own
metrics (`JobSeries.measured`), so they move while the job runs.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableWidget, QTableWidgetItem, QWidget

from rigpilot.app.widgets.units import NA, gib

ROWS = [
    ("peak_memory_bytes", "Peak memory per GPU"),
    ("tokens_per_s", "Tokens/s (whole job)"),
    ("step_time_s", "Step time"),
]
COLUMNS = ["Plan", "Measured", "Measured ÷ plan"]
# On a simulated machine the plan is for its GPUs and the job runs as CPU ranks: the columns say so.
SIMULATED_COLUMNS = ["Plan (for real GPUs)", "Measured (CPU ranks)", "CPU ÷ GPU plan"]
SIMULATED_NOTE = (
    "Simulated machine: the plan predicts the machine's real GPUs, and this job runs as CPU ranks in "
    "their place, so the measured figures are not expected to match the plan."
)


def measured_beside_plan(job: dict[str, Any], series: Any) -> dict[str, float | None]:
    """The measured column: the engine's steady speed and step time (the same figures the Summary and
    `rigpilot metrics` show), the peak memory from the job's own records; the series' where an older engine
    sends no steady figures."""
    measured = dict(series.measured())
    progress = job.get("progress") or job.get("measured") or {}
    for key, steady in (("tokens_per_s", "steady_tokens_per_s"), ("step_time_s", "steady_step_time_s")):
        v = progress.get(steady)
        if isinstance(v, int | float) and not isinstance(v, bool):
            measured[key] = float(v)
    return measured


def _format(key: str, value: float | None) -> str:
    if value is None:
        return NA
    if key == "peak_memory_bytes":
        return gib(value, 2)
    if key == "tokens_per_s":
        return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"
    if value >= 10:
        return f"{value:.1f} s"
    if value >= 0.1:
        return f"{value * 1000:.0f} ms"
    return f"{value * 1000:.3g} ms"  # a fast GPU's step: "0.41 ms", never "0 ms"


def _ratio(got: float | None, plan: float | None, simulated: bool) -> str:
    if not plan or got is None:
        return NA
    ratio = got / plan
    # Two decimals would say "0.01 ×" for a CPU rank against a GPU plan: small ratios keep two digits.
    text = f"{ratio:,.0f} ×" if ratio >= 100 else f"{ratio:.2f} ×" if ratio >= 0.1 else f"{ratio:.2g} ×"
    return f"{text} (CPU vs GPU)" if simulated else text


class PredictionTable(QTableWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(len(ROWS), len(COLUMNS), parent)
        self.setObjectName("predictionTable")
        self.setAccessibleName("Predicted versus measured")
        self.setHorizontalHeaderLabels(COLUMNS)
        self.setVerticalHeaderLabels([title for _, title in ROWS])
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.setTabKeyNavigation(False)
        self.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.setMaximumHeight(self.verticalHeader().length() + self.horizontalHeader().height() + 6)
        self.show_values(None, {})

    def show_values(
        self, predicted: dict[str, Any] | None, measured: dict[str, float | None], simulated: bool = False
    ) -> None:
        """`simulated`: the job's ranks run on the CPU in place of a simulated machine's GPUs."""
        headers = SIMULATED_COLUMNS if simulated else COLUMNS
        header = self.horizontalHeaderItem(0)
        if header is None or header.text() != headers[0]:
            self.setHorizontalHeaderLabels(headers)
        self.setToolTip(SIMULATED_NOTE if simulated else "")
        for row, (key, title) in enumerate(ROWS):
            plan = (predicted or {}).get(key)
            plan = float(plan) if isinstance(plan, int | float) and not isinstance(plan, bool) else None
            got = measured.get(key)
            ratio = _ratio(got, plan, simulated)
            cells = [_format(key, plan), _format(key, got), ratio]
            first: QTableWidgetItem | None = None
            for col, text in enumerate(cells):
                item = self.item(row, col)
                if item is None:
                    item = QTableWidgetItem()
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                    self.setItem(row, col, item)
                item.setText(text)
                if col == 0:
                    first = item
            if first is None:
                continue
            if predicted is None:
                first.setToolTip("No plan was attached to this job")
            elif simulated:
                first.setToolTip(f"{title} the planner predicted for real GPUs; {SIMULATED_NOTE}")
            else:
                first.setToolTip(f"{title} the planner predicted")

    def text(self, key: str, column: int) -> str:
        row = [k for k, _ in ROWS].index(key)
        item = self.item(row, column)
        return item.text() if item is not None else ""
