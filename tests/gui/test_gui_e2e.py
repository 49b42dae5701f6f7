"""The app end to end: the real window and EngineLink against a real engine service running real CPU ranks.

The service runs in a subprocess on a simulated 4×RTX 4090, with its XDG folders (and the app's QSettings)
in tmp_path. The job wizard submits its defaults (the shipped tiny example: tiny-llama trained from scratch
on Shakespeare, two CPU ranks); the Jobs page follows the job to the end and draws a falling loss. The
window closes while a second job runs ("Keep running" in its question); a new window and link still list
the first job as completed with its whole metric history, and hear the second one finish.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PySide6.QtCore import QTimer
from PySide6.QtGui import QImage
from PySide6.QtWidgets import QApplication, QMessageBox

from rigpilot.app.engine_link import CONNECTED, EngineLink
from rigpilot.app.main_window import MainWindow
from rigpilot.app.screenshots import SIZE
from rigpilot.app.wizard.page_base import LAUNCH
from rigpilot.app.wizard.state import examples_present
from rigpilot.app.wizard.wizard import JobWizard
from rigpilot.engine.api.client import EngineClient

from support.engine import Engine, engine_home, leftover_job_processes
from support.gui_fakes import fail_on_qt_warnings, isolated_config
from support.paths import REPO

JOB_TIMEOUT_MS = 75_000
# A job that runs until its gate file appears: the one still running when the window closes.
GATED_SCRIPT = """
import pathlib, sys, time
from rigpilot import report
gate = pathlib.Path(sys.argv[1])
step = 0
while not gate.exists() and step < 900:
    report(step=step, loss=1.0)
    step += 1
    time.sleep(0.1)
"""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not examples_present() or not (REPO / "engine" / "workers" / "__main__.py").exists(),
        reason="the shipped tiny example or the workers are missing from this checkout",
    ),
]


@pytest.fixture(autouse=True)
def no_qt_warnings():
    yield from fail_on_qt_warnings()


@pytest.fixture
def engine(tmp_path, monkeypatch):
    """A real engine service with its folders (and the app's settings) in tmp_path; stopped afterwards."""
    engine_home(tmp_path, monkeypatch)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = isolated_config(tmp_path, monkeypatch)  # XDG_CONFIG_HOME, XDG_STATE_HOME and QSettings
    next(config)
    e = Engine(tmp_path)
    try:
        e.start("--telemetry-period", "0.5")
        yield e
    finally:
        e.stop()
        for p in leftover_job_processes(tmp_path):  # never leave a rank behind, whatever failed
            p.kill()
        config.close()


def open_window(qtbot) -> MainWindow:
    window = MainWindow(EngineLink())
    qtbot.addWidget(window)
    window.show()
    # The link's state changes on its own thread; wait until the GUI thread has shown the machine too.
    qtbot.waitUntil(lambda: window.link.state == CONNECTED and window.machine_label.text() != "", timeout=30_000)
    return window


def loss_curve(window: MainWindow) -> tuple[np.ndarray, np.ndarray]:
    x, y = window.pages["jobs"].detail.charts.loss_raw.getData()
    return (np.empty(0), np.empty(0)) if x is None else (np.asarray(x), np.asarray(y))


def close_answering(qtbot, window: MainWindow, answer: str = "Keep running") -> list[str]:
    """Close `window`, pressing `answer` in the "Jobs are running" question if it comes; its texts, if it came."""
    asked: list[str] = []

    def press() -> None:
        box = QApplication.activeModalWidget()
        if isinstance(box, QMessageBox):
            asked.append(box.text())
            next(b for b in box.buttons() if b.text() == answer).click()
        elif window.isVisible():
            QTimer.singleShot(50, press)

    QTimer.singleShot(50, press)
    window.close()
    qtbot.waitUntil(lambda: not window.isVisible())
    return asked


def submit_gated_job(tmp_path: Path, gate: Path) -> str:
    script = tmp_path / "gated.py"
    script.write_text(GATED_SCRIPT)
    spec = {"kind": "script", "script": [str(script), str(gate)], "gpus": [2], "name": "gated"}
    with EngineClient(autostart=False, timeout=30) as c:
        return c.request("submit", spec=spec, cwd=str(tmp_path))["job"]["id"]


def test_wizard_job_runs_to_completion_and_survives_a_new_window(qtbot, engine, tmp_path):
    window = open_window(qtbot)
    assert window.banner.isVisible() and "simulated" in window.banner.text()

    # The wizard with its defaults, Next to the end: it submits and lands on the job.
    wizard = JobWizard(window.link, window)
    wizard.show()
    with qtbot.waitSignal(wizard.sig_submitted, timeout=60_000) as submitted:
        while wizard.currentId() != LAUNCH:
            page = wizard.currentPage()
            qtbot.waitUntil(lambda p=page: not p.busy, timeout=30_000)
            assert page.isComplete(), page.message.text()
            wizard.next()
    job_id = submitted.args[0]
    jobs = window.pages["jobs"]
    assert window.current_page_key() == "jobs" and jobs.current_job_id == job_id
    assert not wizard.isVisible()
    max_steps = wizard.state.train.max_steps

    # The Jobs page follows it to the end and draws every step's loss, falling.
    handle = jobs.current_handle
    qtbot.waitUntil(lambda: handle.state in ("completed", "failed", "cancelled"), timeout=JOB_TIMEOUT_MS)
    assert handle.state == "completed", (handle.record.get("exit_reason"), handle.record.get("last_log"))
    qtbot.waitUntil(lambda: len(loss_curve(window)[0]) == max_steps, timeout=15_000)
    steps, loss = loss_curve(window)
    assert steps.tolist() == list(range(1, max_steps + 1))
    assert np.isfinite(loss).all() and loss[-5:].mean() < loss[:5].mean()
    assert window.jobs[job_id]["state"] == "completed"
    assert jobs.model.job(job_id)["state"] == "completed"
    records = handle.series.records

    # Closing while another job runs asks whether to keep it running: yes.
    gate = tmp_path / "gate"
    gated = submit_gated_job(tmp_path, gate)
    qtbot.waitUntil(lambda: window.jobs.get(gated, {}).get("state") == "running", timeout=30_000)
    assert close_answering(qtbot, window, "Keep running") == ["1 job is running. Keep it running in the background?"]

    # A new window and link: the job is listed as completed, with its whole metric history.
    again = open_window(qtbot)
    assert again.current_page_key() == "jobs"  # the last page, remembered
    jobs2 = again.pages["jobs"]
    qtbot.waitUntil(lambda: (jobs2.model.job(job_id) or {}).get("state") == "completed", timeout=15_000)
    jobs2.open_job(job_id)
    qtbot.waitUntil(lambda: len(loss_curve(again)[0]) == max_steps, timeout=15_000)
    steps2, loss2 = loss_curve(again)
    assert steps2.tolist() == steps.tolist() and np.allclose(loss2, loss)
    assert jobs2.current_handle.series.records == records
    assert jobs2.current_handle.record["progress"]["step"] == max_steps

    # The job kept running while no window was open; it ends now, and the new window hears of it.
    assert jobs2.model.job(gated)["state"] == "running"
    gate.touch()
    qtbot.waitUntil(lambda: jobs2.model.job(gated)["state"] == "completed", timeout=30_000)
    assert close_answering(qtbot, again) == []  # nothing runs: nothing to ask


def test_first_paint_hook_prints_the_time_and_quits(engine, tmp_path):
    """What benchmarks/gui_startup.py measures with: the real `rigpilot` start, offscreen."""
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", RIGPILOT_EXIT_AFTER_FIRST_PAINT="1")
    start = time.time()
    r = subprocess.run([sys.executable, "-m", "rigpilot.app.launcher"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("first-paint ")]
    assert len(lines) == 1, r.stdout
    _, painted, cpu = lines[0].split()
    assert start < float(painted) < time.time()
    assert 0 < float(cpu) < time.time() - start + 5  # the process's CPU seconds up to the first frame


def test_screenshots_of_every_view_and_wizard_page(tmp_path):
    """`rigpilot --screenshots DIR` against its own engine, in its own folders (nothing of this test's)."""
    out = tmp_path / "shots"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "rigpilot.app.launcher", "--screenshots", str(out)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    names = {"dashboard", "topology", "planner", "jobs", "jobs-empty", "settings", "job-summary", "try-it",
             "wizard-task", "wizard-model", "wizard-data", "wizard-gpus", "wizard-plan", "wizard-hyper",
             "wizard-review", "wizard-launch"}  # fmt: skip
    for theme in ("light", "dark"):
        # The running job's page is shot only if the job is still running when the Jobs page opens it.
        assert {p.stem for p in (out / theme).glob("*.png")} - {"job-running"} == names, theme
        assert {str(out / theme / f"{n}.png") for n in names} <= set(r.stdout.splitlines())
    assert not list(out.glob("*.png"))
    for png in out.glob("*/*.png"):
        image = QImage(str(png))
        assert (image.width(), image.height()) == SIZE, png.name
    # The same moment in two themes: the dark picture is darker.
    light, dark = QImage(str(out / "light" / "settings.png")), QImage(str(out / "dark" / "settings.png"))
    x, y = SIZE[0] // 2, SIZE[1] - 5
    assert light.pixelColor(x, y).lightness() > dark.pixelColor(x, y).lightness()
    assert "propagateSizeHints" not in r.stderr


def test_screenshots_needs_a_folder():
    r = subprocess.run([sys.executable, "-m", "rigpilot.app.launcher", "--screenshots"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "usage: rigpilot --screenshots DIR" in r.stderr
    r = subprocess.run([sys.executable, "-m", "rigpilot.app.launcher", "--screenshots", "x", "--theme", "purple"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "[--theme light|dark]" in r.stderr
