"""The main window: pages, the simulated banner, the status bar, persistence and closing with jobs running."""

import os
import subprocess
import sys

import pytest
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QApplication, QMessageBox, QPushButton

from rigpilot.app.main_window import PAGES, MainWindow
from rigpilot.engine.hardware.simulated import list_profiles

from support.gui_fakes import FakeLink, make_job


def open_window(qtbot, link):
    w = MainWindow(link)
    qtbot.addWidget(w)
    w.show()
    link.connect_engine()
    qtbot.waitUntil(lambda: w.machine_label.text() != "")
    return w


@pytest.mark.parametrize("profile", [p["id"] for p in list_profiles()])
def test_every_page_renders_for_every_profile(qtbot, profile):
    link = FakeLink(profile)
    w = open_window(qtbot, link)
    assert w.banner.isVisible() and w.banner.text().startswith("Simulated machine: ")
    assert w.machine_label.text() == link.machine_obj.label
    assert w.windowTitle().endswith(link.machine_obj.label)
    assert w.connection_label.text() == "Engine: connected (local)"
    for i, (key, _, _) in enumerate(PAGES):
        w.nav.setCurrentRow(i)
        qtbot.waitUntil(lambda k=key: w.stack.currentWidget() is w.pages[k])
        w.pages[key].grab()  # paints the page: a broken paint shows as an exception or a Qt warning
    w.close()


def test_connection_states_show_in_the_status_bar(qtbot):
    link = FakeLink("1x-rtx4090")
    w = open_window(qtbot, link)
    link.lose_engine("engine went away")
    qtbot.waitUntil(lambda: "connection lost" in w.connection_label.text())
    assert "engine went away" in w.connection_label.text()
    link.connect_engine()
    qtbot.waitUntil(lambda: w.connection_label.text() == "Engine: connected (local)")
    w.close()


def test_a_notice_from_the_engine_is_shown_with_a_title_worded_from_its_code(qtbot):
    link = FakeLink("1x-rtx4090")
    w = open_window(qtbot, link)
    assert not w.notice_bar.isVisible()
    message = "the job database /x/engine.db could not be used (not a database); the list of 3 jobs was rebuilt"
    link.sig_notice.emit({"code": "job_database_rebuilt", "message": message, "time": 1.0})
    link.sig_notice.emit({"code": "telemetry_reset", "message": "the telemetry history <x> was reset", "time": 2.0})
    assert w.notice_bar.isVisible()
    shown = w.notice_text.text()
    assert f"<b>Job list rebuilt from the job folders:</b> {message}" in shown
    assert "<b>GPU history started afresh:</b> the telemetry history &lt;x&gt; was reset" in shown
    w.findChild(QPushButton, "dismissNotice").click()
    assert not w.notice_bar.isVisible() and w.notice_text.text() == ""
    w.close()


def test_shortcuts_switch_pages(qtbot):
    w = open_window(qtbot, FakeLink("4x-rtx4090"))
    w.activateWindow()
    qtbot.waitUntil(w.isActiveWindow)
    qtbot.keyClick(w, Qt.Key.Key_4, Qt.KeyboardModifier.ControlModifier)
    assert w.current_page_key() == "jobs"
    qtbot.keyClick(w, Qt.Key.Key_2, Qt.KeyboardModifier.ControlModifier)
    assert w.current_page_key() == "topology"
    w.close()


def test_geometry_and_last_page_persist(qtbot):
    w = open_window(qtbot, FakeLink("4x-rtx4090"))
    w.show_page("topology")
    w.resize(900, 650)
    w.close()
    again = open_window(qtbot, FakeLink("4x-rtx4090"))
    assert again.current_page_key() == "topology"
    # The offscreen screen is 800 pixels wide and Qt fits restored windows to it; heights are kept.
    assert again.height() == 650
    again.close()


def _answer_close_dialog(button_text: str):
    def answer():
        box = QApplication.activeModalWidget()
        if not isinstance(box, QMessageBox):
            QTimer.singleShot(20, answer)
            return
        next(b for b in box.buttons() if b.text() == button_text).click()

    QTimer.singleShot(20, answer)


def test_closing_with_running_jobs_asks_and_keeps_them_by_default(qtbot):
    link = FakeLink("4x-rtx4090", jobs=[make_job("job-1", [0, 1], "running")])
    w = open_window(qtbot, link)
    qtbot.waitUntil(lambda: len(w.running_jobs()) == 1)
    assert "1 job running" in w.tray.toolTip() if w.tray else True
    _answer_close_dialog("Keep running")
    assert w.close()
    assert not link.requests("cancel")


def test_closing_and_choosing_stop_cancels_the_running_jobs(qtbot):
    link = FakeLink("4x-rtx4090", jobs=[make_job("job-1", [0], "running"), make_job("job-2", [1], "completed")])
    link.replies["cancel"] = lambda job, **_: {"job": {"id": job, "state": "cancelled"}}
    w = open_window(qtbot, link)
    qtbot.waitUntil(lambda: len(w.running_jobs()) == 1)
    _answer_close_dialog("Stop jobs")
    assert w.close()
    qtbot.waitUntil(lambda: len(link.requests("cancel")) == 1)
    assert link.requests("cancel")[0]["job"] == "job-1"


def test_without_a_display_the_app_says_so_in_one_line():
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    r = subprocess.run([sys.executable, "-m", "rigpilot.app.launcher"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0
    assert "no display found" in r.stderr and "rigpilot watch" in r.stderr


def test_ctrl_n_opens_the_wizard_from_every_page_and_launch_lands_on_the_job(qtbot):
    from rigpilot.app.wizard.wizard import JobWizard

    from support.gui_fakes import accept_submissions

    link = FakeLink("4x-rtx4090")
    w = open_window(qtbot, link)
    assert w.new_job_action.shortcut().toString() == "Ctrl+N"
    assert w.new_job_button.defaultAction() is w.new_job_action and w.new_job_button.isVisible()
    for key, _, _ in PAGES:
        w.show_page(key)
        w.activateWindow()
        qtbot.waitUntil(w.isActiveWindow)
        w.pages[key].focusNextChild()  # wherever the focus is on the page
        qtbot.keyClick(QApplication.focusWidget() or w, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
        qtbot.waitUntil(lambda: w.wizard is not None and w.wizard.isVisible())
        assert isinstance(w.wizard, JobWizard) and w.wizard.link is link
        again = w.wizard
        raised = []
        again.raise_ = lambda r=raised: r.append(True)  # the offscreen platform warns on a real raise()
        w.new_job_action.trigger()
        assert raised
        assert w.wizard is again  # one wizard at a time: the open one comes to the front
        again.close()

    submitted = accept_submissions(link)
    wizard = w.new_job()
    wizard.submit(lambda job_id: None, lambda message: None)
    qtbot.waitUntil(lambda: w.current_page_key() == "jobs")
    assert len(submitted) == 1 and w.pages["jobs"].current_job_id == "job-new"
    w.close()
