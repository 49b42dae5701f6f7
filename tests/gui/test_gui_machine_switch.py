"""Settings → simulated machine → Save: the real engine switches and every page follows; Settings → Restart engine.

A real engine service (a subprocess, its XDG folders in tmp_path) and the real EngineLink: what is
tested is the path a user's click takes, through the socket and back as a pushed `machine` event.
"""

import json
import os
import subprocess
import sys

import psutil
import pytest

from rigpilot.app.engine_link import CONNECTED, EngineLink
from rigpilot.app.main_window import MainWindow
from rigpilot.app.settings.page import restart_consequences
from rigpilot.engine.api.client import EngineClient, service_running
from rigpilot.engine.hardware.discovery import open_backend
from rigpilot.engine.hardware.simulated import load_profile

from support.engine import GATE_SCRIPT, Engine, engine_home, gate, leftover_job_processes
from support.paths import REPO


@pytest.fixture
def engine(tmp_path, monkeypatch):
    engine_home(tmp_path, monkeypatch)
    monkeypatch.delenv("RIGPILOT_SIMULATE")  # follow Settings, as a user's engine does
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # an engine the GUI starts runs this checkout too
    if not open_backend().machine.simulated:
        pytest.skip("this computer has NVIDIA GPUs: the engine serves them, whatever the simulated profile")
    e = Engine(tmp_path)
    e.start()
    yield e
    e.stop()
    if service_running():  # one the GUI started (after a restart)
        with EngineClient(autostart=False) as c:
            pid = c.hello["pid"]
            c.request("shutdown")
        psutil.wait_procs([psutil.Process(pid)], timeout=20)
    for p in leftover_job_processes(tmp_path):
        p.kill()


@pytest.fixture
def window(qtbot, engine):
    w = MainWindow(EngineLink())
    qtbot.addWidget(w)
    w.show()
    qtbot.waitUntil(lambda: w.link.state == CONNECTED and len(w.pages["dashboard"].cards) == 4, timeout=20000)
    yield w
    w.link.stop()


def save_profile(qtbot, w: MainWindow, profile: str) -> None:
    page = w.show_page("settings")
    qtbot.waitUntil(lambda: page.loaded, timeout=10000)
    page.profile.setCurrentIndex(page.profile.findData(profile))
    with qtbot.waitSignal(page.sig_applied, timeout=20000):
        page.save_button.click()


def test_saving_a_profile_switches_every_page_and_the_cli(qtbot, window):
    w = window
    save_profile(qtbot, w, "8x-h100-sxm")
    settings = w.pages["settings"]
    label = load_profile("8x-h100-sxm").label
    assert settings.status.text() == f"Saved. The engine now serves {label}; every page shows it."
    qtbot.waitUntil(lambda: len(w.pages["dashboard"].cards) == 8, timeout=10000)
    topology = w.pages["topology"]
    assert topology.title.text() == label and len(topology.shown.gpus) == 8
    assert sorted(w.pages["planner"].gpus.boxes) == list(range(8))
    assert w.machine_label.text() == label and w.windowTitle().endswith(label)
    banner = w.banner.text()
    assert banner.startswith("Simulated machine: 8×H100 80GB HBM3. Jobs run on this computer's CPU")
    # Why there is no real GPU, in plain words; the driver's own message is kept for the tooltip.
    assert "so Rigpilot shows a simulated machine" in banner and "NVML" not in banner
    assert w.banner.toolTip().startswith("NVIDIA GPUs not used: ")
    # The command line, in its own process, sees the same machine.
    r = subprocess.run([sys.executable, "-m", "rigpilot.engine.cli", "gpus", "--json"], capture_output=True,
                       text=True, env=dict(os.environ), cwd=REPO, timeout=60)  # fmt: skip
    assert json.loads(r.stdout)["machine"]["label"] == label

    # And the other way: `rigpilot settings set` switches the engine, and the window follows, Settings too.
    r = subprocess.run([sys.executable, "-m", "rigpilot.engine.cli", "settings", "set", "simulated-profile",
                        "2x-rtx3090-nvlink"], capture_output=True, text=True, env=dict(os.environ), cwd=REPO,
                       timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    qtbot.waitUntil(lambda: len(w.pages["dashboard"].cards) == 2, timeout=10000)
    assert w.machine_label.text() == load_profile("2x-rtx3090-nvlink").label
    qtbot.waitUntil(lambda: settings.profile.currentData() == "2x-rtx3090-nvlink", timeout=10000)


@pytest.mark.slow
def test_a_running_job_keeps_the_machine_and_the_page_says_which(qtbot, window, engine):
    w = window
    script = engine.script("gate.py", GATE_SCRIPT)
    with engine.client() as c:
        job = engine.submit(c, script, str(gate(engine, "a")), gpus=[1], name="busy-one")
        engine.wait_state(c, job["id"], "running")
    page = w.show_page("settings")
    qtbot.waitUntil(lambda: page.loaded, timeout=10000)
    page.profile.setCurrentIndex(page.profile.findData("2x-rtx3090-nvlink"))
    with qtbot.waitSignal(page.sig_not_applied, timeout=20000) as why:
        page.save_button.click()
    assert f"{job['id']} 'busy-one' (running)" in why.args[0]
    to = load_profile("2x-rtx3090-nvlink").label
    assert page.status.text().startswith(f"Saved. The engine switches to {to} when its job ends ({job['id']})")
    assert len(w.pages["dashboard"].cards) == 4
    gate(engine, "a").touch()
    # Closing a window with a job running asks whether to keep it; let it end first.
    qtbot.waitUntil(lambda: not w.running_jobs(), timeout=60000)
    # The switch was kept for when the job ended: every page follows, and Settings says so.
    qtbot.waitUntil(lambda: len(w.pages["dashboard"].cards) == 2, timeout=30000)
    qtbot.waitUntil(lambda: page.status.text().startswith(f"The engine now serves {to}"), timeout=10000)


def test_restart_asks_then_restarts_and_the_window_reconnects(qtbot, window, engine, monkeypatch):
    w = window
    page = w.show_page("settings")
    asked: list[int | None] = []
    monkeypatch.setattr(page, "confirm_restart", lambda active: asked.append(active) or False)
    page.restart_button.click()
    qtbot.waitUntil(lambda: asked == [0], timeout=10000)
    assert engine.proc.poll() is None  # cancelled: nothing happened
    assert page.restart_button.isEnabled()

    monkeypatch.setattr(page, "confirm_restart", lambda active: True)
    old_pid = engine.proc.pid
    hellos: list[int] = []
    w.link.sig_hello.connect(lambda hello: hellos.append(hello["pid"]))
    with qtbot.waitSignal(page.sig_restarted, timeout=90000) as restarted:
        page.restart_button.click()
    new_pid = restarted.args[0]["pid"]
    assert new_pid != old_pid and engine.proc.poll() is not None
    assert page.status.text().startswith(f"Engine restarted (pid {new_pid}")
    # The window's own connection finds the new engine by itself.
    qtbot.waitUntil(lambda: new_pid in hellos and w.connection_label.text() == "Engine: connected (local)",
                    timeout=30000)  # fmt: skip


def test_the_restart_question_says_what_happens_to_jobs():
    assert restart_consequences(0).startswith("No job is queued or running.")
    two = restart_consequences(2)
    assert two.startswith("2 jobs are queued or running. They keep running") and "picks them up again" in two
    assert restart_consequences(1).startswith("1 job is queued or running. It keeps running: its processes")
    assert restart_consequences(None).startswith("Jobs keep running")
