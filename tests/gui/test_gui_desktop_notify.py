"""Desktop notifications (app.desktop_notify): when the window pops one up and with what words, and the real
thing: a Notify call reaching a freedesktop Notifications service on a private session bus."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtWidgets import QWidget

from rigpilot.app import desktop_notify
from rigpilot.app.main_window import MainWindow

from support.gui_fakes import FakeLink, make_job
from support.waiting import wait_for


def test_a_job_that_ends_while_the_user_looks_elsewhere_pops_up_once(qtbot):
    link = FakeLink("4x-rtx4090", jobs=[make_job("job-1"), make_job("job-2"), make_job("job-3")])
    w = MainWindow(link)
    qtbot.addWidget(w)
    sent: list[desktop_notify.Notification] = []
    w.send_notification = lambda note: sent.append(note) or True
    w.show()
    link.connect_engine()
    qtbot.waitUntil(lambda: len(w.jobs) == 3)
    elsewhere = QWidget()
    qtbot.addWidget(elsewhere)
    elsewhere.show()
    elsewhere.activateWindow()
    qtbot.waitUntil(lambda: not w.isActiveWindow())

    failed = {**make_job("job-1"), "state": "failed", "exit_reason": "rank 1 exited with code 1"}
    link.sig_job.emit(failed)
    link.sig_job.emit(failed)  # told again (a rename, the report kept): no second popup
    link.sig_job.emit({**make_job("job-2"), "state": "cancelled"})  # the user's own doing
    assert [(n.event, n.title, n.body, n.urgency) for n in sent] == [
        ("failed", "finetune failed", "Job finetune (job-1) failed: rank 1 exited with code 1", 2)
    ]

    w.activateWindow()  # a user looking at the window sees it in place: the status bar, no popup
    qtbot.waitUntil(w.isActiveWindow)
    link.sig_job.emit({**make_job("job-3"), "state": "completed"})
    assert len(sent) == 1 and w.statusBar().currentMessage() == "finetune completed: Job finetune (job-3) completed."

    desktop_notify.save_enabled(False)  # Settings → Display, unticked
    elsewhere.activateWindow()
    qtbot.waitUntil(lambda: not w.isActiveWindow())
    link.sig_job.emit({**make_job("job-4"), "state": "running"})
    link.sig_job.emit({**make_job("job-4"), "state": "completed"})
    assert len(sent) == 1 and "job-4" in w.statusBar().currentMessage()


def test_the_settings_checkbox_keeps_the_choice_at_once(qtbot):
    from rigpilot.app.settings.page import SettingsPage

    page = SettingsPage(FakeLink("4x-rtx4090"))
    qtbot.addWidget(page)
    assert page.desktop_notifications.isChecked() and desktop_notify.enabled()
    page.desktop_notifications.setChecked(False)
    assert not desktop_notify.enabled()


def test_no_session_bus_means_no_notification_command(tmp_path):
    assert not desktop_notify.has_session_bus({})
    assert not desktop_notify.has_session_bus({"XDG_RUNTIME_DIR": str(tmp_path)})
    (tmp_path / "bus").touch()
    assert desktop_notify.has_session_bus({"XDG_RUNTIME_DIR": str(tmp_path)})
    note = desktop_notify.Notification("completed", "a completed", "Job a (ab12cd) completed.", 1)
    assert desktop_notify.command_for(note, lambda name: None) is None
    assert desktop_notify.command_for(note, lambda name: f"/usr/bin/{name}" if name == "notify-send" else None) == [
        "/usr/bin/notify-send", "--app-name=Rigpilot", f"--icon={desktop_notify.ICON}", "--urgency=normal", "--",
        "a completed", "Job a (ab12cd) completed.",
    ]  # fmt: skip


@pytest.mark.skipif(not (shutil.which("dbus-daemon") and shutil.which("gdbus")), reason="needs dbus-daemon and gdbus")
def test_a_notification_reaches_the_notifications_service_on_the_session_bus(tmp_path, monkeypatch):
    bus = subprocess.Popen(
        ["dbus-daemon", "--session", "--nofork", "--print-address=1", f"--address=unix:path={tmp_path / 'bus'}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    service = None
    try:
        address = bus.stdout.readline().strip()
        assert address.startswith("unix:")
        monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", address)
        fake = Path(__file__).parent.parent / "support" / "fake_notifications.py"
        service = subprocess.Popen([sys.executable, str(fake)], stdout=subprocess.PIPE, text=True,
                                   env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})  # fmt: skip
        assert service.stdout.readline().strip() == "ready"
        note = desktop_notify.Notification("failed", 'it\'s "done" failed', "Job x (ab12cd) failed: 'rank' 1\\n", 2)
        assert desktop_notify.send(note)
        got = json.loads(wait_for(service.stdout.readline, 20, 0.05, "the Notify call"))
        assert got == {
            "app_name": "Rigpilot", "replaces_id": 0, "icon": desktop_notify.ICON, "summary": note.title,
            "body": note.body, "actions": [], "hints": {"urgency": 2}, "expire_ms": desktop_notify.EXPIRE_MS,
        }  # fmt: skip
    finally:
        for p in (service, bus):
            if p is not None:
                p.terminate()
                p.wait(10)
