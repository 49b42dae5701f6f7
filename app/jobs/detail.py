"""The detail pane of one job: what it is and how far it got, what can be done with it,
why it failed, and its charts, plan-versus-measured figures and log.

It shows a `JobHandle` and redraws from it; the page owns the handles and
answers the buttons.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QAction, QPalette, QShowEvent
from PySide6.QtWidgets import (
    QDoubleSpinBox,
    QHBoxLayout,
    QLabel,
    QMenu,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QStackedWidget,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.jobs.chart_turns import Pacer
from rigpilot.app.jobs.charts import JobCharts
from rigpilot.app.jobs.compare import ComparePicker
from rigpilot.app.jobs.compare_base import CompareWithBase
from rigpilot.app.jobs.energy_view import live_line
from rigpilot.app.jobs.failure import FailurePanel
from rigpilot.app.jobs.handle import JobHandle
from rigpilot.app.jobs.log_view import LogView
from rigpilot.app.jobs.model import duration, eta_of, gpus_text, progress_of
from rigpilot.app.jobs.outcome import model_of
from rigpilot.app.jobs.prediction import PredictionTable, measured_beside_plan
from rigpilot.app.jobs.restarts import RestartTimeline
from rigpilot.app.jobs.results_view import ResultsView
from rigpilot.app.jobs.scaling_view import ScalingPanel
from rigpilot.app.jobs.series import DEFAULT_SMOOTHING
from rigpilot.app.jobs.slurm_state import slurm_detail
from rigpilot.app.jobs.summary_view import SettingsDiff, SummaryPanel
from rigpilot.app.jobs.try_it import TryIt
from rigpilot.app.widgets.icons import icon, prerender, set_icon
from rigpilot.app.widgets.units import NA
from rigpilot.engine.jobs.machine_check import lines as machine_check_lines
from rigpilot.engine.schema import TERMINAL_STATES

RENDER_REST_MS = 20  # between two buttons' icons rendered at idle: the window answers in between
CHARTS_TAB, PLAN_TAB, LOG_TAB, SUMMARY_TAB, RESULTS_TAB, TRY_TAB, CHECK_TAB = range(7)
FINISHED = TERMINAL_STATES


class JobDetail(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.handle: JobHandle | None = None
        self._local_folder = True

        self.title = QLabel()
        self.title.setObjectName("jobTitle")
        font = self.title.font()
        font.setBold(True)
        font.setPointSizeF(font.pointSizeF() * 1.3)
        self.title.setFont(font)
        self.title.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.summary = QLabel()
        self.summary.setObjectName("jobSummary")
        self.summary.setWordWrap(True)
        # How the engine and the workers mapped the job onto this machine (plan adjustments, fallbacks).
        self.notes = QLabel()
        self.notes.setObjectName("jobNotes")
        self.notes.setWordWrap(True)
        self.notes.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.notes.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        self.notes.hide()
        self.progress = QProgressBar()
        self.progress.setObjectName("jobProgress")
        self.progress.setRange(0, 1000)
        self.progress.setTextVisible(True)

        self.cancel_button = QPushButton("&Cancel job")
        set_icon(self.cancel_button, "cancel")
        self.cancel_button.setObjectName("cancelJob")
        self.cancel_button.setToolTip("Stop the job; workers save a checkpoint first, so it can be resumed")
        self.resume_button = QPushButton("&Resume")
        set_icon(self.resume_button, "resume")
        self.resume_button.setObjectName("resumeJob")
        self.resume_button.setToolTip("Run the job again from its newest checkpoint")
        self.clone_button = QPushButton("C&lone into wizard…")
        set_icon(self.clone_button, "clone")
        self.clone_button.setObjectName("cloneJob")
        self.clone_button.setToolTip("Start a new job with this one's settings")
        self.folder_button = QPushButton("Open job &folder")
        set_icon(self.folder_button, "open-folder")
        self.folder_button.setObjectName("openJobFolder")
        self.folder_button.setToolTip("Logs, metrics, checkpoints and output of this job")
        # What a finished job's model is good for; the page answers each action.
        self.plan_action = QAction("&Plan from this model", self)
        self.infer_action = QAction("&Infer from this model…", self)
        self.finetune_action = QAction("&Fine-tune from this model…", self)
        self.serve_action = QAction("&Serve this model", self)
        self.serve_action.setIcon(icon("serve"))
        self.serve_action.setToolTip("Serve it through an OpenAI-compatible API on this machine, and chat with it")
        self.use_menu = QMenu(self)
        for a in (self.plan_action, self.infer_action, self.finetune_action, self.serve_action):
            self.use_menu.addAction(a)
        # A push button like its neighbours: with a menu it keeps room for the arrow beside its text (a tool
        # button's instant-popup arrow is drawn over the text's end).
        self.use_button = QPushButton("&Use this model")
        self.use_button.setObjectName("useModel")
        self.use_button.setMenu(self.use_menu)
        self.rename_button = QPushButton("Re&name…")
        set_icon(self.rename_button, "rename")
        self.rename_button.setObjectName("renameJob")
        self.rename_button.setToolTip("Give the job a new name (F2 in the job list)")
        self.delete_button = QPushButton("&Delete…")
        set_icon(self.delete_button, "delete")
        self.delete_button.setObjectName("deleteJob")
        self.delete_button.setToolTip(
            "Remove the job with its folder: logs, checkpoints, output (Delete in the job list)"
        )
        buttons = QHBoxLayout()
        for b in (self.cancel_button, self.resume_button, self.clone_button, self.folder_button, self.use_button,
                  self.rename_button, self.delete_button):  # fmt: skip
            buttons.addWidget(b)
        buttons.addStretch(1)
        self.try_it = TryIt()

        self.failure = FailurePanel()
        self.restarts = RestartTimeline()

        self.compare = ComparePicker()
        self.smoothing = QDoubleSpinBox()
        self.smoothing.setObjectName("smoothing")
        self.smoothing.setAccessibleName("Loss smoothing")
        self.smoothing.setToolTip("Weight of the exponential moving average drawn over the loss (0: none)")
        self.smoothing.setRange(0.0, 0.99)
        self.smoothing.setSingleStep(0.05)
        self.smoothing.setValue(DEFAULT_SMOOTHING)
        smoothing_label = QLabel("&Smoothing")
        smoothing_label.setBuddy(self.smoothing)
        self.charts = JobCharts()
        self.smoothing.valueChanged.connect(self.charts.set_smoothing)
        chart_controls = QHBoxLayout()
        chart_controls.addWidget(self.compare)
        chart_controls.addSpacing(16)
        chart_controls.addWidget(smoothing_label)
        chart_controls.addWidget(self.smoothing)
        chart_controls.addStretch(1)
        charts_area = QScrollArea()
        charts_area.setObjectName("chartsArea")
        charts_area.setWidgetResizable(True)
        charts_area.setFocusPolicy(Qt.FocusPolicy.NoFocus)  # the charts hold no controls
        charts_area.setWidget(self.charts)
        self.diff = SettingsDiff()
        charts_tab = QWidget()
        charts_layout = QVBoxLayout(charts_tab)
        charts_layout.addLayout(chart_controls)
        charts_layout.addWidget(self.diff)
        charts_layout.addWidget(charts_area, 1)

        self.prediction = PredictionTable()
        self.plan_note = QLabel()
        self.plan_note.setObjectName("planNote")
        self.plan_note.setWordWrap(True)
        plan_tab = QWidget()
        plan_layout = QVBoxLayout(plan_tab)
        plan_layout.addWidget(self.prediction)
        plan_layout.addWidget(self.plan_note)
        plan_layout.addStretch(1)

        self.log = LogView()
        self.tabs = QTabWidget()
        self.tabs.setObjectName("jobTabs")
        self.tabs.addTab(charts_tab, "Charts")
        self.tabs.addTab(plan_tab, "Plan vs measured")
        self.tabs.addTab(self.log, "Log")
        self.summary_panel = SummaryPanel()
        summary_area = QScrollArea()
        summary_area.setObjectName("summaryArea")
        summary_area.setWidgetResizable(True)
        self.scaling = ScalingPanel()
        summary_box = QWidget()
        summary_layout = QVBoxLayout(summary_box)
        summary_layout.addWidget(self.summary_panel)
        self.compare_base = CompareWithBase()
        self.compare_base.hide()
        summary_layout.addWidget(self.compare_base)
        summary_layout.addWidget(self.scaling)
        summary_area.setWidget(summary_box)
        self.tabs.addTab(summary_area, "Summary")
        self.results = ResultsView()
        self.tabs.addTab(self.results, "Results")
        # A tab of its own: above the tabs it took the height the summary and the charts need at 1280×800.
        self.tabs.addTab(self.try_it, "Try it")
        # A machine check's page shows what it found (the view Settings holds), made the first time one is opened.
        self.check_box = QWidget()
        self.check_layout = QVBoxLayout(self.check_box)
        self.check_layout.setContentsMargins(0, 0, 0, 0)
        self.check_view: Any = None
        self.tabs.addTab(self.check_box, "Machine check")
        for tab in (SUMMARY_TAB, RESULTS_TAB, TRY_TAB, CHECK_TAB):
            self.tabs.setTabVisible(tab, False)
        policy = self.tabs.sizePolicy()
        policy.setRetainSizeWhenHidden(True)  # held back from the pane's first paint, it keeps its place
        self.tabs.setSizePolicy(policy)
        self.link: Any = None
        self._compared: dict[str, Any] | None = None  # the record of the job whose loss is overlaid
        self.diff_jobs: dict[str, dict[str, Any]] = {}  # more runs in the settings comparison, by id
        self.failure.sig_show_log.connect(self.show_log)

        body = self.body = QWidget()
        body_layout = QVBoxLayout(body)
        body_layout.setContentsMargins(0, 0, 0, 0)
        body_layout.addWidget(self.title)
        body_layout.addWidget(self.summary)
        body_layout.addWidget(self.notes)
        body_layout.addWidget(self.progress)
        self.energy_line = QLabel()  # live GPU energy (app/jobs/energy_view.py)
        self.energy_line.setObjectName("jobEnergy")
        body_layout.addWidget(self.energy_line)
        body_layout.addLayout(buttons)
        body_layout.addWidget(self.failure)
        body_layout.addWidget(self.restarts)
        body_layout.addWidget(self.tabs, 1)
        self.empty = QLabel("Select a job to see its charts, its log and what it predicted.")
        self.empty.setObjectName("noJob")
        self.empty.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.empty.setWordWrap(True)
        self.stack = QStackedWidget()
        self.stack.addWidget(self.empty)
        self.stack.addWidget(body)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.stack)
        self._turns: list[Callable[[], None]] = []  # what shows or repaints after the click, a turn each
        self._turn = QTimer(self)
        self._turn.setSingleShot(True)
        self._turn.timeout.connect(self._next_turn)
        self._pacer = Pacer()
        # The buttons' icons are rendered at idle once the page is first shown, not in a job's first paint.
        self._unrendered: list[QPushButton] = [
            self.cancel_button, self.resume_button, self.clone_button, self.folder_button,
            self.rename_button, self.delete_button,
        ]  # fmt: skip
        self._render_turn = QTimer(self)
        self._render_turn.setInterval(RENDER_REST_MS)
        self._render_turn.timeout.connect(self._render_next_icon)

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        if self._unrendered and not self._render_turn.isActive():
            self._render_turn.start()

    def _render_next_icon(self) -> None:
        if self._unrendered:
            prerender(self._unrendered.pop(0))
        if not self._unrendered:
            self._render_turn.stop()

    def set_placeholder(self, widget: QWidget) -> None:
        """Show `widget` instead of the "select a job" line while no job is open."""
        self.stack.insertWidget(0, widget)
        self.stack.removeWidget(self.empty)
        self.empty.deleteLater()
        self.empty = widget
        self.stack.setCurrentIndex(0 if self.handle is None else 1)

    # -- the shown job -------------------------------------------------------------------------
    def show_handle(self, handle: JobHandle | None, *, local_folder: bool = True) -> None:
        self.handle = handle
        self._local_folder = local_folder
        self.log.set_handle(handle)
        if handle is None:
            self.stack.setCurrentIndex(0)
            self.charts.set_job(None, [], 1, None)
            self.try_it.set_model(self.link, None, {})
            self.tabs.setTabVisible(TRY_TAB, False)
            return
        # Filled in while still hidden: on a shown page some setters repaint at once (QProgressBar's
        # setValue does), and the first of them painted the whole page, its eight charts included,
        # inside the click (benchmarks/gui_job_open.py). Filled in a turn after the click (most of
        # its work), then shown or repainted in the turn after that.
        first = self.stack.currentIndex() != 1
        # Another job's charts must not stand for this one's while its history loads: hidden until drawn.
        self.charts.hold_until_drawn()
        if first:
            self.tabs.hide()  # shown a turn after the rest: the pane's first paint in two halves
        else:
            self.body.setUpdatesEnabled(False)
        self.later(self._fill)
        if first:
            self.later(self._show_pane)
            self.later(self.tabs.show)
        else:
            self.later(lambda: self.body.setUpdatesEnabled(True))

    def _fill(self) -> None:
        if self.handle is not None:
            self.update_record()

    @property
    def settling(self) -> bool:
        """The pane is still being shown or repainted a turn at a time after the last click."""
        return bool(self._turns)

    def _show_pane(self) -> None:
        if self.handle is not None:
            self.stack.setCurrentIndex(1)  # its first layout and paint

    def paint_later(self, widget: QWidget) -> None:
        """Hold `widget`'s repaint for a turn of its own after this one (one widget a turn, in order)."""
        widget.setUpdatesEnabled(False)
        self.later(lambda: widget.setUpdatesEnabled(True))

    def later(self, step: Callable[[], None]) -> None:
        """Run `step` in a turn of its own after the pane's earlier ones (each rests as the Pacer says)."""
        # A timer, not a queued call: queued calls and the repaints they cause all run in one go before
        # the next timer, so the window would not answer in between (benchmarks/gui_job_open.py).
        self._turns.append(step)
        if not self._turn.isActive():
            self._pacer.start()
            self._turn.start(0)

    def _next_turn(self) -> None:
        if self._turns:
            self._turns.pop(0)()
        if self._turns:
            self._turn.start(self._pacer.rest_ms())

    def update_record(self) -> None:
        """The record changed: header, buttons, failure cause, plan figures."""
        h = self.handle
        if h is None:
            return
        job = h.record
        self.title.setText(f"{h.name}  ({h.id})")
        state = job.get("state") or NA
        if job.get("cancel_requested") and h.active:
            state += " — cancelling, waiting for the checkpoint"
        parts = [f"<b>{state}</b>", f"{job.get('kind') or 'job'}", f"GPUs {gpus_text(job.get('gpus'))}"]
        if job.get("simulated"):
            parts.append("simulated machine: CPU ranks")
        if job.get("run", 1) > 1:
            parts.append(f"run {job['run']}")
        if job.get("waiting_for"):
            parts.append(f"waiting for GPU {gpus_text(job['waiting_for'])}")
        if job.get("slurm"):
            parts.append(slurm_detail(job))
        self.summary.setText(" · ".join(parts))
        self.cancel_button.setEnabled(h.can_cancel)
        check = job.get("kind") == "doctor"
        # A machine check is run again (its tab's button), not resumed, and the job wizard makes no checks.
        self.resume_button.setEnabled(h.can_resume and not check)
        self.clone_button.setEnabled(bool(job.get("kind")) and not check)
        has_folder = bool(job.get("job_dir")) and self._local_folder
        self.folder_button.setEnabled(has_folder)
        self.folder_button.setToolTip(
            f"Open {job['job_dir']}" if has_folder
            else "The job runs on a remote engine; its folder is on that machine" if job.get("job_dir")
            else "The engine has not said where this job's folder is"
        )  # fmt: skip
        inference = job.get("kind") == "infer"
        if inference or check:  # no loss or learning rate to draw, and nothing of the job shown before may stay
            self.charts.set_job(None, [], 1, None)
        else:
            self.charts.set_job(
                h.series, list(job.get("gpus") or []), int(job.get("ranks") or 1), job.get("predicted"),
                simulated=bool(job.get("simulated")), ended=job.get("state") in FINISHED,
            )  # fmt: skip
        if check:
            self._show_check()
        self._show_tabs(inference, job.get("state") in FINISHED and job.get("kind") == "train", check=check)
        self.show_diff()
        self._show_model_actions()
        self.update_live()

    def _show_tabs(self, inference: bool, summary: bool, *, check: bool = False) -> None:
        current = self.tabs.currentIndex()  # hiding the current tab moves Qt's choice on to a neighbour
        visible = {CHARTS_TAB: not (inference or check), PLAN_TAB: not check, RESULTS_TAB: inference,
                   SUMMARY_TAB: summary, CHECK_TAB: check}  # fmt: skip
        for tab, shown in visible.items():
            self.tabs.setTabVisible(tab, shown)
        if not visible.get(current, True) or (inference and current == CHARTS_TAB):
            current = CHECK_TAB if check else RESULTS_TAB if inference else SUMMARY_TAB if summary else CHARTS_TAB
        self.tabs.setCurrentIndex(current)

    def _show_check(self) -> None:
        if self.check_view is None and self.link is not None:
            from rigpilot.app.doctor.view import MachineCheckView

            # The latest check of this machine: the engine keeps one per machine and driver, a newer one replaces it.
            self.check_view = MachineCheckView(self.link)
            area = QScrollArea()
            area.setObjectName("checkArea")
            area.setWidgetResizable(True)
            area.setWidget(self.check_view)
            self.check_layout.addWidget(area)

    def _show_model_actions(self) -> None:
        h = self.handle
        if h is None:
            return
        choice = model_of(h.record)
        self.use_button.setEnabled(choice.path is not None)
        self.use_button.setToolTip(
            f"Plan, infer, fine-tune or serve {choice.what}: {choice.path}" if choice.path
            else f"No model to use: {choice.why}"
        )  # fmt: skip
        self.try_it.set_model(self.link, choice.path, h.record)
        self.tabs.setTabVisible(TRY_TAB, choice.path is not None)
        busy = h.active
        self.delete_button.setEnabled(not busy)
        self.delete_button.setToolTip(
            "Cancel the job before deleting it" if busy
            else "Remove the job with its folder: logs, checkpoints, output (Delete in the job list)"
        )  # fmt: skip

    def update_live(self) -> None:
        """What moves with the metrics: progress, ETA, phase, plan-vs-measured, an out-of-memory error."""
        h = self.handle
        if h is None:
            return
        job = h.record
        fraction, text = progress_of(job)
        if fraction is None:
            self.progress.setRange(0, 0 if h.state == "running" else 1000)  # busy bar when running without a length
            self.progress.setValue(0)
            self.progress.setFormat(text or " ")
        else:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(fraction * 1000))
            eta = eta_of(job)
            self.progress.setFormat(f"{text} — {duration(eta)} left" if eta is not None else text)
        phase = h.series.phase
        self.progress.setToolTip(f"phase: {phase}" if phase else "")
        self.energy_line.setText(live_line(job))
        self.energy_line.setVisible(bool(self.energy_line.text()))
        predicted = job.get("predicted")
        self.prediction.show_values(predicted, measured_beside_plan(job, h.series), simulated=bool(job.get("simulated")))
        # `predicted` may carry only the engine's notes on a job submitted without a plan.
        planned = isinstance(predicted, dict) and any(
            predicted.get(k) is not None for k in ("peak_memory_bytes", "tokens_per_s", "step_time_s")
        )
        self.plan_note.setText(
            "The plan's figures are from the Planner, attached when the job was submitted."
            if planned else "No plan was attached when this job was submitted, so there is nothing to compare with."
        )  # fmt: skip
        self.failure.show_job(job, h.series.oom)
        self.restarts.show_job(job)
        self._show_notes()
        if job.get("kind") == "infer":
            self.results.show_job(self.link, job)
        elif self.tabs.isTabVisible(SUMMARY_TAB):
            self.summary_panel.show_job(job, h.series)
            self.scaling.show_job(self.link, job)
            self.compare_base.show_job(self.link, job)

    def _show_notes(self) -> None:
        h = self.handle
        if h is None:
            return
        predicted = h.record.get("predicted") if isinstance(h.record.get("predicted"), dict) else {}
        engine_notes = [n for n in predicted.get("plan_notes") or [] if isinstance(n, str)]
        # What the machine check set for this job's ranks, and why (engine.jobs.machine_check words it).
        engine_notes += machine_check_lines(h.record.get("machine_check"))
        notes = [*engine_notes, *(n for n in h.series.notes if n not in engine_notes)]
        self.notes.setText("\n".join(f"• {n}" for n in notes))
        self.notes.setVisible(bool(notes))

    def show_log(self, rank: int) -> None:
        self.tabs.setCurrentIndex(LOG_TAB)
        self.log.select_rank(rank)

    def set_compare(self, series: Any, name: str, record: dict[str, Any] | None = None) -> None:
        self.charts.set_compare(series, name)
        self._compared = record
        self.show_diff()

    def show_diff(self) -> list[tuple[str, list[str]]]:
        """The settings that differ between the shown job, the one overlaid and those added to the comparison."""
        shown = self.handle.record if self.handle is not None else None
        if shown is None:
            return self.diff.show_jobs([])
        jobs = [shown]
        for record in (self._compared, *self.diff_jobs.values()):
            if record and all(record.get("id") != j.get("id") for j in jobs):
                jobs.append(record)
        return self.diff.show_jobs(jobs)
