"""'How does this scale?': a finished training job's scaling study, started, followed, drawn and exported.

The engine runs the study (engine.jobs.scaling: one planned job per GPU count) and computes its table;
this panel only asks for it, polls it while it runs, and shows the engine's rows with the engine's own
formatting (`scaling_table.cells`), so the app and `rigpilot scaling` never disagree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyqtgraph as pg
import pyqtgraph.exporters
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QWheelEvent
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.widgets.icons import set_icon
from rigpilot.app.widgets.palette import WARN, apply_plot_theme, series_color, tint
from rigpilot.app.widgets.style import mark_primary
from rigpilot.engine.errors import UserError
from rigpilot.engine.jobs import scaling_table
from rigpilot.engine.jobs.scaling_table import ACTIVE

POLL_MS = 1000
START_TIP = ("Run this job's training again for a few steps on each GPU count, one after another, "
             "and compare the measured speed-up with linear and with the planner's prediction")  # fmt: skip


def default_counts(gpus: int) -> list[int]:
    return [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= max(gpus, 1)]


class StillPlot(pg.PlotWidget):
    """A chart inside a page that scrolls: the wheel scrolls the page and never zooms the axes (a user scrolling
    down over the chart once zoomed it out to −6000 … 3800), and dragging does not pan them."""

    def __init__(self) -> None:
        super().__init__()
        self.setMouseEnabled(x=False, y=False)
        self.setMenuEnabled(False)
        self.hideButtons()

    def wheelEvent(self, event: QWheelEvent) -> None:
        event.ignore()  # to the scroll area around the page


class ScalingPanel(QWidget):
    sig_study = Signal(dict)  # each new view of the study, after it is drawn

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.link: Any = None
        self.job_id: str | None = None
        self.study: dict[str, Any] | None = None
        head = QLabel("<b>Scaling</b>: the same training on 1, 2, 4 … GPUs, against linear and against the plan")
        head.setWordWrap(True)
        self.counts = QLineEdit()
        self.counts.setObjectName("scaleCounts")
        self.counts.setAccessibleName("GPU counts to measure")
        self.counts.setToolTip("GPU counts to measure, e.g. 1,2,4 (GPUs 0 … n-1 each)")
        self.counts.setMaximumWidth(120)
        self.start_button = QPushButton("How does this scale?")
        set_icon(self.start_button, "scale")
        mark_primary(self.start_button)
        self.start_button.setObjectName("scaleButton")
        self.start_button.setToolTip(START_TIP)
        self.start_button.clicked.connect(self.start)
        self.cancel_button = QPushButton("Cancel study")
        set_icon(self.cancel_button, "cancel")
        self.cancel_button.setObjectName("scaleCancel")
        self.cancel_button.setToolTip("Cancel the study's jobs that have not ended; the GPU counts measured so far stay")
        self.cancel_button.clicked.connect(self.cancel)
        self.cancel_button.hide()
        row = QHBoxLayout()
        row.addWidget(self.start_button)
        row.addWidget(QLabel("GPUs:"))
        row.addWidget(self.counts)
        row.addWidget(self.cancel_button)
        row.addStretch(1)
        self.progress = QLabel()
        self.progress.setObjectName("scaleProgress")
        self.progress.setWordWrap(True)
        self.progress.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.table = QTableWidget()
        self.table.setObjectName("scaleTable")
        self.table.setAccessibleName("Scaling study: measured and predicted throughput per GPU count")
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setTabKeyNavigation(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.verticalHeader().hide()
        self.table.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.chart = StillPlot()
        self.chart.setObjectName("scaleChart")
        apply_plot_theme(self.chart, self.palette())
        self.chart.setMinimumHeight(220)
        self.chart.setLabel("bottom", "GPUs")
        self.chart.setLabel("left", "speed-up")
        self.chart.addLegend(offset=(10, 10))
        self.curves = {
            "measured": self.chart.plot(name="measured", pen=pg.mkPen(series_color(0), width=2), symbol="o",
                                        symbolBrush=series_color(0)),
            "linear": self.chart.plot(name="linear", pen=pg.mkPen(series_color(7), width=1, style=Qt.PenStyle.DashLine)),
            "predicted": self.chart.plot(name="predicted", pen=pg.mkPen(series_color(2), width=2), symbol="t",
                                         symbolBrush=series_color(2)),
            # Points whose measurement is noise: shown where they fell, hollow and unjoined, not as a result.
            "noise": self.chart.plot(name="noise (not a result)", pen=None, symbol="o", symbolSize=9,
                                     symbolPen=pg.mkPen(WARN, width=2), symbolBrush=None),
        }  # fmt: skip
        # The measured speed-ups in words, with the link the plan says they wait on (engine.jobs.scaling_words).
        self.words = QLabel()
        self.words.setObjectName("scaleWords")
        self.words.setWordWrap(True)
        self.words.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.notes = QLabel()
        self.notes.setObjectName("scaleNotes")
        self.notes.setWordWrap(True)
        self.png_button = QPushButton("Save chart as PNG…")
        set_icon(self.png_button, "image")
        self.png_button.setObjectName("scalePng")
        self.png_button.clicked.connect(lambda: self._save("PNG image (*.png)", ".png", self.export_png))
        self.csv_button = QPushButton("Save table as CSV…")
        set_icon(self.csv_button, "export")
        self.csv_button.setObjectName("scaleCsv")
        self.csv_button.clicked.connect(lambda: self._save("CSV (*.csv)", ".csv", self.export_csv))
        exports = QHBoxLayout()
        exports.addWidget(self.png_button)
        exports.addWidget(self.csv_button)
        exports.addStretch(1)
        self.results = QWidget()
        inner = QVBoxLayout(self.results)
        inner.setContentsMargins(0, 0, 0, 0)
        inner.addWidget(self.table)
        inner.addWidget(self.chart)
        inner.addWidget(self.words)
        inner.addWidget(self.notes)
        inner.addLayout(exports)
        self.results.hide()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 8, 0, 0)
        layout.addWidget(head)
        layout.addLayout(row)
        layout.addWidget(self.progress)
        layout.addWidget(self.results)
        self._timer = QTimer(self)
        self._timer.setInterval(POLL_MS)
        self._timer.timeout.connect(self._poll)

    # -- the job shown --------------------------------------------------------------------------------------

    def show_job(self, link: Any, job: dict[str, Any]) -> None:
        """A finished training job can be studied; its newest study so far is shown."""
        studiable = job.get("kind") == "train" and job.get("state") == "completed" and not job.get("study")
        self.setVisible(studiable)
        if not studiable or (link is self.link and job.get("id") == self.job_id):
            return
        self.link, self.job_id, self.study = link, job.get("id"), None
        self._timer.stop()
        self.results.hide()
        self.progress.setText("")
        gpus = len((getattr(link, "machine", None) or {}).get("gpus") or []) or 1
        self.counts.setText(",".join(str(n) for n in default_counts(gpus)))
        self.start_button.setEnabled(True)
        link.call("scaling_studies", job=self.job_id, on_done=self._past, on_error=lambda e: None)

    def _past(self, reply: dict[str, Any]) -> None:
        studies = reply.get("studies") or []
        if studies and self.study is None and studies[0].get("from_job") == self.job_id:
            self.show_study(studies[0])

    # -- a study --------------------------------------------------------------------------------------------

    def start(self) -> None:
        try:
            counts = scaling_table.parse_counts(self.counts.text())
        except UserError as e:
            self.progress.setText(str(e))
            return
        self.start_button.setEnabled(False)
        self.progress.setText("Planning each GPU count and submitting the study's jobs…")
        self.link.call("scaling_start", job=self.job_id, gpus=counts, on_done=self._started, on_error=self._failed)

    def cancel(self) -> None:
        if self.study is None or self.link is None:
            return
        self.cancel_button.setEnabled(False)
        self.progress.setText("Cancelling the study's jobs…")
        self.link.call("scaling_cancel", study=self.study["id"], on_done=lambda r: self.show_study(r["study"]),
                       on_error=self._cancel_failed)  # fmt: skip

    def _cancel_failed(self, error: BaseException) -> None:
        self.cancel_button.setEnabled(True)
        self.progress.setText(f"The study could not be cancelled: {error}")

    def _started(self, reply: dict[str, Any]) -> None:
        self.show_study(reply["study"])

    def _failed(self, error: BaseException) -> None:
        fields = getattr(error, "fields", None) or {}
        if getattr(error, "reason", None) == "study_running" and fields.get("study"):
            # Started from another window or the terminal: follow that one instead.
            self.progress.setText(f"Study {fields['study']} of this job is still running; it is shown below.")
            self.link.call("scaling_study", study=fields["study"], on_done=lambda r: self.show_study(r["study"]),
                           on_error=lambda e: None)  # fmt: skip
            return
        self.start_button.setEnabled(True)
        self.progress.setText(f"The study could not start: {error}")
        # A reply lost on the way (the engine busy, the connection cut) may hide a study that did start.
        self.link.call("scaling_studies", job=self.job_id, on_done=self._past, on_error=lambda e: None)

    def _poll(self) -> None:
        if self.study is not None and self.link is not None:
            self.link.call("scaling_study", study=self.study["id"], on_done=lambda r: self.show_study(r["study"]),
                           on_error=lambda e: self.progress.setText(f"Lost the study: {e}"))  # fmt: skip

    def show_study(self, study: dict[str, Any]) -> None:
        self.study = study
        active = study.get("state") in ACTIVE
        self.start_button.setEnabled(not active)
        self.start_button.setToolTip(
            f"Study {study.get('id')} of this job is still {study.get('state')}: wait for it, or cancel it to start "
            "another" if active else START_TIP
        )
        self.cancel_button.setVisible(active)
        self.cancel_button.setEnabled(active)
        if active:
            self._timer.start()
        else:
            self._timer.stop()
        self.progress.setText(progress_text(study))
        if not study.get("points"):  # planning, or refused before any job: nothing to tabulate yet
            self.results.hide()
            self.sig_study.emit(study)
            return
        self._fill_table(study)
        self._draw(study)
        said = study.get("words") or []
        self.words.setText("\n".join(said))
        self.words.setVisible(bool(said))
        self.notes.setText("\n".join(f"• {n}" for n in study.get("notes") or []))
        self.results.show()
        self.sig_study.emit(study)

    def _fill_table(self, study: dict[str, Any]) -> None:
        heads = scaling_table.headers(study)
        rows = [scaling_table.cells(r) for r in study.get("table") or []]
        self.table.clear()
        self.table.setColumnCount(len(heads))
        self.table.setRowCount(len(rows))
        self.table.setHorizontalHeaderLabels(heads)
        table = study.get("table") or []
        for r, values in enumerate(rows):
            noise = table[r].get("noise")
            for c, value in enumerate(values):
                item = QTableWidgetItem(value)
                if c >= 4:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                if noise:
                    item.setBackground(tint(WARN, self.palette()))
                    item.setToolTip(f"Noise, not a result: {noise}")
                self.table.setItem(r, c, item)
        self.table.resizeRowsToContents()
        # Every row shown, no scroll bar: a study has a handful of points.
        rows_height = sum(self.table.rowHeight(r) for r in range(self.table.rowCount()))
        head = self.table.horizontalHeader().sizeHint().height()
        self.table.setFixedHeight(head + rows_height + 2 * self.table.frameWidth() + 2)

    def _draw(self, study: dict[str, Any]) -> None:
        series = chart_series(study)
        # Both axes from 0, wide enough for every result: autorange of one or two points drew nonsense. A noise
        # point far off the scale (18× linear) sits on the top edge rather than squash the results flat.
        xs = [x for xs_, _ in series.values() for x in xs_] or [1]
        top = max([y for name, (_, ys) in series.items() if name != "noise" for y in ys] or [1]) * 1.15
        xs_noise, ys_noise = series["noise"]
        series["noise"] = (xs_noise, [min(y, top) for y in ys_noise])
        for name, (x, y) in series.items():
            self.curves[name].setData(x, y)
        self.chart.getPlotItem().disableAutoRange()
        self.chart.setXRange(0, max(xs) * 1.1 + 0.2, padding=0)
        self.chart.setYRange(0, top, padding=0)
        base = (study.get("points") or [{}])[0].get("gpus", 1)
        title = f"Speed-up against {base} GPU{'s' * (base != 1)}"
        self.chart.setTitle(
            title + (": measured on CPU ranks, predicted for real GPUs" if study.get("simulated") else "")
        )
        counts = [p["gpus"] for p in study.get("points") or []]
        self.chart.getAxis("bottom").setTicks([[(n, str(n)) for n in counts]])

    def table_cells(self) -> list[list[str]]:
        return [
            [item.text() if (item := self.table.item(r, c)) is not None else "" for c in range(self.table.columnCount())]
            for r in range(self.table.rowCount())
        ]

    # -- export ---------------------------------------------------------------------------------------------

    def _save(self, filter_: str, suffix: str, write: Any) -> None:
        if self.study is None:
            return
        path, _ = QFileDialog.getSaveFileName(
            self, "Save the scaling study", f"scaling-{self.study['id']}{suffix}", filter_
        )
        if path:
            write(path)

    def export_png(self, path: str | Path) -> None:
        try:
            pg.exporters.ImageExporter(self.chart.getPlotItem()).export(str(path))
        except Exception as e:  # a bad folder or a full disk is told, not raised
            self.progress.setText(f"Could not save {path}: {e}")
            return
        self.progress.setText(f"Chart saved to {path}")

    def export_csv(self, path: str | Path) -> None:
        if self.study is None:
            return
        try:
            Path(path).write_text(scaling_table.to_csv(self.study))
        except OSError as e:
            self.progress.setText(f"Could not save {path}: {e.strerror or e}")
            return
        self.progress.setText(f"Table saved to {path}")


def progress_text(study: dict[str, Any]) -> str:
    points = study.get("points") or []
    done = sum(p.get("state") == "completed" for p in points)
    where = "on CPU ranks (simulated machine)" if study.get("simulated") else ""
    state = study.get("state")
    if state == "planning":
        counts = study.get("counts") or []
        return (f"Study {study['id']}: planning GPU counts {', '.join(map(str, counts))} "
                f"({study.get('planned') or 0} of {len(counts)} planned)…")  # fmt: skip
    if state == "running":
        steps = (study.get("settings") or {}).get("steps")
        lines = [f"Study {study['id']} {where}: {done} of {len(points)} points done".replace("  ", " ")]
        lines += [point_progress(p, steps) for p in points]
        return "\n".join(lines)
    if state == "completed":
        return f"Study {study['id']}: all {len(points)} points measured {where}".rstrip()
    if state == "cancelled":
        return f"Study {study['id']} was cancelled: {done} of {len(points)} points measured"
    if study.get("error") and not points:
        return f"The study could not start: {study['error'].get('message')}"
    failed = [study["error"].get("message")] if study.get("error") else []
    failed += [p.get("error") for p in points if p.get("error")]
    return f"Study {study['id']} did not finish: " + ("; ".join(failed) or "a job ended early")


def point_progress(point: dict[str, Any], steps: int | None) -> str:
    """One point's line while its study runs: "2 GPUs (job j2): step 4 of 10"."""
    n, state = point["gpus"], point.get("state") or "queued"
    what = state
    if state == "running" and point.get("step") is not None:
        what = f"step {point['step']} of {steps}" if steps else f"step {point['step']}"
    elif state == "queued":
        what = "waiting for its GPUs"
    return f"• {n} GPU{'s' * (n != 1)} (job {point.get('job')}): {what}"


def chart_series(study: dict[str, Any]) -> dict[str, tuple[list[float], list[float]]]:
    """Speed-up against GPUs: measured, linear from the first point, the plan's prediction, and noise apart."""
    rows = study.get("table") or []
    base = rows[0]["gpus"] if rows else 1
    measured = [(r["gpus"], r["speedup"]) for r in rows if r["speedup"] is not None and not r.get("noise")]
    noise = [(r["gpus"], r["speedup"]) for r in rows if r["speedup"] is not None and r.get("noise")]
    predicted = [(r["gpus"], r["predicted_speedup"]) for r in rows if r["predicted_speedup"] is not None]
    return {
        "measured": ([x for x, _ in measured], [y for _, y in measured]),
        "linear": ([r["gpus"] for r in rows], [r["gpus"] / base for r in rows]),
        "predicted": ([x for x, _ in predicted], [y for _, y in predicted]),
        "noise": ([x for x, _ in noise], [y for _, y in noise]),
    }
