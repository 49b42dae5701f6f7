"""The main window: a navigation rail of pages, the simulated-machine banner, the status bar, the tray.

For measuring start-up (benchmarks/gui_startup.py): with RIGPILOT_EXIT_AFTER_FIRST_PAINT=1 in the
environment, the window prints `first-paint <time.time()> <CPU seconds>` once its first frame is painted, and quits.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from html import escape
from typing import TYPE_CHECKING, Any, Literal, cast, overload

from PySide6.QtCore import QSettings, QSize, Qt, QTimer
from PySide6.QtGui import QAction, QCloseEvent, QIcon, QKeySequence, QPaintEvent
from PySide6.QtWidgets import (
    QApplication,
    QFrame,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QMenu,
    QMessageBox,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QStackedWidget,
    QSystemTrayIcon,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app import desktop_notify, tasks
from rigpilot.app.engine_link import CONNECTED, CONNECTING, GONE, EngineLink
from rigpilot.app.identity import APP_ID, APP_NAME
from rigpilot.app.widgets import style
from rigpilot.app.widgets.icons import icon, set_icon
from rigpilot.app.widgets.window_size import first_size, keep_on_screen
from rigpilot.engine.api.protocol import JOB_DATABASE_REBUILT, JOBS_PUT_BACK, TELEMETRY_RESET
from rigpilot.engine.hardware.machine import is_simulated
from rigpilot.engine.schema import UNFINISHED_STATES

if TYPE_CHECKING:  # the pages are imported when first shown (start-up time); their types are for mypy only
    from rigpilot.app.dashboard.page import DashboardPage
    from rigpilot.app.jobs.page import JobsPage
    from rigpilot.app.planner.page import PlannerPage
    from rigpilot.app.serving.page import ServingPage
    from rigpilot.app.settings.page import SettingsPage
    from rigpilot.app.topology.page import TopologyPage

# (key, title, "module:Class"): each page lives in its own folder and is built with the EngineLink.
PAGES: list[tuple[str, str, str]] = [
    ("dashboard", "Dashboard", "rigpilot.app.dashboard.page:DashboardPage"),
    ("topology", "Topology", "rigpilot.app.topology.page:TopologyPage"),
    ("planner", "Planner", "rigpilot.app.planner.page:PlannerPage"),
    ("jobs", "Jobs", "rigpilot.app.jobs.page:JobsPage"),
    ("serving", "Serving", "rigpilot.app.serving.page:ServingPage"),
    ("settings", "Settings", "rigpilot.app.settings.page:SettingsPage"),
]

_KEYS = [key for key, _, _ in PAGES]

RUNNING_STATES = tuple(s.value for s in UNFINISHED_STATES)
EXIT_AFTER_FIRST_PAINT = "RIGPILOT_EXIT_AFTER_FIRST_PAINT"


def _load_page(target: str) -> Callable[..., QWidget]:
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


# What a notice from the engine (protocol "notices") is, in the title the user sees; the engine's line follows.
NOTICE_TITLES = {
    JOB_DATABASE_REBUILT: "Job list rebuilt from the job folders",
    JOBS_PUT_BACK: "Jobs put back into the job list",
    TELEMETRY_RESET: "GPU history started afresh",
}


class Pages(Mapping[str, QWidget]):
    """The window's pages by key, each built by `build(key)` the first time it is asked for."""

    def __init__(self, build: Callable[[str], QWidget]):
        self._build = build
        self.built: dict[str, QWidget] = {}  # in the order they were built

    @overload
    def __getitem__(self, key: Literal["dashboard"]) -> DashboardPage: ...
    @overload
    def __getitem__(self, key: Literal["topology"]) -> TopologyPage: ...
    @overload
    def __getitem__(self, key: Literal["planner"]) -> PlannerPage: ...
    @overload
    def __getitem__(self, key: Literal["jobs"]) -> JobsPage: ...
    @overload
    def __getitem__(self, key: Literal["serving"]) -> ServingPage: ...
    @overload
    def __getitem__(self, key: Literal["settings"]) -> SettingsPage: ...
    @overload
    def __getitem__(self, key: str) -> QWidget: ...

    def __getitem__(self, key: str) -> QWidget:
        page = self.built.get(key)
        if page is None:
            if key not in _KEYS:
                raise KeyError(key)
            page = self.built[key] = self._build(key)
        return page

    def __iter__(self) -> Iterator[str]:
        return iter(_KEYS)

    def __len__(self) -> int:
        return len(_KEYS)


def _banner(name: str, status: style.Status) -> QLabel:
    """A hidden full-width line of bold text across the top of the window (simulated machine, engine gone)."""
    label = QLabel()
    label.setObjectName(name)
    label.setWordWrap(True)
    font = label.font()
    font.setBold(True)
    label.setFont(font)
    style.set_banner(label, status)
    label.hide()
    return label


class MainWindow(QMainWindow):
    def __init__(self, link: EngineLink | None = None):
        super().__init__()
        # Here rather than in main(): every way of opening the window (the app, screenshots, tests) follows a theme.
        app = QApplication.instance()
        if isinstance(app, QApplication):
            style.install(app)
        self.setWindowTitle(APP_NAME)
        self.setWindowIcon(QIcon.fromTheme(APP_ID))
        self.link = link or EngineLink()
        self.settings = QSettings()
        self.jobs: dict[str, dict[str, Any]] = {}
        self.send_notification: Callable[[desktop_notify.Notification], bool] = desktop_notify.send
        self._asked_on_close = False
        self._exit_after_first_paint = os.environ.get(EXIT_AFTER_FIRST_PAINT) == "1"
        self._painted = False

        self.banner = _banner("simulatedBanner", "warn")
        # Rigpilot uninstalled under the open window (EngineLink's GONE): one line, and no more reconnecting.
        self.gone_bar = _banner("engineGoneBanner", "bad")
        # What the engine did by itself (a job list rebuilt from the job folders): told once, so it stays
        # on screen until the user has read it and dismisses it.
        self.notice_text = QLabel()
        self.notice_text.setObjectName("engineNotice")
        self.notice_text.setWordWrap(True)
        self.notice_text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        dismiss = QPushButton("Dismiss")
        set_icon(dismiss, "dismiss")
        dismiss.setObjectName("dismissNotice")
        self.notice_bar = QFrame()
        self.notice_bar.setObjectName("noticeBar")
        style.set_banner(self.notice_bar, "info")
        notice_row = QHBoxLayout(self.notice_bar)
        notice_row.setContentsMargins(10, 4, 10, 4)
        notice_row.addWidget(self.notice_text, 1)
        notice_row.addWidget(dismiss)
        dismiss.clicked.connect(self._dismiss_notices)
        self.notice_bar.hide()

        self.nav = QListWidget()
        self.nav.setObjectName("navigation")
        self.nav.setMinimumWidth(110)
        self.nav.setIconSize(QSize(18, 18))
        style.style_navigation(self.nav)
        self.stack = QStackedWidget()
        # Only the page on screen is built before the first frame; the others after it (one per turn of the
        # event loop, see _build_next_page), or at once when the user asks for one first.
        self.pages = Pages(self._build_page)
        for key, title, _ in PAGES:
            placeholder = QWidget()
            placeholder.setObjectName(f"placeholder-{key}")
            self.stack.addWidget(placeholder)
            item = QListWidgetItem(icon(key), title)
            item.setData(Qt.ItemDataRole.UserRole, key)
            self.nav.addItem(item)
        self.nav.currentRowChanged.connect(self._show_row)

        rail = QWidget()
        rail.setObjectName("navigationRail")
        style.set_surface(rail, "rail")
        rail_layout = QVBoxLayout(rail)
        rail_layout.setContentsMargins(6, 6, 6, 6)
        rail_layout.setSpacing(6)
        rail_layout.addWidget(self.nav, 1)
        self.splitter = QSplitter()
        self.splitter.addWidget(rail)
        self.splitter.addWidget(self.stack)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setCollapsible(0, False)
        self.splitter.setSizes([150, 1130])
        central = QWidget()
        layout = QVBoxLayout(central)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        layout.addWidget(self.gone_bar)
        layout.addWidget(self.banner)
        layout.addWidget(self.notice_bar)
        layout.addWidget(self.splitter, 1)
        self.setCentralWidget(central)

        self.connection_label = QLabel("Engine: connecting…")
        self.machine_label = QLabel("")
        self.statusBar().addWidget(self.connection_label)
        self.statusBar().addPermanentWidget(self.machine_label)
        tasks.set_error_sink(lambda e: self.statusBar().showMessage(f"Error: {e}", 10000))

        self.wizard: QWidget | None = None  # the last wizard "New job…" opened
        self.new_job_action = QAction(icon("new-job"), "&New job…", self)
        self.new_job_action.setObjectName("newJob")
        self.new_job_action.setIconText("New job…")  # a tool button would drop the "…" of the text
        self.new_job_action.setShortcut(QKeySequence.StandardKey.New)
        self.new_job_action.setStatusTip("Open the job wizard: train, fine-tune, infer, run a script or calibrate")
        # A window-wide shortcut: it works on every page, whichever widget has the focus.
        self.new_job_action.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
        self.new_job_action.triggered.connect(self.new_job)
        self.addAction(self.new_job_action)
        # On top of the navigation rather than in a menu bar or toolbar: in view on every page, and no height
        # taken from them (the window fits 650 px high with the simulated banner shown).
        self.new_job_button = QToolButton()
        self.new_job_button.setObjectName("newJobButton")
        self.new_job_button.setDefaultAction(self.new_job_action)
        self.new_job_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.new_job_button.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.new_job_button.setToolTip("Open the job wizard (Ctrl+N)")
        style.mark_primary(self.new_job_button)
        rail_layout.insertWidget(0, self.new_job_button)

        for i, (key, _, _) in enumerate(PAGES):
            action = QAction(self)
            action.setShortcut(QKeySequence(f"Ctrl+{i + 1}"))
            action.triggered.connect(lambda _=False, k=key: self.show_page(k))
            self.addAction(action)

        self._build_tray()
        self.link.sig_state.connect(self._on_state)
        self.link.sig_machine.connect(self._on_machine)
        self.link.sig_job.connect(self._on_job)
        self.link.sig_notice.connect(self._on_notice)
        self._restore()
        self.link.start()
        # The job list is not pushed on connect; ask once connected, and again after each reconnect.
        self._refresh_jobs_timer = QTimer(self, singleShot=True, interval=0)
        self._refresh_jobs_timer.timeout.connect(self._refresh_jobs)

    # -- pages ----------------------------------------------------------------------
    def _build_page(self, key: str) -> QWidget:
        index = _KEYS.index(key)
        page = _load_page(PAGES[index][2])(self.link)
        page.setObjectName(f"page-{key}")
        placeholder = self.stack.widget(index)
        self.stack.insertWidget(index, page)
        if placeholder is not None:
            self.stack.removeWidget(placeholder)
            placeholder.deleteLater()
        # One list of imported machines for the two pages that show them; "Plan for this machine" opens the Planner.
        if key == "planner":
            cast("PlannerPage", page).use_machines(self.pages["topology"].machines)
        elif key == "topology":
            cast("TopologyPage", page).sig_plan_for_machine.connect(
                lambda k: self.show_page("planner").select_machine(k, plan=True)
            )
        elif key == "dashboard":  # the machine-check card opens Settings → Check this machine
            cast("DashboardPage", page).sig_open_machine_check.connect(
                lambda start: self.show_page("settings").show_machine_check(start)
            )
        elif key == "jobs":
            jobs = cast("JobsPage", page)
            jobs.sig_plan_model.connect(self.plan_model)  # "Plan from this model" opens the Planner
            jobs.sig_serving.connect(self.show_served)  # "Serve" opens the Serving page on the new server
        restore = getattr(page, "restore_state", None)
        if restore is not None:
            restore(self.settings, f"pages/{key}")
        return page

    def _build_next_page(self) -> None:
        """Import or build one page not built yet, then come back for the next once the events waiting meanwhile
        ran: importing a page's modules and building it are separate turns, so the window never stalls for both."""
        target = next(((k, t) for k, _, t in PAGES if k not in self.pages.built), None)
        if target is None:
            return
        key, module = target[0], target[1].split(":")[0]
        if module in sys.modules:
            self.pages[key]
        else:
            importlib.import_module(module)
        QTimer.singleShot(0, self, self._build_next_page)  # with the window as context: none after it is deleted

    def _show_row(self, row: int) -> None:
        if row >= 0:
            self.pages[PAGES[row][0]]  # built before it is shown: never a frame of an empty page
            self.stack.setCurrentIndex(row)

    # -- navigation -----------------------------------------------------------------
    @overload
    def show_page(self, key: Literal["dashboard"]) -> DashboardPage: ...
    @overload
    def show_page(self, key: Literal["topology"]) -> TopologyPage: ...
    @overload
    def show_page(self, key: Literal["planner"]) -> PlannerPage: ...
    @overload
    def show_page(self, key: Literal["jobs"]) -> JobsPage: ...
    @overload
    def show_page(self, key: Literal["serving"]) -> ServingPage: ...
    @overload
    def show_page(self, key: Literal["settings"]) -> SettingsPage: ...
    @overload
    def show_page(self, key: str) -> QWidget: ...

    def show_page(self, key: str) -> QWidget:
        keys = [k for k, _, _ in PAGES]
        self.nav.setCurrentRow(keys.index(key))
        return self.pages[key]

    def plan_model(self, model: str) -> None:
        self.show_page("planner").picker.set_model(model)  # a deliberate pick: the Planner plans it at once

    def show_served(self, job_id: str) -> None:
        self.show_page("serving").select_job(job_id)

    def current_page_key(self) -> str:
        return PAGES[max(self.nav.currentRow(), 0)][0]

    def new_job(self) -> QWidget:
        """Open the job wizard (or bring the open one to the front); Launch lands on the new job's page."""
        if self.wizard is not None and self.wizard.isVisible():
            self.wizard.raise_()
            self.wizard.activateWindow()
            return self.wizard
        if self.wizard is not None:
            self.wizard.deleteLater()  # closed: its choices are remembered in the settings
        # Imported on first use: the wizard's modules are not needed to paint the first frame.
        from rigpilot.app.wizard.wizard import open_wizard

        self.wizard = open_wizard(self.link, self)
        return self.wizard

    # -- engine state -----------------------------------------------------------------
    def _on_state(self, state: str, detail: str) -> None:
        if state == CONNECTED:
            self.connection_label.setText(f"Engine: connected ({detail})")
            self._refresh_jobs_timer.start()
        elif state == CONNECTING:
            self.connection_label.setText(f"Engine: connecting ({detail})…")
        elif state == GONE:
            self.connection_label.setText("Engine: gone (Rigpilot was removed)")
            self.gone_bar.setText(
                "Rigpilot was removed from this computer: its engine service is gone and cannot start again. "
                "Close this window; your jobs and settings in your home folder are kept."
            )
            self.gone_bar.setToolTip(detail)
            self.gone_bar.show()
        else:
            self.connection_label.setText(f"Engine: connection lost ({detail}); reconnecting…")

    def _on_machine(self, machine: dict) -> None:
        label = machine.get("label", "")
        self.machine_label.setText(label)
        self.setWindowTitle(f"{APP_NAME} — {label}")
        if is_simulated(machine):
            # Plain sentences for the user; the driver's own words (link.details) in the tooltip.
            self.banner.setText(
                f"Simulated machine: {label.removeprefix('simulated: ')}. Jobs run on this computer's CPU, one "
                "process per simulated GPU. " + " ".join(self.link.notes)
            )
            self.banner.setToolTip("\n".join(getattr(self.link, "details", [])))
            self.banner.show()
        else:
            self.banner.hide()

    def _refresh_jobs(self) -> None:
        self.link.call("jobs", on_done=self._on_jobs, on_error=lambda e: None)

    def _on_jobs(self, result: dict) -> None:
        self.jobs = {j["id"]: j for j in result.get("jobs", [])}
        self._update_tray()

    def _on_job(self, job: dict) -> None:
        before = self.jobs.get(job["id"])
        self.jobs[job["id"]] = job
        self._update_tray()
        note = desktop_notify.notification_for(job, before)
        if note is not None:
            self._notify(note)

    def _notify(self, note: desktop_notify.Notification) -> None:
        """A popup only for a user looking elsewhere; one looking at the window sees the job change in place."""
        if not self.isActiveWindow() and desktop_notify.enabled(self.settings):
            if self.send_notification(note):
                return
            if self.tray is not None and self.tray.supportsMessages():  # no notification service: the tray's balloon
                kind = QSystemTrayIcon.MessageIcon
                icon = kind.Critical if note.urgency == 2 else kind.Information
                self.tray.showMessage(note.title, note.body, icon, desktop_notify.EXPIRE_MS)
                return
        self.statusBar().showMessage(f"{note.title}: {note.body}", 15000)

    def _on_notice(self, notice: dict) -> None:
        title = NOTICE_TITLES.get(str(notice.get("code")), "The engine service says")
        line = f"<b>{escape(title)}:</b> {escape(str(notice.get('message') or ''))}"
        shown = self.notice_text.text() if not self.notice_bar.isHidden() else ""  # the window may be in the tray
        self.notice_text.setText(f"{shown}<br>{line}" if shown else line)
        self.notice_bar.show()

    def _dismiss_notices(self) -> None:
        self.notice_bar.hide()
        self.notice_text.clear()

    def running_jobs(self) -> list[dict]:
        return [j for j in self.jobs.values() if j.get("state") in RUNNING_STATES]

    # -- tray ----------------------------------------------------------------------
    def _build_tray(self) -> None:
        self.tray: QSystemTrayIcon | None = None
        if not QSystemTrayIcon.isSystemTrayAvailable():
            return
        self.tray = QSystemTrayIcon(self.windowIcon(), self)
        menu = QMenu(self)
        menu.addAction("Show Rigpilot", self._raise)
        menu.addAction("Quit", QApplication.quit)
        self.tray.setContextMenu(menu)
        self.tray.activated.connect(lambda *_: self._raise())
        self._update_tray()
        self.tray.show()

    def _update_tray(self) -> None:
        n = len(self.running_jobs())
        text = f"{APP_NAME}: {n} job{'s' if n != 1 else ''} running" if n else f"{APP_NAME}: no jobs running"
        if self.tray is not None:
            self.tray.setToolTip(text)

    def _raise(self) -> None:
        self.showNormal()
        self.raise_()
        self.activateWindow()

    # -- start-up measurement ------------------------------------------------------------
    def paintEvent(self, event: QPaintEvent) -> None:
        super().paintEvent(event)
        if not self._painted:
            self._painted = True
            # Mapped, so the window manager's frame is known: a title bar taller than allowed for is not cut off.
            QTimer.singleShot(0, self, lambda: keep_on_screen(self))
            if self._exit_after_first_paint:
                QTimer.singleShot(0, self._first_frame_done)  # runs once the children of this frame are painted too
            else:
                QTimer.singleShot(0, self, self._build_next_page)

    def _first_frame_done(self) -> None:
        # The process's CPU seconds so far too: on a busy machine they grow much less than the wall time.
        print(f"first-paint {time.time():.6f} {time.process_time():.6f}", flush=True)
        self.link.stop()
        QApplication.quit()

    # -- persistence ---------------------------------------------------------------
    def _restore(self) -> None:
        geometry = self.settings.value("window/geometry")
        if geometry is not None:
            self.restoreGeometry(geometry)
        else:
            self.resize(first_size(self.screen()))
        splitter = self.settings.value("window/splitter")
        if splitter is not None:
            self.splitter.restoreState(splitter)
        keys = [k for k, _, _ in PAGES]
        last = self.settings.value("window/page", "dashboard")
        row = keys.index(last) if last in keys else 0
        self.nav.setCurrentRow(row)
        self._show_row(row)  # builds that page (and restores its state); row 0 may be current already

    def save_state(self) -> None:
        self.settings.setValue("window/geometry", self.saveGeometry())
        self.settings.setValue("window/splitter", self.splitter.saveState())
        self.settings.setValue("window/page", self.current_page_key())
        for key, page in self.pages.built.items():  # a page never built has nothing new to save
            save = getattr(page, "save_state", None)
            if save is not None:
                save(self.settings, f"pages/{key}")
        self.settings.sync()

    def closeEvent(self, event: QCloseEvent) -> None:
        running = self.running_jobs()
        if running and not self._asked_on_close:
            self._asked_on_close = True
            box = QMessageBox(self)
            box.setIcon(QMessageBox.Icon.Question)
            box.setWindowTitle("Jobs are running")
            n = len(running)
            box.setText(f"{n} job{'s are' if n > 1 else ' is'} running. Keep {'them' if n > 1 else 'it'} running in the background?")
            box.setInformativeText("The engine service keeps running jobs when the window closes; reopen Rigpilot to see them.")
            keep = box.addButton("Keep running", QMessageBox.ButtonRole.AcceptRole)
            stop = box.addButton("Stop jobs", QMessageBox.ButtonRole.DestructiveRole)
            cancel = box.addButton(QMessageBox.StandardButton.Cancel)
            box.setDefaultButton(keep)
            box.exec()
            if box.clickedButton() is cancel:
                self._asked_on_close = False
                event.ignore()
                return
            if box.clickedButton() is stop:
                for job in running:
                    self.link.call("cancel", job=job["id"], on_error=lambda e: None)
        self.save_state()
        self.link.stop()
        if self.tray is not None:
            self.tray.hide()
        event.accept()
