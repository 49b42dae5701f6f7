"""The engine-environment dialog: the start-up check, install and repair with streamed progress, Stop and Resume.

No real install runs here: the dialog is pointed at a small Python script that takes the same words as
`rigpilot engine-env` and prints what it prints (one JSON progress line per step, then the status as an
indented JSON object), failing or hanging where a test asks it to.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from PySide6.QtWidgets import QWidget

from rigpilot.app.engine_env.dialog import (
    INSTALL,
    OFFLINE_CHOICE,
    REPAIR,
    EngineEnvDialog,
    check_at_startup,
    default_command,
    step_of,
    validate_backend,
)
from rigpilot.app.settings.page import SettingsPage
from rigpilot.engine.cli.entry import build_parser

from support.gui_fakes import FakeLink

FAKE_INSTALLER = r"""
import json, sys, time
from pathlib import Path

here = Path(__file__).parent
def progress(text):
    print(json.dumps({"progress": text}), flush=True)

(here / "calls.jsonl").open("a").write(json.dumps(sys.argv[1:]) + "\n")
done_file = here / "done-steps"
done = int(done_file.read_text()) if done_file.exists() else 0
progress(f"resuming after step {done}" if done else "starting")
steps = ["$ uv venv --python /usr/bin/python3 /fake/engine-env",
         "$ uv pip install --python /fake/engine-env/bin/python --torch-backend cpu torch",
         "$ uv pip install --python /fake/engine-env/bin/python transformers>=4.45 peft>=0.12"]
for i, step in enumerate(steps):
    if i < done:
        continue
    progress(step)
    progress(f"Downloading part {i}")
    fail_at = here / "fail-at"
    if fail_at.exists() and int(fail_at.read_text()) == i:
        fail_at.unlink()
        error = here / "error"
        print(error.read_text() if error.exists() else
              "rigpilot: error: installing the engine environment failed at: uv pip install … (exit 1); "
              "run 'rigpilot engine-env install' again to resume", file=sys.stderr, flush=True)
        sys.exit(2)
    if (here / "hang").exists():
        time.sleep(120)
    done_file.write_text(str(i + 1))
if (here / "exit-1").exists():
    sys.exit(1)
print(json.dumps({"schema": "rigpilot.engine-env/1", "python": "/fake/engine-env/bin/python", "installed": True,
                  "torch_version": "2.13.0+cpu", "cuda_version": None, "arch_list": [], "problems": []}, indent=2))
"""



@pytest.fixture(autouse=True)
def data_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))


@pytest.fixture
def fake(tmp_path) -> Path:
    folder = tmp_path / "fake"
    folder.mkdir()
    (folder / "installer.py").write_text(FAKE_INSTALLER)
    return folder


def command(fake: Path) -> list[str]:
    return [sys.executable, str(fake / "installer.py")]


def calls(fake: Path) -> list[list[str]]:
    return [json.loads(line) for line in (fake / "calls.jsonl").read_text().splitlines()]


def open_dialog(qtbot, fake: Path, **kw) -> EngineEnvDialog:
    dialog = EngineEnvDialog(command=command(fake), **kw)
    qtbot.addWidget(dialog)
    dialog.show()
    qtbot.waitExposed(dialog)
    return dialog


def run(qtbot, dialog: EngineEnvDialog, timeout: int = 20000) -> tuple[bool, dict]:
    with qtbot.waitSignal(dialog.sig_done, timeout=timeout) as done:
        dialog.run_button.click()
        assert dialog.running and dialog.progress.isVisible() and dialog.progress.maximum() == 0  # busy bar
        assert dialog.stop_button.isEnabled() and not dialog.run_button.isEnabled()
    assert not dialog.running
    return done.args[0], done.args[1]


def log_text(dialog: EngineEnvDialog) -> str:
    return dialog.log_view.toPlainText()


def test_install_streams_json_progress_and_reports_the_result(qtbot, fake):
    dialog = open_dialog(qtbot, fake, status={"installed": False, "problems": ["the PyTorch engine environment "
                                                                              "is not installed yet"]})  # fmt: skip
    assert "is not installed yet" in dialog.intro.text()
    dialog.backend.setCurrentText("cpu")
    assert dialog.terminal.text().endswith("rigpilot engine-env install --torch-backend cpu")
    ok, status = run(qtbot, dialog)
    assert ok and status["installed"] and status["torch_version"] == "2.13.0+cpu"
    assert calls(fake) == [["install", "--json", "--torch-backend", "cpu"]]
    text = log_text(dialog)
    # Progress lines show as their text, not as JSON; the status object is not dumped into the log.
    for line in ("starting", "$ uv venv --python /usr/bin/python3 /fake/engine-env", "Downloading part 2"):
        assert line in text.splitlines()
    assert '"progress"' not in text and "schema" not in text
    assert "Installed: torch 2.13.0+cpu (CPU build) in /fake/engine-env/bin/python" in dialog.step.text()
    assert dialog.progress.value() == dialog.progress.maximum() == 1
    assert not dialog.run_button.isEnabled() and not dialog.stop_button.isEnabled()


def test_a_failed_install_says_why_and_resume_continues_where_it_stopped(qtbot, fake):
    (fake / "fail-at").write_text("1")
    dialog = open_dialog(qtbot, fake)
    ok, _ = run(qtbot, dialog)
    assert not ok
    assert "failed at: uv pip install" in dialog.step.text() and "Press Resume" in dialog.step.text()
    assert dialog.run_button.text() == "Resume" and dialog.run_button.isEnabled()
    assert dialog.backend.isEnabled() and dialog.wheel.isEnabled()
    ok, status = run(qtbot, dialog)
    assert ok and status["installed"]
    assert "resuming after step 1" in log_text(dialog).splitlines()
    assert [c[0] for c in calls(fake)] == ["install", "install"]


def test_an_exit_status_of_1_without_a_status_is_a_failure(qtbot, fake):
    (fake / "exit-1").write_text("")
    dialog = open_dialog(qtbot, fake)
    ok, status = run(qtbot, dialog)
    assert not ok and status == {}
    assert "the installer exited with 1" in dialog.step.text()


def test_stop_ends_the_installer_and_offers_resume(qtbot, fake):
    (fake / "hang").write_text("")
    dialog = open_dialog(qtbot, fake)
    with qtbot.waitSignal(dialog.sig_done, timeout=15000) as done:
        dialog.run_button.click()
        qtbot.waitUntil(lambda: "Downloading part 0" in log_text(dialog), timeout=10000)
        assert "Step 1: Creating the environment" in dialog.step.text()
        dialog.stop_button.click()
    assert done.args[0] is False
    assert "Stopped." in dialog.step.text() and dialog.run_button.text() == "Resume"
    (fake / "hang").unlink()
    ok, _ = run(qtbot, dialog)
    assert ok and "resuming" not in log_text(dialog).splitlines()[-1]


def test_closing_the_dialog_stops_a_running_installer(qtbot, fake):
    (fake / "hang").write_text("")
    dialog = open_dialog(qtbot, fake)
    dialog.run_button.click()
    qtbot.waitUntil(lambda: "Downloading part 0" in log_text(dialog), timeout=10000)
    process = dialog.process
    dialog.close()
    assert not dialog.running and process is not None
    assert dialog.succeeded is False


def test_the_form_is_checked_before_anything_runs(qtbot, fake, tmp_path):
    dialog = open_dialog(qtbot, fake)
    dialog.backend.setCurrentText("cuda 12")
    assert dialog.start() is False and not dialog.running
    assert dialog.form_error.isVisible() and "cu126" in dialog.form_error.text()
    dialog.backend.setCurrentText("cu126")
    assert not dialog.form_error.isVisible()  # re-checked as it is edited
    dialog.wheel.setText(str(tmp_path / "missing.whl"))
    assert dialog.start() is False and "No such file" in dialog.form_error.text()
    dialog.wheel.setText(str(fake / "installer.py"))
    assert dialog.start() is False and "not a wheel" in dialog.form_error.text()
    wheel = tmp_path / "torch-2.13.0-cp311-cp311-linux_x86_64.whl"
    wheel.write_bytes(b"")
    dialog.wheel.setText(str(wheel))
    ok, _ = run(qtbot, dialog)
    assert ok
    assert calls(fake) == [["install", "--json", "--torch-backend", "cu126", "--wheel", str(wheel)]]


@pytest.mark.parametrize("backend, valid", [("auto", True), ("cpu", True), ("cu118", True), ("cu130", True),
                                            ("rocm6.3", True), ("xpu", True), ("", False), ("cuda", False),
                                            ("cu126; rm -rf", False)])  # fmt: skip
def test_backend_choices(backend, valid):
    assert (validate_backend(backend) is None) is valid


def test_the_words_are_the_ones_the_real_command_takes(qtbot, fake, tmp_path):
    assert default_command()[1:] == ["-m", "rigpilot.app.launcher", "engine-env"]
    wheel = tmp_path / "torch-2.13.0-cp311-cp311-linux_x86_64.whl"
    wheel.write_bytes(b"")
    for action in (INSTALL, REPAIR):
        dialog = open_dialog(qtbot, fake, action=action)
        dialog.backend.setCurrentText("cu128")
        dialog.wheel.setText(str(wheel))
        args = build_parser().parse_args(["engine-env", *dialog.arguments()])
        assert (args.action, args.json, args.torch_backend, args.wheel) == (action, True, "cu128", wheel)
    assert step_of("$ uv venv --python /usr/bin/python3 /x") == "Creating the environment"
    assert step_of("$ uv pip install --python /x/bin/python --torch-backend auto torch==2.13.0").startswith(
        "Installing PyTorch"
    )
    assert step_of("$ uv pip install --python /x/bin/python --no-deps /src") == "Installing Rigpilot's engine"
    # The step after torch names the pin again: it is the libraries' step.
    assert step_of("$ uv pip install --python /x/bin/python torch==2.13.0 transformers>=4.45 peft>=0.12").startswith(
        "Installing transformers"
    )


def test_settings_repair_runs_engine_env_repair_and_a_failed_repair_resumes_as_install(qtbot, fake):
    page = SettingsPage(FakeLink("1x-rtx4090"))
    qtbot.addWidget(page)
    page.engine_env_command = command(fake)
    with qtbot.waitSignal(page.sig_loaded, timeout=10000):
        page.show()
    page.repair_button.click()
    dialog = page.engine_env_dialog
    assert isinstance(dialog, EngineEnvDialog) and dialog.isVisible()
    assert dialog.action == REPAIR and dialog.run_button.text() == "Repair"
    assert "removes" in dialog.intro.text()
    assert not calls_exist(fake)  # nothing runs until Repair is pressed
    (fake / "fail-at").write_text("2")
    ok, _ = run(qtbot, dialog)
    assert not ok and dialog.run_button.text() == "Resume"
    ok, _ = run(qtbot, dialog)
    assert ok and "Repaired" not in dialog.step.text() and "Installed" in dialog.step.text()
    assert [c[0] for c in calls(fake)] == ["repair", "install"]
    page.repair_button.click()  # the same dialog comes forward while it is open
    assert page.engine_env_dialog is dialog
    dialog.close()
    page.repair_button.click()  # a fresh one once it was closed
    assert page.engine_env_dialog is not dialog and page.engine_env_dialog.run_button.text() == "Repair"
    page.engine_env_dialog.close()


def calls_exist(fake: Path) -> bool:
    return (fake / "calls.jsonl").exists()


def test_start_up_check_offers_the_install_only_when_the_environment_is_missing(qtbot, fake):
    parent = QWidget()
    qtbot.addWidget(parent)
    parent.show()
    asked: list[bool] = []

    def present() -> dict:
        asked.append(True)
        return {"python": sys.executable, "installed": True, "problems": []}

    check_at_startup(parent, probe=present, command=command(fake))
    qtbot.waitUntil(lambda: bool(asked))
    qtbot.wait(100)  # the answer is handled on the GUI thread
    assert parent.findChild(EngineEnvDialog) is None

    missing = {"python": None, "installed": False, "problems": ["the PyTorch engine environment is not installed yet: "
                                                                "run 'rigpilot engine-env install'"]}  # fmt: skip
    check_at_startup(parent, probe=lambda: missing, command=command(fake))
    qtbot.waitUntil(lambda: parent.findChild(EngineEnvDialog) is not None)
    dialog = parent.findChild(EngineEnvDialog)
    assert dialog.isVisible() and dialog.action == INSTALL and dialog.run_button.text() == "Install"
    assert "is not installed yet" in dialog.intro.text()
    assert not calls_exist(fake)  # it offers; the user decides
    ok, _ = run(qtbot, dialog)
    assert ok
    dialog.close()


def test_a_failing_check_shows_nothing(qtbot, caplog):
    parent = QWidget()
    qtbot.addWidget(parent)
    failed: list[bool] = []

    def broken() -> dict:
        failed.append(True)
        raise OSError("no platformdirs today")

    check_at_startup(parent, probe=broken)
    qtbot.waitUntil(lambda: bool(failed))
    qtbot.wait(100)
    assert parent.findChild(EngineEnvDialog) is None


def test_the_offline_choice_installs_from_a_folder_of_wheels(qtbot, fake, tmp_path):
    dialog = open_dialog(qtbot, fake)
    assert dialog.offline.text() == OFFLINE_CHOICE and OFFLINE_CHOICE in dialog.intro.text()
    assert not dialog.folder.isVisible()  # only once chosen
    dialog.offline.setChecked(True)
    assert dialog.folder.isVisible() and "rigpilot engine-env wheels" in dialog.folder_note.text()
    assert dialog.start() is False and "Choose the folder" in dialog.form_error.text()
    assert dialog.terminal.text().endswith("--offline --find-links FOLDER")  # not "." (the empty path)
    folder = tmp_path / "wheels"
    dialog.folder.setText(str(folder))
    assert dialog.start() is False and "No such folder" in dialog.form_error.text()
    folder.mkdir()
    assert dialog.start() is False and "holds no wheels" in dialog.form_error.text()
    (folder / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    assert dialog.terminal.text().endswith(f"install --torch-backend auto --offline --find-links {folder}")
    ok, _ = run(qtbot, dialog)
    assert ok
    assert calls(fake) == [["install", "--json", "--torch-backend", "auto", "--offline", "--find-links", str(folder)]]
    args = build_parser().parse_args(["engine-env", *dialog.arguments()])
    assert args.offline and args.find_links == [folder]


DNS_ERROR = """rigpilot: error: installing the engine environment failed: cannot reach https://download.pytorch.org/whl/cpu/torch/ (failed to lookup address information: Name or service not known).
Without internet access, install from downloaded wheels: 'rigpilot engine-env wheels' prints the commands to fetch them elsewhere, then 'rigpilot engine-env install --offline --find-links DIR'."""
MISSING_WHEEL = """rigpilot: error: the offline install found no torch wheel in /media/usb/wheels.
On a machine with internet access, fetch every wheel it needs into that folder, copy the folder back here and run the same command again:
  pip download --only-binary=:all: --python-version 3.11 -d /media/usb/wheels --no-deps torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
  pip download --only-binary=:all: --python-version 3.11 -d /media/usb/wheels --find-links /media/usb/wheels torch==2.13.0 'transformers>=4.45'"""


def test_a_failure_points_to_the_offline_choice_and_an_offline_failure_to_the_wheels_it_lacks(qtbot, fake, tmp_path):
    (fake / "fail-at").write_text("1")
    (fake / "error").write_text(DNS_ERROR)
    dialog = open_dialog(qtbot, fake)
    ok, _ = run(qtbot, dialog)
    assert not ok
    step = dialog.step.text()
    # The error's first line says what happened (not its last, the advice), then where to turn.
    assert "It did not finish: installing the engine environment failed: cannot reach https://download.pytorch.org" in step
    assert "No internet access? Choose “Install from a folder of wheels (offline)”" in step
    folder = tmp_path / "wheels"
    folder.mkdir()
    (folder / "numpy-2.4.6-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    dialog.offline.setChecked(True)
    dialog.folder.setText(str(folder))
    (fake / "fail-at").write_text("1")
    (fake / "error").write_text(MISSING_WHEEL)
    ok, _ = run(qtbot, dialog)
    assert not ok
    assert "found no torch wheel in /media/usb/wheels" in dialog.step.text()
    assert "The log says which wheels to fetch" in dialog.step.text() and "No internet access" not in dialog.step.text()
    log = log_text(dialog).splitlines()
    assert sum(line.strip().startswith("pip download ") for line in log) == 2


@pytest.mark.slow  # the status check imports torch
def test_an_install_made_from_a_terminal_is_noticed_when_the_dialog_comes_back_to_the_front(
    qtbot, fake, tmp_path, monkeypatch
):
    """The real status check, asked again on activation: the environment appears while the dialog is open."""
    python = tmp_path / "terminal-env" / "bin" / "python"
    monkeypatch.setenv("RIGPILOT_WORKER_PYTHON", str(python))  # where the terminal's install will put it
    from rigpilot.app.engine_env.dialog import probe_status

    missing = probe_status()
    assert not missing["installed"]
    dialog = open_dialog(qtbot, fake, status=missing)
    other = QWidget()
    qtbot.addWidget(other)
    other.show()
    other.activateWindow()
    qtbot.waitUntil(lambda: not dialog.isActiveWindow(), timeout=5000)

    # Meanwhile, in a terminal: `rigpilot engine-env install` makes a virtual environment with torch there
    # (here: one that sees this test's own torch).
    env = python.parents[1]
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    purelib = sysconfig.get_path("purelib", vars={"base": str(env), "platbase": str(env)})
    Path(purelib, "test-torch.pth").write_text(sysconfig.get_path("purelib") + "\n")
    dialog._asked_at = float("-inf")  # the dialog opened just now; a user comes back after seconds, not ms
    with qtbot.waitSignal(dialog.sig_done, timeout=60000) as done:
        dialog.activateWindow()
    assert done.args[0] is True and done.args[1]["installed"]
    assert "Installed meanwhile, from a terminal or another window: torch " in dialog.step.text()
    assert "Nothing to install here" in dialog.step.text()
    assert not dialog.run_button.isEnabled() and not calls_exist(fake)  # nothing was run a second time
