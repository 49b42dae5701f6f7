"""The Jobs page: every job the engine knows, and the one picked, in detail.

The list is a table model kept current by `sig_job` events and a `jobs`
request on every (re)connect. Picking a job opens a `JobHandle` for it, which
loads its whole metric history and then follows the stream; a second job
picked for comparison gets a handle of its own. Drawing happens on a timer,
only while the page is visible and only when something new arrived.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QByteArray, QModelIndex, QPersistentModelIndex, QRect, QSettings, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import (
    QDesktopServices,
    QHideEvent,
    QKeySequence,
    QPainter,
    QPalette,
    QResizeEvent,
    QShortcut,
    QShowEvent,
)
from PySide6.QtWidgets import (
    QAbstractItemView,
    QApplication,
    QComboBox,
    QHBoxLayout,
    QHeaderView,
    QInputDialog,
    QLabel,
    QMenu,
    QMessageBox,
    QSplitter,
    QStyle,
    QStyledItemDelegate,
    QStyleOptionProgressBar,
    QStyleOptionViewItem,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.jobs.charts import TELEMETRY_WINDOW_S
from rigpilot.app.jobs.detail import JobDetail
from rigpilot.app.jobs.empty_state import JobsEmptyState
from rigpilot.app.jobs.handle import DELETED, JobHandle
from rigpilot.app.jobs.model import (
    ACTIVE,
    FRACTION_ROLE,
    ID_ROLE,
    PROGRESS,
    STATES,
    SUBMITTED,
    JobFilterModel,
    JobListModel,
)
from rigpilot.app.jobs.outcome import model_of, settings_of
from rigpilot.app.jobs.telemetry_window import job_window
from rigpilot.app.serving.served import serve_spec, served_models
from rigpilot.app.widgets.style import heading
from rigpilot.engine.schema import FINE_TUNE_METHODS

CONNECTED = "connected"  # EngineLink's state name
REFRESH_MS = 500
# The job list's height until the user drags the splitter: enough rows to pick from, while the eight
# charts below still fit a 1280x800 screen.
LIST_ROWS = 5
LIST_SHARE = 0.4
# "splitter" held the old two-row default whether or not the user chose it; only a dragged one is kept now.
LIST_SPLITTER_KEY = "list_splitter"
FILTERS: list[tuple[str, frozenset[str] | None]] = [
    ("All states", None),
    ("Active (queued, starting, running)", frozenset(ACTIVE)),
    *((state.capitalize(), frozenset({state})) for state in STATES),
]


class ProgressDelegate(QStyledItemDelegate):
    """Draws the progress column as a bar when the job knows how far it is.

    The style's own bar text is drawn in one colour over both the filled and the empty part,
    and some styles (Fusion's highlight on its chunk) make it vanish; so the text is drawn
    here, twice, clipped: the highlight's text colour over the filled part, the view's over the rest.
    """

    def paint(
        self, painter: QPainter, option: QStyleOptionViewItem, index: QModelIndex | QPersistentModelIndex
    ) -> None:
        fraction = index.data(FRACTION_ROLE)
        if fraction is None:
            super().paint(painter, option, index)
            return
        fraction = max(0.0, min(1.0, fraction))
        bar = QStyleOptionProgressBar()
        bar.rect = option.rect.adjusted(2, 3, -2, -3)
        bar.minimum, bar.maximum = 0, 1000
        bar.progress = int(fraction * 1000)
        bar.textVisible = False
        # Without State_Horizontal a style draws the bar upright: filled from the bottom, under its own text.
        bar.state = option.state | QStyle.StateFlag.State_Horizontal
        bar.palette = option.palette
        QApplication.style().drawControl(QStyle.ControlElement.CE_ProgressBar, bar, painter)
        text = str(index.data(Qt.ItemDataRole.DisplayRole) or "")
        filled = QRect(bar.rect)
        filled.setWidth(round(bar.rect.width() * fraction))
        empty = QRect(bar.rect)
        empty.setLeft(filled.right() + 1)
        align = Qt.AlignmentFlag.AlignCenter
        painter.save()
        for part, role in ((filled, QPalette.ColorRole.HighlightedText), (empty, QPalette.ColorRole.Text)):
            if part.width() <= 0:
                continue
            painter.setClipRect(part)
            painter.setPen(option.palette.color(role))
            painter.drawText(bar.rect, align, text)
        painter.restore()


class JobsPage(QWidget):
    sig_job_opened = Signal(str)  # the job shown in the detail pane
    sig_clone_requested = Signal(dict)  # the record of a job to start a new one from
    sig_message = Signal(str)  # a line for the user (errors of requests, folder not found)
    sig_plan_model = Signal(str)  # "Plan from this model": the model for the Planner to plan
    sig_serving = Signal(str)  # "Serve this model": the id of the serve job it submitted

    def __init__(self, link: Any, parent: QWidget | None = None):
        super().__init__(parent)
        self.link = link
        self.opens_wizard = True  # False when the window handles sig_clone_requested itself
        self.model = JobListModel(self)
        self.proxy = JobFilterModel(self)
        self.proxy.setSourceModel(self.model)
        self._handles: dict[str, JobHandle] = {}
        self._users: dict[str, int] = {}
        self._current: str | None = None
        self._compare: str | None = None
        self._job_events: dict[str, dict[str, Any]] | None = None  # events while a `jobs` request is out
        self._live_drawn: tuple[Any, ...] | None = None
        self._wizard: QWidget | None = None
        self._selecting = False  # the page moves the table's selection itself: not a user's pick
        self._telemetry_for: str | None = None  # the job whose telemetry history was asked for

        self.state_filter = QComboBox()
        self.state_filter.setObjectName("stateFilter")
        self.state_filter.setAccessibleName("Show jobs that are")
        for title, _ in FILTERS:
            self.state_filter.addItem(title)
        self.state_filter.currentIndexChanged.connect(lambda i: self.proxy.set_states(FILTERS[i][1]))
        self.count_label = QLabel()
        self.count_label.setObjectName("jobCount")
        self.table = QTableView()
        self.table.setObjectName("jobTable")
        self.table.setAccessibleName("Jobs")
        self.table.setModel(self.proxy)
        self.table.setSortingEnabled(True)
        self.table.sortByColumn(SUBMITTED, Qt.SortOrder.DescendingOrder)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setTabKeyNavigation(False)  # Tab leaves the table; arrows move in it
        self.table.setAlternatingRowColors(True)
        self.table.verticalHeader().hide()
        self.table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        self.table.horizontalHeader().setSectionResizeMode(PROGRESS, QHeaderView.ResizeMode.Interactive)
        # One line per job: the submission time wrapped onto two ("2026-11-29 / 01:36") made every row double.
        self.table.setWordWrap(False)
        self.table.horizontalHeader().setSectionResizeMode(SUBMITTED, QHeaderView.ResizeMode.ResizeToContents)
        self.table.setColumnWidth(PROGRESS, 170)
        self._progress_delegate = ProgressDelegate(self.table)
        self.table.setItemDelegateForColumn(PROGRESS, self._progress_delegate)
        self.table.selectionModel().currentRowChanged.connect(self._on_row_changed)
        self.table.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.table.customContextMenuRequested.connect(self._context_menu)
        for keys, slot in (
            ((QKeySequence.StandardKey.Delete,), self.delete_job),
            ((QKeySequence(Qt.Key.Key_F2),), self.rename_job),
            ((QKeySequence(Qt.Key.Key_Return), QKeySequence(Qt.Key.Key_Enter)), self._open_current_row),
        ):
            for key in keys:
                shortcut = QShortcut(key, self.table, slot)
                shortcut.setContext(Qt.ShortcutContext.WidgetShortcut)

        filter_label = QLabel("S&how")
        filter_label.setBuddy(self.state_filter)
        list_head = QHBoxLayout()
        list_head.addWidget(heading("Jobs"))
        list_head.addSpacing(12)
        list_head.addWidget(filter_label)
        list_head.addWidget(self.state_filter)
        list_head.addStretch(1)
        list_head.addWidget(self.count_label)
        list_box = QWidget()
        self._list_head = list_head
        list_layout = QVBoxLayout(list_box)
        list_layout.addLayout(list_head)
        list_layout.addWidget(self.table)

        self.detail = JobDetail()
        self.detail.cancel_button.clicked.connect(self.cancel_job)
        self.detail.resume_button.clicked.connect(self.resume_job)
        self.detail.clone_button.clicked.connect(self.clone_job)
        self.detail.folder_button.clicked.connect(self.open_job_folder)
        self.detail.compare.sig_compare_changed.connect(lambda job_id: self._set_compare(job_id or None))
        self.detail.link = link
        self.detail.plan_action.triggered.connect(self.plan_from_model)
        self.detail.infer_action.triggered.connect(self.infer_from_model)
        self.detail.finetune_action.triggered.connect(self.finetune_from_model)
        self.detail.serve_action.triggered.connect(self.serve_model)
        self.detail.try_it.sig_serve.connect(self.serve_model)
        self.detail.rename_button.clicked.connect(self.rename_job)
        self.detail.delete_button.clicked.connect(self.delete_job)
        self.detail.results.sig_message.connect(self.sig_message.emit)
        # With no job open, the detail pane offers to start one (in place of its "select a job" line).
        self.empty_state = JobsEmptyState(link, self.model)
        self.empty_state.sig_submitted.connect(self.open_job)
        self.detail.set_placeholder(self.empty_state)

        self.status = QLabel()
        self.status.setObjectName("jobsStatus")
        self.status.setWordWrap(True)
        self.sig_message.connect(self.status.setText)

        self.splitter = QSplitter(Qt.Orientation.Vertical)
        self.splitter.setObjectName("jobsSplitter")
        self.splitter.addWidget(list_box)
        self.splitter.addWidget(self.detail)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setCollapsible(0, False)  # a list dragged out of sight is a list the user cannot find
        self.splitter.setSizes([130, 770])  # until fit_list knows the fonts and the height
        # Until the user drags the splitter, the list is LIST_ROWS rows tall; once they do, theirs is kept.
        self._list_sized_by_user = False
        self.splitter.splitterMoved.connect(self._on_splitter_moved)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.splitter, 1)
        layout.addWidget(self.status)

        for signal in (self.model.rowsInserted, self.model.rowsRemoved, self.model.modelReset, self.model.dataChanged):
            signal.connect(self._on_list_changed)
        self.proxy.rowsInserted.connect(self._update_count)
        self.proxy.rowsRemoved.connect(self._update_count)
        self.proxy.modelReset.connect(self._update_count)
        self._update_count()

        self.timer = QTimer(self)
        self.timer.setInterval(REFRESH_MS)
        self.timer.timeout.connect(self.refresh)

        link.sig_state.connect(self._on_state)
        link.sig_job.connect(self._on_job_event)
        link.sig_telemetry.connect(self._on_telemetry)
        if getattr(link, "state", None) == CONNECTED:
            self._on_state(CONNECTED, "")

    # -- public API ---------------------------------------------------------------------------
    @property
    def current_job_id(self) -> str | None:
        return self._current

    @property
    def current_handle(self) -> JobHandle | None:
        return self._handles.get(self._current) if self._current else None

    def handle(self, job_id: str) -> JobHandle | None:
        return self._handles.get(job_id)

    def open_job(self, job_id: str) -> None:
        """Select `job_id` in the list and show it; works before the engine has told us about the job."""
        if self.model.job(job_id) is None:
            self.model.upsert({"id": job_id})  # a just-submitted job: its record follows
        if job_id != self._current:
            self.detail.paint_later(self.table)  # the list's new selection, then the pane, a turn each
        self._select_row(job_id)
        if job_id == self._current:
            return
        previous, self._current = self._current, job_id
        handle = self._acquire(job_id)
        self.detail.show_handle(handle, local_folder=not getattr(self.link, "remote", None))
        if previous is not None:
            self._release(previous)
        self._offer_compare()
        self._telemetry_for = None
        self._load_telemetry(handle)
        # show_handle has just filled the pane from this state: the refresh only starts the charts.
        self._live_drawn = (id(handle), handle.series.revision, id(handle.record))
        self.refresh()
        self.sig_job_opened.emit(job_id)

    def set_state_filter(self, states: frozenset[str] | set[str] | None) -> None:
        wanted = frozenset(states) if states is not None else None
        for i, (_, s) in enumerate(FILTERS):
            if s == wanted:
                self.state_filter.setCurrentIndex(i)
                return
        self.proxy.set_states(wanted)  # a set the menu does not offer

    def compare_with(self, job_id: str | None) -> bool:
        """Overlay `job_id`'s loss on the shown job's loss chart ("" or None: no overlay).

        False when the job is not one the picker offers (the shown job itself, a queued one).
        """
        if job_id and not self.detail.compare.set_job(job_id):
            return False
        if not job_id:
            self.detail.compare.set_job("")
        self._set_compare(job_id or None)
        return True

    def _set_compare(self, job_id: str | None) -> None:
        if job_id == self._compare:
            return
        previous, self._compare = self._compare, job_id
        if job_id is None:
            self.detail.set_compare(None, "")
        else:
            handle = self._acquire(job_id)
            self.detail.set_compare(handle.series, handle.name, handle.record)
        if previous is not None:
            self._release(previous)

    @property
    def compared_job_id(self) -> str | None:
        return self._compare

    def cancel_job(self) -> None:
        if self.current_handle is not None:
            self.current_handle.cancel()

    def resume_job(self) -> None:
        if self.current_handle is not None:
            self.current_handle.resume()

    def clone_job(self) -> None:
        """Start a new job from the shown one's settings: sig_clone_requested, and the wizard when it exists."""
        handle = self.current_handle
        if handle is None:
            return
        self.sig_clone_requested.emit(dict(handle.record))
        if self.opens_wizard:
            self._open_wizard(dict(handle.record))

    def open_job_folder(self) -> bool:
        handle = self.current_handle
        folder = handle.record.get("job_dir") if handle else None
        if not folder:
            return False
        if not QDesktopServices.openUrl(QUrl.fromLocalFile(folder)):
            self.sig_message.emit(f"Could not open {folder}: no file manager answered")
            return False
        return True

    # -- what a finished job's model is good for, rename, delete -----------------------------------
    def _model(self) -> str | None:
        handle = self.current_handle
        if handle is None:
            return None
        choice = model_of(handle.record)
        if choice.path is None:
            self.sig_message.emit(f"Job {handle.id} has no model to use: {choice.why}")
        return choice.path

    def plan_from_model(self) -> None:
        model = self._model()
        if model:
            self.sig_plan_model.emit(model)

    def infer_from_model(self) -> None:
        model = self._model()
        if model and self.current_handle is not None:
            gpus = list(self.current_handle.record.get("gpus") or [])
            self._open_wizard({"spec_version": 1, "kind": "infer", "model": model, "gpus": gpus, "infer": {}})

    def finetune_from_model(self) -> None:
        model = self._model()
        handle = self.current_handle
        if not model or handle is None:
            return
        settings = settings_of(handle.record)
        train = dict(settings.get("train") or {}) if settings.get("kind") == "train" else {}
        # A model trained from scratch is fine-tuned like any pretrained one; its data comes along.
        if train.get("method") not in FINE_TUNE_METHODS:
            train["method"] = "lora"
        gpus = list(handle.record.get("gpus") or [])
        self._open_wizard({"spec_version": 1, "kind": "train", "model": model, "gpus": gpus, "train": train})

    def serve_model(self) -> None:
        """Serve the shown job's model as `rigpilot serve JOB` does, on the first GPU the job ran on: a training
        job by its id (the engine serves what it trained, a LoRA adapter unmerged beside its base), else the
        model it ran."""
        model = self._model()
        handle = self.current_handle
        if not model or handle is None:
            return
        trained = handle.record.get("kind") == "train"
        already = next((r for r in served_models(self.link).rows() if r.serves(handle.id if trained else "", model)),
                       None)  # fmt: skip
        if already is not None:  # one server per model is enough: show the one that runs
            self.sig_message.emit(f"{handle.name} is served already (job {already.id})")
            self.sig_serving.emit(already.id)
            return
        spec = serve_spec(handle.id if trained else model, list(handle.record.get("gpus") or []),
                          "" if trained else handle.name)  # fmt: skip

        def done(reply: dict[str, Any]) -> None:
            job_id = (reply.get("job") or {}).get("id")
            if job_id:
                self.sig_message.emit(f"Serve job {job_id} loads {handle.name}; the Serving page shows its URL")
                self.sig_serving.emit(job_id)

        self.link.call("submit", spec=spec, plan=None, on_done=done,
                       on_error=lambda e: self.sig_message.emit(f"Could not serve {handle.name}: {e}"))  # fmt: skip

    def rename_job(self) -> None:
        handle = self.current_handle
        if handle is None:
            return
        name, ok = QInputDialog.getText(self, "Rename job", f"New name for job {handle.id}:", text=handle.name)
        if not ok or not name.strip() or name.strip() == handle.name:
            return

        def done(reply: dict[str, Any]) -> None:
            job = reply.get("job")
            if isinstance(job, dict):
                self._on_job_event(job)  # the engine's event follows; the list need not wait for it
                if job.get("id") in self._handles:
                    self._handles[job["id"]].refresh_record()

        self.link.call(
            "rename", job=handle.id, name=name.strip(), on_done=done,
            on_error=lambda e: self.sig_message.emit(f"Could not rename job {handle.id}: {e}"),
        )  # fmt: skip

    def delete_job(self) -> None:
        handle = self.current_handle
        if handle is None:
            return
        job_id = handle.id
        if handle.active:
            self.sig_message.emit(f"Job {job_id} is {handle.state}; cancel it before deleting it")
            return
        answer = QMessageBox.question(
            self, "Delete job",
            f"Delete job {handle.name} ({job_id}) with its folder: logs, checkpoints and output?\n"
            f"{handle.record.get('job_dir') or ''}",
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.Cancel, QMessageBox.StandardButton.Cancel,
        )  # fmt: skip
        if answer != QMessageBox.StandardButton.Yes:
            return
        self.link.call(
            "delete", job=job_id, on_done=lambda _reply: self._forget(job_id),
            on_error=lambda e: self.sig_message.emit(f"Could not delete job {job_id}: {e}"),
        )  # fmt: skip

    def add_to_comparison(self, job_id: str) -> None:
        """Put `job_id`'s settings beside the shown job's (and any others added): only what differs is listed."""

        def done(reply: dict[str, Any]) -> None:
            if isinstance(reply.get("job"), dict):
                self.detail.diff_jobs[job_id] = reply["job"]
                self.detail.show_diff()

        self.link.call(
            "job", job=job_id, on_done=done,
            on_error=lambda e: self.sig_message.emit(f"Could not compare job {job_id}: {e}"),
        )  # fmt: skip

    def clear_comparison(self) -> None:
        self.detail.diff_jobs.clear()
        self.detail.show_diff()

    def _open_current_row(self) -> None:
        index = self.table.currentIndex()
        job_id = index.data(ID_ROLE) if index.isValid() else None
        if job_id:
            self.open_job(job_id)
            self.detail.tabs.setFocus()

    def context_menu(self, job_id: str) -> QMenu:
        """The job list's menu for `job_id` (shown, so its actions act on it)."""
        self.open_job(job_id)
        handle = self.current_handle
        menu = QMenu(self)
        if handle is None:
            return menu
        for text, slot, enabled in (
            ("&Cancel job", self.cancel_job, handle.can_cancel),
            ("&Resume", self.resume_job, handle.can_resume),
            ("C&lone into wizard…", self.clone_job, bool(handle.record.get("kind"))),
        ):
            menu.addAction(text, slot).setEnabled(enabled)
        menu.addSeparator()
        has_model = model_of(handle.record).path is not None
        for action in (self.detail.plan_action, self.detail.infer_action, self.detail.finetune_action,
                       self.detail.serve_action):  # fmt: skip
            action.setEnabled(has_model)
            menu.addAction(action)
        menu.addSeparator()
        menu.addAction("Add to settings co&mparison", lambda: self.add_to_comparison(job_id))
        if self.detail.diff_jobs:
            menu.addAction("Clear settings comparison", self.clear_comparison)
        menu.addSeparator()
        menu.addAction("Re&name…\tF2", self.rename_job)
        menu.addAction("&Delete…\tDel", self.delete_job).setEnabled(not handle.active)
        return menu

    def _context_menu(self, pos: Any) -> None:
        index = self.table.indexAt(pos)
        job_id = index.data(ID_ROLE) if index.isValid() else None
        if job_id:
            self.context_menu(job_id).popup(self.table.viewport().mapToGlobal(pos))

    # -- engine events ------------------------------------------------------------------------
    def _on_state(self, state: str, detail: str) -> None:
        if state == CONNECTED:
            self._job_events = {}
            self.link.call("jobs", on_done=self._on_jobs, on_error=self._on_jobs_error)

    def _on_jobs(self, reply: dict[str, Any]) -> None:
        # Events that arrived while the request was out are newer than the reply.
        events = self._job_events or {}
        self._job_events = None
        jobs = {j["id"]: j for j in reply.get("jobs") or [] if j.get("id")}
        for job_id, job in events.items():
            if job.get("state") == DELETED:
                jobs.pop(job_id, None)
            else:
                jobs[job_id] = {**jobs.get(job_id, {}), **job}
        for shown in (self._current, self._compare):
            if shown and shown not in jobs and shown in self._handles:
                jobs[shown] = self._handles[shown].record  # the list may stop before an old job
        self.model.set_jobs(sorted(jobs.values(), key=lambda j: j.get("seq") or 0))
        if self._current:
            self._select_row(self._current)

    def _on_jobs_error(self, error: BaseException) -> None:
        self._job_events = None
        self.sig_message.emit(f"Engine: could not list jobs: {error}")

    def _on_job_event(self, job: dict[str, Any]) -> None:
        if not job.get("id"):
            return
        if self._job_events is not None:
            self._job_events[job["id"]] = job
        if job.get("state") == DELETED:
            self._forget(job["id"])
            return
        self.model.upsert(job)

    def _forget(self, job_id: str) -> None:
        if job_id == self._compare:
            self.compare_with(None)
        if job_id == self._current:
            self._current = None
            self.detail.show_handle(None)
            self._release(job_id)
        # Removing the current row would move the selection on, and open a job nobody picked.
        self._selecting = True
        try:
            if self._current is None:
                self.table.setCurrentIndex(QModelIndex())
            self.model.remove(job_id)
        finally:
            self._selecting = False
        if self._current is not None:
            self._select_row(self._current)

    def _on_telemetry(self, sample: dict[str, Any]) -> None:
        handle = self.current_handle
        if handle is None:
            return
        _, until = job_window(handle.record, TELEMETRY_WINDOW_S)
        when = sample.get("time")
        if until is not None and (not isinstance(when, int | float) or when > until):
            return  # the job has ended: its charts keep its own window, not what the GPUs do now
        self.detail.charts.add_telemetry([sample])

    def _load_telemetry(self, handle: JobHandle) -> None:
        """The job's GPUs over the last minutes (or, once it ended, its last minutes), so the usage charts
        do not start empty.

        Asked once the record says which GPUs the job has: samples of unknown GPUs have nowhere to go.
        """
        if self._telemetry_for == handle.id or not handle.record.get("gpus"):
            return
        self._telemetry_for = job_id = handle.id
        since, until = job_window(handle.record, TELEMETRY_WINDOW_S)
        self._ask_telemetry(job_id, since, until)

    def _ask_telemetry(self, job_id: str, since: float, until: float | None) -> None:
        def done(reply: dict[str, Any]) -> None:
            if self._current != job_id or self._telemetry_for != job_id:
                return
            samples = reply.get("samples") or []
            if until is not None:
                samples = [s for s in samples if isinstance(s.get("time"), int | float) and s["time"] <= until]
            self.detail.charts.add_telemetry(samples)
            after = reply.get("next_since")
            # An ended job's window may be more than one reply; a live job's fills from the stream.
            if until is not None and reply.get("more") and isinstance(after, int | float) and since < after < until:
                self._ask_telemetry(job_id, after, until)

        # Without the history the charts fill from live samples: nothing to tell the user.
        self.link.call(
            "telemetry_history", since=since, limit=int(TELEMETRY_WINDOW_S) * 2, on_done=done, on_error=_ignore
        )

    # -- handles --------------------------------------------------------------------------------
    def _acquire(self, job_id: str) -> JobHandle:
        handle = self._handles.get(job_id)
        if handle is None:
            handle = JobHandle(self.link, job_id, self.model.job(job_id))
            handle.sig_record.connect(self._on_handle_record)
            handle.sig_error.connect(self.sig_message.emit)
            handle.sig_history_loaded.connect(self._on_history_loaded)
            self._handles[job_id] = handle
            handle.open()
        self._users[job_id] = self._users.get(job_id, 0) + 1
        return handle

    def _release(self, job_id: str) -> None:
        self._users[job_id] = self._users.get(job_id, 1) - 1
        if self._users[job_id] > 0:
            return
        del self._users[job_id]
        handle = self._handles.pop(job_id, None)
        if handle is not None:
            handle.close()
            handle.sig_record.disconnect(self._on_handle_record)
            handle.sig_error.disconnect(self.sig_message.emit)
            handle.sig_history_loaded.disconnect(self._on_history_loaded)

    def _on_handle_record(self, record: dict[str, Any]) -> None:
        job_id = record.get("id")
        if not job_id:
            return
        if record.get("state") == DELETED:
            self._forget(job_id)
            return
        self.model.upsert(record)
        if job_id == self._current:
            self.detail.update_record()
            self._load_telemetry(self._handles[job_id])
            self._live_drawn = None
        if job_id == self._compare or (job_id == self._current and self._compare in self._handles):
            compared = self._handles[self._compare]  # type: ignore[index]
            self.detail.set_compare(compared.series, compared.name, compared.record)

    # -- list -------------------------------------------------------------------------------------
    def _select_row(self, job_id: str) -> None:
        row = self.model.row_of(job_id)
        if row is None:
            return
        source = self.model.index(row, 0)
        index = self.proxy.mapFromSource(source)
        if not index.isValid():  # hidden by the state filter: show everything rather than hide the job
            self.state_filter.setCurrentIndex(0)
            index = self.proxy.mapFromSource(source)
        if self.table.currentIndex() != index:
            self._selecting = True
            try:
                self.table.setCurrentIndex(index)
            finally:
                self._selecting = False
        self.table.scrollTo(index)

    def _on_row_changed(self, current: QModelIndex, _previous: QModelIndex) -> None:
        if self._selecting:
            return
        job_id = current.data(ID_ROLE) if current.isValid() else None
        if job_id and job_id != self._current:
            self.open_job(job_id)

    def _on_list_changed(self, *_: Any) -> None:
        self._offer_compare()

    def _offer_compare(self) -> None:
        self.detail.compare.set_jobs(self.model.jobs(), self._current)

    def _update_count(self, *_: Any) -> None:
        shown, total = self.proxy.rowCount(), self.model.rowCount()
        self.count_label.setText(
            f"{shown} of {total} jobs" if shown != total else f"{total} job{'s' if total != 1 else ''}"
        )

    # -- drawing ----------------------------------------------------------------------------------
    def refresh(self, force: bool = False) -> None:
        """Redraw the shown job if something changed; a no-op while hidden."""
        if not force and not self.isVisible():
            return
        handle = self.current_handle
        if handle is None:
            return
        live = (id(handle), handle.series.revision, id(handle.record))
        if force or live != self._live_drawn:
            self._live_drawn = live
            self.detail.update_live()
        if force or not handle.loading_history:  # drawn once the history is in (_on_history_loaded)
            self.detail.charts.refresh(force)

    def _on_history_loaded(self, _records: int) -> None:
        if self.sender() is self.current_handle:
            # A turn after the one that merged the last page: each is a piece of work of its own.
            self.detail.later(self.refresh)

    def _on_splitter_moved(self, *_: object) -> None:
        self._list_sized_by_user = True

    def fit_list(self) -> None:
        """Give the job list LIST_ROWS rows (at most LIST_SHARE of the page), the charts the rest."""
        total = sum(self.splitter.sizes())
        if self._list_sized_by_user or total <= 0:
            return
        box = self.table.parentWidget()
        layout = box.layout() if box is not None else None
        if layout is None:
            return
        margins = layout.contentsMargins()
        header = self.table.horizontalHeader()
        want = (
            margins.top() + margins.bottom() + layout.spacing() + self._list_head.sizeHint().height()
            + max(header.height(), header.sizeHint().height()) + 2 * self.table.frameWidth()
            + LIST_ROWS * self.table.verticalHeader().defaultSectionSize()
        )  # fmt: skip
        want = min(want, int(total * LIST_SHARE))
        if self.splitter.sizes()[0] != want:
            self.splitter.setSizes([want, total - want])

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        self.fit_list()

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        self.fit_list()
        self.timer.start()
        self.refresh(force=True)

    def hideEvent(self, event: QHideEvent) -> None:
        super().hideEvent(event)
        self.timer.stop()

    # -- the wizard ---------------------------------------------------------------------------------
    def _open_wizard(self, job: dict[str, Any]) -> None:
        from rigpilot.app.wizard.wizard import open_wizard  # on first use: not needed to paint the page

        try:
            self._wizard = open_wizard(self.link, None, job=job)
        except Exception as e:  # a wizard that cannot take this job must not take the page down
            what = f"clone {job['id']}" if job.get("id") else f"open the wizard for {job.get('model')}"
            self.sig_message.emit(f"Could not {what} into the wizard: {e}")
            return
        self._wizard.sig_submitted.connect(self._on_wizard_submitted)

    def _on_wizard_submitted(self, job: Any) -> None:
        job_id = job.get("id") if isinstance(job, dict) else job
        if isinstance(job_id, str):
            self.open_job(job_id)

    # -- persistence ----------------------------------------------------------------------------------
    def save_state(self, settings: QSettings, prefix: str) -> None:
        if self._list_sized_by_user:  # otherwise the list's height follows the fonts and the window
            settings.setValue(f"{prefix}/{LIST_SPLITTER_KEY}", self.splitter.saveState())
        settings.setValue(f"{prefix}/filter", self.state_filter.currentIndex())
        settings.setValue(f"{prefix}/header", self.table.horizontalHeader().saveState())
        settings.setValue(f"{prefix}/tab", self.detail.tabs.currentIndex())
        settings.setValue(f"{prefix}/smoothing", self.detail.smoothing.value())

    def restore_state(self, settings: QSettings, prefix: str) -> None:
        state = settings.value(f"{prefix}/{LIST_SPLITTER_KEY}")
        if isinstance(state, QByteArray) and self.splitter.restoreState(state):
            self._list_sized_by_user = True
        state = settings.value(f"{prefix}/header")
        if isinstance(state, QByteArray):
            self.table.horizontalHeader().restoreState(state)
        for key, setter, count in (
            ("filter", self.state_filter.setCurrentIndex, len(FILTERS)),
            ("tab", self.detail.tabs.setCurrentIndex, self.detail.tabs.count()),
        ):
            try:
                value = int(settings.value(f"{prefix}/{key}", 0))
            except (TypeError, ValueError):
                continue
            if 0 <= value < count:
                setter(value)
        try:
            self.detail.smoothing.setValue(float(settings.value(f"{prefix}/smoothing", self.detail.smoothing.value())))
        except (TypeError, ValueError):
            pass


def _ignore(_error: BaseException) -> None:
    pass
