"""`rigpilot --screenshots DIR [--theme light|dark]`: a PNG of every page and every job-wizard page, in the light
and the dark theme (DIR/light/*.png, DIR/dark/*.png; one theme with --theme), for the README and bug reports.

It runs offscreen against a real engine service on a simulated 4×RTX 4090, in
a throw-away set of XDG folders and Qt settings (the user's jobs, settings and
window state are never read or touched): it waits for live telemetry, shows
the empty Jobs page, opens the job wizard with New job… (Ctrl+N) and walks it
with its defaults (the shipped tiny example: train tiny-llama
from scratch on Shakespeare), takes the dashboard and topology while that job
runs, plans llama-2-7b on the Planner page, waits for the job to complete so
the Jobs page shows its loss curve, and saves every picture at the size the
main window opens at on a 1280×800 screen (1272×756: app/widgets/window_size.py). It
prints each file's path; it exits 1 naming what did not happen (pictures
taken until then are kept), and always stops the service it started.

Each moment is shot in every theme asked for (the theme is switched, the window redraws, it is grabbed),
so the two sets show the same data and one run makes both.

    rigpilot --screenshots docs/screenshots

It runs offscreen unless QT_QPA_PLATFORM is already set (xcb: a real X server, e.g. Xvfb with openbox).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rigpilot.app.widgets.window_size import small_screen_size

SIZE = (small_screen_size().width(), small_screen_size().height())
PROFILE = "4x-rtx4090"
TELEMETRY_PERIOD_S = "0.5"
START_TIMEOUT_S = 60.0
JOB_TIMEOUT_S = 300.0
PLAN_MODEL = "llama-2-7b"
# (page id name in app.wizard.page_base, file name)
WIZARD_SHOTS = [
    ("TASK", "wizard-task"), ("MODEL", "wizard-model"), ("DATA", "wizard-data"), ("GPUS", "wizard-gpus"),
    ("PLAN", "wizard-plan"), ("HYPER", "wizard-hyper"), ("REVIEW", "wizard-review"), ("LAUNCH", "wizard-launch"),
]  # fmt: skip


class ShotError(Exception):
    """Something the pictures need did not happen in time."""


def isolate(tmp: Path) -> dict[str, str]:
    """Point every per-user folder into `tmp` and pick the simulated machine; returns what was set."""
    run = tmp / "run"
    run.mkdir(mode=0o700, parents=True, exist_ok=True)
    env = {
        "XDG_RUNTIME_DIR": str(run),
        "XDG_STATE_HOME": str(tmp / "state"),
        "XDG_CONFIG_HOME": str(tmp / "config"),
        "XDG_DATA_HOME": str(tmp / "data"),
        "RIGPILOT_SIMULATE": PROFILE,
        "HF_HUB_OFFLINE": "1",  # the example model is local; never reach for the network
    }
    os.environ.update(env)
    return env


def start_engine(tmp: Path) -> subprocess.Popen:
    """The engine service for the pictures, with its log in `tmp`."""
    log = (tmp / "engine.log").open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "rigpilot.engine.service", "--simulate", PROFILE, "--telemetry-period", TELEMETRY_PERIOD_S],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=tmp, start_new_session=True,
    )  # fmt: skip


def wait_for_engine(proc: subprocess.Popen, log: Path) -> None:
    from rigpilot.engine.api.client import EngineClient

    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise ShotError(f"the engine service exited with {proc.returncode} (see {log})")
        try:
            with EngineClient(autostart=False, timeout=5) as c:
                if c.hello.get("pid") == proc.pid:
                    return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise ShotError(f"the engine service did not answer in {START_TIMEOUT_S:.0f} s (see {log})")
        time.sleep(0.1)


def stop_engine(proc: subprocess.Popen) -> None:
    from rigpilot.engine.api.client import EngineClient

    try:
        with EngineClient(autostart=False, timeout=10) as c:
            c.request("shutdown")
        proc.wait(15)
    except Exception:  # not answering: stop it the hard way
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def quiet_offscreen_messages() -> None:
    """The offscreen platform warns about every dialog it shows; the rest goes to stderr as usual."""
    from PySide6.QtCore import qInstallMessageHandler

    def handle(_kind: Any, _context: Any, message: str) -> None:
        if message != "This plugin does not support propagateSizeHints()":
            print(message, file=sys.stderr)

    qInstallMessageHandler(handle)


THEMES = ("light", "dark")


class Shooter:
    def __init__(self, app: Any, out: Path, themes: tuple[str, ...] = THEMES):
        self.app = app
        self.out = out
        self.themes = themes
        self.saved: list[Path] = []
        for theme in themes:
            (out / theme).mkdir(parents=True, exist_ok=True)

    def wait(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        from PySide6.QtCore import QEventLoop

        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise ShotError(f"no {what} after {timeout:.0f} s")
            self.app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 50)
            time.sleep(0.01)

    def settle(self, seconds: float) -> None:
        """Let timers (chart redraws) and replies run for a while."""
        end = time.monotonic() + seconds
        self.wait(lambda: time.monotonic() >= end, seconds + 5, "time passing")

    def shoot(self, widget: Any, name: str) -> list[Path]:
        """`name`.png in each theme's folder; the first theme is left applied."""
        paths = [self._grab(widget, name, theme) for theme in reversed(self.themes)]
        return paths[::-1]

    def _grab(self, widget: Any, name: str, theme: str) -> Path:
        from PySide6.QtCore import QSize

        from rigpilot.app.widgets.theme import apply_theme, parse_theme

        apply_theme(self.app, parse_theme(theme))
        self.settle(0.3)
        widget.resize(*SIZE)
        self.app.processEvents()
        pixmap = widget.grab()
        if pixmap.size() != QSize(*SIZE):  # a window the screen kept smaller, say
            pixmap = pixmap.scaled(*SIZE)
        path = self.out / theme / f"{name}.png"
        if not pixmap.toImage().save(str(path), "PNG", 0):  # 0: the smallest file zlib makes
            raise ShotError(f"could not write {path}")
        self.saved.append(path)
        print(path, flush=True)
        return path


def _on_page(wizard: Any, page_id: int) -> bool:
    return wizard.currentId() == page_id


def _answered(page: Any) -> bool:
    return not page.busy


def take(shooter: Shooter) -> None:
    from rigpilot.app.engine_link import CONNECTED, EngineLink
    from rigpilot.app.main_window import MainWindow
    from rigpilot.app.planner.model import PlanRequest
    from rigpilot.app.wizard import page_base

    window = MainWindow(EngineLink())
    window.resize(*SIZE)
    window.show()
    try:
        telemetry = {"n": 0}
        window.link.sig_telemetry.connect(lambda _: telemetry.update(n=telemetry["n"] + 1))
        shooter.wait(lambda: window.link.state == CONNECTED and window.link.machine, START_TIMEOUT_S,
                     "connection to the engine")  # fmt: skip
        shooter.wait(lambda: telemetry["n"] >= 4, 30, "live telemetry")

        # What a new user sees first on the Jobs page: no jobs, and the two ways to start one.
        window.show_page("jobs")
        shooter.shoot(window, "jobs-empty")

        # The wizard, page by page, with its defaults: it submits the tiny example job. It is opened as a user
        # does (New job…, Ctrl+N); its settings are the throw-away ones `main` set up.
        window.new_job_action.trigger()
        wizard = shooter.wait(lambda: window.wizard if window.wizard is not None and window.wizard.isVisible()
                              else None, 10, "job wizard after New job…")  # fmt: skip
        wizard.resize(*SIZE)
        submitted: list[str] = []
        failed: list[str] = []
        wizard.sig_submitted.connect(submitted.append)
        wizard.sig_submit_failed.connect(failed.append)
        for page_name, file_name in WIZARD_SHOTS:
            page_id = getattr(page_base, page_name)
            shooter.wait(functools.partial(_on_page, wizard, page_id), 10, f"wizard page {page_name}")
            page = wizard.currentPage()
            if page_id != page_base.LAUNCH:
                shooter.wait(functools.partial(_answered, page), 60, f"answer to the {page_name} page's check")
                if page_id == page_base.PLAN:
                    shooter.wait(lambda: wizard.state.plan is not None, 60, "plan on the wizard's Plan page")
                    shooter.settle(0.5)
            shooter.shoot(wizard, file_name)  # Launch: taken while it says "Submitting…"
            if page_id != page_base.LAUNCH:
                if not page.isComplete():
                    raise ShotError(f"the wizard's {page_name} page refused its defaults: {page.message.text()}")
                wizard.next()
        shooter.wait(lambda: submitted or failed, 30, "answer to the job's submission")
        if failed:
            raise ShotError(f"the engine refused the example job: {failed[0]}")
        job_id = submitted[0]

        def job_state() -> str | None:
            return (window.jobs.get(job_id) or {}).get("state")

        # Dashboard and topology while the job runs on two of the GPUs.
        window.show_page("dashboard")
        shooter.wait(lambda: job_state() in ("running", "completed", "failed"), 90, "job starting")
        # A few seconds of load on the job's GPUs, unless the job is over sooner.
        until = time.monotonic() + 4.0
        shooter.wait(lambda: time.monotonic() > until or job_state() != "running", 10, "load on the job's GPUs")
        shooter.shoot(window, "dashboard")
        window.show_page("topology")
        shooter.settle(1.0)
        shooter.shoot(window, "topology")

        planner = window.show_page("planner")
        ready: list[dict] = []
        planner.sig_plan_ready.connect(ready.append)
        planner.sig_plan_failed.connect(lambda text: ready.append({"error": text}))
        planner.set_request(PlanRequest(model=PLAN_MODEL, task="train", method="full", precision="bf16",
                                        seq_len=2048, batch=16, gpus=[0, 1, 2, 3]))  # fmt: skip
        planner.request_plan()
        shooter.wait(lambda: ready, 60, f"plan for {PLAN_MODEL}")
        if "error" in ready[0]:
            raise ShotError(f"the planner failed: {ready[0]['error']}")
        shooter.shoot(window, "planner")

        settings = window.show_page("settings")
        shooter.wait(lambda: settings.loaded, 30, "settings loading")
        shooter.shoot(window, "settings")

        jobs = window.show_page("jobs")
        jobs.open_job(job_id)
        if job_state() == "running":
            shooter.settle(2.0)
            shooter.shoot(window, "job-running")
        shooter.wait(lambda: job_state() in ("completed", "failed", "cancelled"), JOB_TIMEOUT_S, "end of the job")
        if job_state() != "completed":
            record = window.jobs.get(job_id) or {}
            raise ShotError(f"the example job {job_state()}: {record.get('exit_reason')}")
        steps = int(jobs.current_handle.record.get("progress", {}).get("step") or 1) if jobs.current_handle else 1

        def loss_points() -> int:
            x, _ = jobs.detail.charts.loss_raw.getData()
            return 0 if x is None else len(x)

        shooter.wait(lambda: loss_points() >= steps, 30, "loss curve on the Jobs page")
        jobs.refresh(force=True)
        shooter.shoot(window, "jobs")
        tabs = jobs.detail.tabs
        for title, name in (("Summary", "job-summary"), ("Try it", "try-it")):
            index = next((i for i in range(tabs.count()) if tabs.tabText(i).replace("&", "") == title), -1)
            if index < 0 or not tabs.isTabVisible(index):
                raise ShotError(f"no {title} tab on the finished job's page")
            tabs.setCurrentIndex(index)
            shooter.settle(0.5)
            shooter.shoot(window, name)
        tabs.setCurrentIndex(0)
        window.show_page("dashboard")
    finally:
        window.link.stop()
        window.hide()
        window.deleteLater()


def main(out: Path, themes: tuple[str, ...] = THEMES) -> int:
    # The same pictures on any desktop, and without one; a caller that sets a platform (xcb) gets it.
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="rigpilot-shots-"))
    isolate(tmp)
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from rigpilot.app.identity import APP_NAME, ORGANIZATION

    app = QApplication.instance() or QApplication([sys.argv[0]])
    app.setApplicationName(f"{APP_NAME}-screenshots")
    app.setOrganizationName(ORGANIZATION)
    for fmt in (QSettings.Format.NativeFormat, QSettings.Format.IniFormat):
        QSettings.setPath(fmt, QSettings.Scope.UserScope, str(tmp / "qt"))
    quiet_offscreen_messages()
    shooter = Shooter(app, out, themes)
    engine = start_engine(tmp)
    rc = 0
    try:
        wait_for_engine(engine, tmp / "engine.log")
        take(shooter)
    except ShotError as e:
        print(f"screenshots: {e}; engine log: {tmp / 'engine.log'}", file=sys.stderr)
        rc = 1
    finally:
        stop_engine(engine)
        app.processEvents()
    if rc == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"{len(shooter.saved)} screenshots in {out}")
    return rc
