"""Installing or repairing the engine environment: the per-user PyTorch environment the job workers run in.

An installed Rigpilot provisions PyTorch per user on first run (engine/provision.py): the right build depends on
the machine's driver, and a CUDA build is gigabytes. At start-up the app asks `rigpilot.engine.runtime.status()` in the
background (`check_at_startup`; the GUI may import engine.runtime, which never imports torch). When no worker
environment exists, `EngineEnvDialog` explains, offers the PyTorch build (auto, cpu or a CUDA tag such as
cu126), an optional local torch wheel and "Install from a folder of wheels (offline)", and on Install runs

    python -m rigpilot.app.launcher engine-env install --json --torch-backend auto [--wheel FILE]
                                                      [--offline --find-links DIR]

in a QProcess, streaming its JSON progress lines into a log view under a busy bar. Installing is resumable:
after a failure or Stop the button says Resume and runs `install` again, which continues where it stopped
(uv keeps its downloads; finished steps are not redone); a failure also points to the offline choice, whose
own failure names the missing wheel and the `pip download` commands (in the log). The Settings page opens
the same dialog for `engine-env repair` (remove the environment and its cache, install it again).

    dialog = EngineEnvDialog(parent, action=REPAIR)                         # the real command
    dialog = EngineEnvDialog(parent, command=[sys.executable, "fake.py"])   # tests: any program taking the same words
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import QEvent, QProcess, QProcessEnvironment, Qt, QTimer, Signal
from PySide6.QtGui import QCloseEvent, QFont, QPalette
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.tasks import run_in_background
from rigpilot.app.widgets.icons import set_icon
from rigpilot.app.widgets.path_field import path_field
from rigpilot.app.widgets.style import Status, mark_primary, set_status
from rigpilot.engine.given_path import FOLDER, MISSING, PathRefused, check_given_path

log = logging.getLogger(__name__)

INSTALL, REPAIR = "install", "repair"
BACKENDS = ["auto", "cpu", "cu126", "cu128", "cu130"]  # offered; any other uv --torch-backend tag can be typed
_BACKEND = re.compile(r"^(auto|cpu|cu\d{2,3}|rocm\d+(\.\d+)*|xpu)$")
OFFLINE_CHOICE = "Install from a folder of wheels (offline)"
STOP_GRACE_MS = 5000  # after Stop: SIGTERM, then SIGKILL this much later
LOG_LINES = 10_000
RECHECK_AFTER_S = 2.0  # activations closer together than this ask once (the probe starts the engine's Python)


def default_command() -> list[str]:
    """The program and first words of `rigpilot engine-env`, run with this very interpreter."""
    return [sys.executable, "-m", "rigpilot.app.launcher", "engine-env"]


def validate_backend(text: str) -> str | None:
    if _BACKEND.match(text.strip()):
        return None
    return "The PyTorch build is auto, cpu, or a CUDA tag such as cu126 (also rocm6.3, xpu)."


def validate_wheel(text: str) -> str | None:
    text = text.strip()
    if not text:
        return None
    if not Path(text).name.endswith(".whl"):
        return f"{Path(text).name} is not a wheel (.whl file)."
    try:
        check_given_path(text, "wheel")
    except PathRefused as e:
        return f"No such file: {text}" if e.problem == MISSING else f"{e}."
    return None


def validate_folder(text: str) -> str | None:
    text = text.strip()
    if not text:
        return "Choose the folder holding the downloaded wheels."
    try:
        p = check_given_path(text, "wheels folder", expect=FOLDER)
    except PathRefused as e:
        return f"No such folder: {text}" if e.problem == MISSING else f"{e}."
    if not any(p.glob("*.whl")):
        return f"{p} holds no wheels (.whl files)."
    return None


def step_of(command_line: str) -> str:
    """What a `$ uv ...` line of the installer is doing, in words."""
    words = command_line[2:].split()
    if "venv" in words[:3]:
        return "Creating the environment"
    if "--no-deps" in words:
        return "Installing Rigpilot's engine"
    # Before torch: this step names the torch pin again.
    if any(w.startswith("transformers") for w in words):
        return "Installing transformers, peft and accelerate"
    if any(w == "torch" or w.startswith("torch==") or (w.endswith(".whl") and "torch" in w) for w in words):
        return "Installing PyTorch (the big download)"
    return "Installing the engine's other packages"


def _note(text: str = "") -> QLabel:
    label = QLabel(text)
    label.setWordWrap(True)
    label.setForegroundRole(QPalette.ColorRole.PlaceholderText)
    return label


def _env_dir() -> str:
    from rigpilot.engine.runtime import env_dir

    return str(env_dir())


class EngineEnvDialog(QDialog):
    sig_done = Signal(bool, dict)  # succeeded, and the environment's status as the command last printed it

    def __init__(
        self,
        parent: QWidget | None = None,
        *,
        action: str = INSTALL,
        status: dict[str, Any] | None = None,
        command: list[str] | None = None,
        probe: Callable[[], dict[str, Any]] | None = None,
    ):
        super().__init__(parent)
        if action not in (INSTALL, REPAIR):
            raise ValueError(f"action must be {INSTALL!r} or {REPAIR!r}")
        self.setObjectName("engineEnvDialog")
        self.setWindowTitle("Engine environment")
        self.action = action
        self.command = list(command or default_command())
        self.process: QProcess | None = None
        self.result_status: dict[str, Any] = {}
        self.succeeded: bool | None = None  # None: not run yet, or running
        self._stopping = False
        self._stdout = b""
        self._stderr = b""
        self._json: list[str] | None = None  # lines of a multi-line JSON object being read
        self._last_error = ""
        self._error_line = ""  # the first line of the installer's error (the rest, commands, is in the log)
        self._steps = 0
        # Asked again whenever the dialog becomes the active window: an install made meanwhile from a terminal
        # (`rigpilot engine-env install`) or another window turns the dialog into "installed", not a second install.
        self._probe = probe or probe_status
        self._checking = False
        # The status the dialog opens with was just asked: its first activation need not ask again.
        self._asked_at = time.monotonic() if status is not None else -RECHECK_AFTER_S

        where = _env_dir()
        if action == INSTALL:
            why = "; ".join((status or {}).get("problems") or []) or "it is not installed yet"
            intro = (
                "<b>Jobs need PyTorch, set up once for your user.</b><br>Rigpilot runs jobs in a Python "
                f"environment of their own, with the PyTorch build that suits this machine; {_escape(why)}."
                f"<br><br>Install downloads PyTorch and a few libraries into {_escape(where)} (about 1 GB for "
                "the CPU build, several GB for a CUDA build). The app stays usable meanwhile. If it stops "
                "(Stop, a lost connection), press Resume: it continues where it stopped. No internet access "
                "here? Choose “Install from a folder of wheels (offline)”."
            )
        else:
            intro = (
                "<b>Repair the engine environment.</b><br>Repair removes the Python environment the jobs run in "
                f"({_escape(where)}) and its download cache, and installs it again: use it when jobs fail "
                "because PyTorch is missing or broken."
            )
        self.intro = QLabel(intro)
        self.intro.setObjectName("engineEnvIntro")
        self.intro.setWordWrap(True)
        self.intro.setTextFormat(Qt.TextFormat.RichText)
        self.intro.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        self.backend = QComboBox()
        self.backend.setObjectName("torchBackend")
        self.backend.setAccessibleName("PyTorch build")
        self.backend.setEditable(True)
        self.backend.addItems(BACKENDS)
        self.backend.setMinimumContentsLength(8)
        self.backend.setToolTip("auto: the CUDA build for the installed NVIDIA driver, the CPU build where there is "
                                "none; cpu: no GPU; cuXXX: that CUDA")  # fmt: skip
        self.wheel, self.browse, wheel_row = path_field(
            "torchWheel", "browseWheel", "optional: a torch .whl file to install instead of downloading one",
            self._browse, accessible="Local torch wheel", clear_button=True,
        )  # fmt: skip
        self.form_error = QLabel()
        self.form_error.setObjectName("engineEnvFormError")
        self.form_error.setWordWrap(True)
        set_status(self.form_error, "bad")
        self.form_error.hide()
        self.offline = QCheckBox(OFFLINE_CHOICE)
        self.offline.setObjectName("offlineInstall")
        self.offline.setToolTip("No network at all: every wheel comes from the folder (see the note below it)")
        self.folder, self.browse_folder, folder_row = path_field(
            "wheelFolder", "browseWheelFolder", "the folder holding the downloaded wheels", self._browse_folder,
            accessible="Folder of wheels", clear_button=True,
        )  # fmt: skip
        self.folder_note = _note("To fill it, run 'rigpilot engine-env wheels' here: it prints the 'pip download' "
                                 "commands to run on a machine with internet access.")  # fmt: skip
        self.folder_widgets = [self.folder, self.browse_folder, self.folder_note]
        backend_row = QHBoxLayout()
        backend_row.addWidget(self.backend)
        backend_row.addWidget(_note("auto: the CUDA build for this machine's NVIDIA driver, the CPU build where "
                                    "there is none; or cpu, or a CUDA tag such as cu126"), 1)  # fmt: skip
        form = QFormLayout()
        form.addRow("PyTorch build", backend_row)
        form.addRow("Local wheel", wheel_row)
        form.addRow("", self.offline)
        form.addRow("Wheels folder", folder_row)
        form.addRow("", self.folder_note)
        self.folder_label = form.labelForField(folder_row)
        self.backend.currentTextChanged.connect(lambda _: self._recheck())
        self.wheel.textChanged.connect(lambda _: self._recheck())
        self.folder.textChanged.connect(lambda _: self._recheck())
        self.offline.toggled.connect(self._offline_toggled)

        self.progress = QProgressBar()
        self.progress.setObjectName("engineEnvProgress")
        self.progress.setTextVisible(False)
        self.progress.hide()
        self.step = QLabel()
        self.step.setObjectName("engineEnvStep")
        self.step.setWordWrap(True)
        self.log_view = QPlainTextEdit()
        self.log_view.setObjectName("engineEnvLog")
        self.log_view.setAccessibleName("Installation log")
        self.log_view.setReadOnly(True)
        self.log_view.setTabChangesFocus(True)
        self.log_view.setMaximumBlockCount(LOG_LINES)
        self.log_view.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        mono = QFont("monospace")
        mono.setStyleHint(QFont.StyleHint.Monospace)
        self.log_view.setFont(mono)
        self.log_view.setPlaceholderText("The installer's output appears here.")
        self.terminal = _note()
        self.terminal.setObjectName("engineEnvCommand")
        self.terminal.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        self.run_button = QPushButton("Install" if action == INSTALL else "Repair")
        set_icon(self.run_button, "repair")
        mark_primary(self.run_button)
        self.run_button.setObjectName("runEngineEnv")
        self.run_button.setDefault(True)
        self.run_button.clicked.connect(self.start)
        self.stop_button = QPushButton("Stop")
        set_icon(self.stop_button, "cancel")
        self.stop_button.setObjectName("stopEngineEnv")
        self.stop_button.setToolTip("Stop the installer; Resume continues where it stopped")
        self.stop_button.setEnabled(False)
        self.stop_button.clicked.connect(self.stop)
        self.close_button = QPushButton("Close")
        self.close_button.setObjectName("closeEngineEnv")
        self.close_button.clicked.connect(self.close)
        buttons = QHBoxLayout()
        buttons.addWidget(self.stop_button)
        buttons.addStretch(1)
        buttons.addWidget(self.run_button)
        buttons.addWidget(self.close_button)

        layout = QVBoxLayout(self)
        layout.addWidget(self.intro)
        layout.addLayout(form)
        layout.addWidget(self.form_error)
        layout.addWidget(self.progress)
        layout.addWidget(self.step)
        layout.addWidget(self.log_view, 1)
        layout.addWidget(self.terminal)
        layout.addLayout(buttons)
        self._offline_toggled(False)
        self.resize(760, 560)

    # -- the form -----------------------------------------------------------------------------------
    def arguments(self) -> list[str]:
        """The words after the command: `install --json --torch-backend B [--wheel FILE] [--offline --find-links DIR]`."""
        args = [self.action, "--json", "--torch-backend", self.backend.currentText().strip()]
        wheel = self.wheel.text().strip()
        if wheel:
            args += ["--wheel", str(Path(wheel).expanduser())]
        if self.offline.isChecked():
            folder = self.folder.text().strip()
            # Until one is chosen the terminal line names the argument; validate() stops a run without it.
            args += ["--offline", "--find-links", str(Path(folder).expanduser()) if folder else "FOLDER"]
        return args

    def validate(self) -> str | None:
        problem = validate_backend(self.backend.currentText()) or validate_wheel(self.wheel.text())
        if problem is None and self.offline.isChecked():
            problem = validate_folder(self.folder.text())
        self.form_error.setText(problem or "")
        self.form_error.setVisible(bool(problem))
        return problem

    def _recheck(self) -> None:
        if self.form_error.isVisible():
            self.validate()
        self._update_terminal_line()

    def _update_terminal_line(self) -> None:
        words = ["rigpilot", "engine-env", *(a for a in self.arguments() if a != "--json")]
        self.terminal.setText("Same from a terminal: " + shlex.join(words))

    def _offline_toggled(self, on: bool) -> None:
        for w in [*self.folder_widgets, self.folder_label]:
            if w is not None:
                w.setVisible(on)
        self._recheck()

    def _browse_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "The folder of wheels", self.folder.text() or str(Path.home()))
        if path:
            self.folder.setText(path)

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "A torch wheel", str(Path.home()), "Wheels (*.whl)")
        if path:
            self.wheel.setText(path)

    # -- running ------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.process is not None

    def start(self) -> bool:
        """Run the installer; False when the form has a problem or it already runs."""
        if self.running or self.validate():
            return False
        self.succeeded = None
        self.result_status = {}
        self._stopping = False
        self._stdout = self._stderr = b""
        self._json = None
        self._last_error = self._error_line = ""
        self._steps = 0
        args = [*self.command[1:], *self.arguments()]
        self.log_view.appendPlainText("$ " + " ".join([Path(self.command[0]).name, *args]))
        process = QProcess(self)
        env = QProcessEnvironment.systemEnvironment()
        env.insert("PYTHONUNBUFFERED", "1")
        process.setProcessEnvironment(env)
        # Its own session, so Stop reaches uv and whatever else the installer started.
        params = QProcess.UnixProcessParameters()
        params.flags = QProcess.UnixProcessFlag.CreateNewSession
        process.setUnixProcessParameters(params)
        process.readyReadStandardOutput.connect(self._read_stdout)
        process.readyReadStandardError.connect(self._read_stderr)
        process.finished.connect(self._finished)
        process.errorOccurred.connect(self._error)
        self.process = process
        self._set_running(True)
        set_status(self.step, None)
        self.step.setTextFormat(Qt.TextFormat.PlainText)
        self.step.setText("Starting…")
        process.start(self.command[0], args)
        return True

    def stop(self) -> None:
        """Stop the installer (and everything it started); Resume continues later."""
        process = self.process
        if process is None:
            return
        self._stopping = True
        self.step.setText("Stopping…")
        self._signal(signal.SIGTERM)
        QTimer.singleShot(STOP_GRACE_MS, lambda: self._signal(signal.SIGKILL) if self.process is process else None)

    def _signal(self, sig: int) -> None:
        if self.process is None:
            return
        pid = self.process.processId()
        try:
            os.killpg(pid, sig)  # the process leads its own group (CreateNewSession)
        except (ProcessLookupError, PermissionError, OSError):
            if sig == signal.SIGKILL:
                self.process.kill()
            else:
                self.process.terminate()

    def _set_running(self, running: bool) -> None:
        self.run_button.setEnabled(not running)
        self.stop_button.setEnabled(running)
        self.backend.setEnabled(not running)
        self.wheel.setEnabled(not running)
        self.browse.setEnabled(not running)
        for w in (self.offline, self.folder, self.browse_folder):
            w.setEnabled(not running)
        if running:
            self.progress.setRange(0, 0)  # busy: the installer does not know how long a download takes
            self.progress.show()

    # -- output -------------------------------------------------------------------------------------
    def _read_stdout(self) -> None:
        if self.process is None:
            return
        self._stdout += bytes(self.process.readAllStandardOutput().data())
        *lines, self._stdout = self._stdout.split(b"\n")
        for line in lines:
            self._stdout_line(line.decode(errors="replace").rstrip("\r"))

    def _read_stderr(self) -> None:
        if self.process is None:
            return
        self._stderr += bytes(self.process.readAllStandardError().data())
        *lines, self._stderr = self._stderr.split(b"\n")
        for line in lines:
            self._stderr_line(line.decode(errors="replace").rstrip("\r"))

    def _stdout_line(self, line: str) -> None:
        # One JSON object per progress line; the final status comes as one indented JSON object.
        if self._json is not None:
            self._json.append(line)
            if line == "}":
                text, self._json = "\n".join(self._json), None
                self._take_json(text)
            return
        if line == "{":
            self._json = [line]
            return
        if line.startswith("{"):
            self._take_json(line)
        elif line.strip():
            self.log_view.appendPlainText(line)

    def _take_json(self, text: str) -> None:
        try:
            message = json.loads(text)
        except ValueError:
            self.log_view.appendPlainText(text)
            return
        if not isinstance(message, dict):
            self.log_view.appendPlainText(text)
        elif "progress" in message:
            self._progress(str(message["progress"]))
        elif "installed" in message:
            self.result_status = message
        else:
            self.log_view.appendPlainText(text)

    def _progress(self, text: str) -> None:
        self.log_view.appendPlainText(text)
        if text.startswith("$ "):
            self._steps += 1
            self.step.setText(f"Step {self._steps}: {step_of(text)}…")
        elif text.startswith("removing "):
            self.step.setText("Removing the old environment…")

    def _stderr_line(self, line: str) -> None:
        if line.strip():
            self.log_view.appendPlainText(line)
            self._last_error = line.strip()
            if line.startswith("rigpilot: error: "):
                self._error_line = line.strip()

    # -- an install made elsewhere ------------------------------------------------------------------
    def event(self, event: QEvent) -> bool:
        if event.type() == QEvent.Type.WindowActivate:
            self.recheck()
        return super().event(event)

    def recheck(self) -> None:
        """Ask again, off the GUI thread, whether the environment exists; if it does now, say so and offer nothing."""
        if self.action != INSTALL or self.running or self.succeeded or self._checking:
            return
        if time.monotonic() - self._asked_at < RECHECK_AFTER_S:
            return
        self._asked_at = time.monotonic()
        self._checking = True
        run_in_background(self._probe, self._rechecked, self._recheck_failed)

    def _rechecked(self, status: dict[str, Any]) -> None:
        self._checking = False
        if status.get("installed") and not self.running and not self.succeeded:
            self.result_status = dict(status)
            self._done(True, "", elsewhere=True)

    def _recheck_failed(self, error: BaseException) -> None:
        self._checking = False
        log.warning("could not check the engine environment again: %s", error)

    # -- the end --------------------------------------------------------------------------------------
    def _error(self, error: QProcess.ProcessError) -> None:
        if error == QProcess.ProcessError.FailedToStart and self.process is not None:
            why = self.process.errorString()
            self._discard_process()
            self._done(False, f"Could not start {self.command[0]}: {why}")

    def _discard_process(self) -> None:
        # Disconnect first: a signal the finished process still has queued must not reach a deleted sender.
        process, self.process = self.process, None
        if process is None:
            return
        for sig in (process.readyReadStandardOutput, process.readyReadStandardError, process.finished,
                    process.errorOccurred):
            with contextlib.suppress(RuntimeError, TypeError):
                sig.disconnect()
        process.deleteLater()

    def _finished(self, exit_code: int, exit_status: QProcess.ExitStatus) -> None:
        if self.process is None:
            return
        self._read_stdout()
        self._read_stderr()
        for rest in (self._stdout, self._stderr):
            if rest.strip():
                self.log_view.appendPlainText(rest.decode(errors="replace"))
        self._discard_process()
        st = self.result_status
        ok = exit_status == QProcess.ExitStatus.NormalExit and (exit_code == 0 or bool(st.get("installed")))
        if ok:
            self._done(True, "")
        elif self._stopping:
            self._done(False, "Stopped.")
        else:
            cause = (self._error_line or self._last_error).removeprefix("rigpilot: error: ")
            cause = cause or f"the installer exited with {exit_code}"
            cause = cause.split("; run 'rigpilot engine-env install' again")[0]  # Resume is how, here
            self._done(False, f"It did not finish: {cause}")

    def _done(self, ok: bool, message: str, elsewhere: bool = False) -> None:
        """The end of a run; `elsewhere`: no run here, the environment was found installed (from a terminal, say)."""
        self.succeeded = ok
        self._set_running(False)
        self.progress.setRange(0, 1)
        self.progress.setValue(1)
        self.progress.setVisible(ok)
        st = self.result_status
        if ok:
            build = f"CUDA {st['cuda_version']}" if st.get("cuda_version") else "CPU build"
            text = "Installed" if self.action == INSTALL else "Repaired"
            if elsewhere:
                text = "Installed meanwhile, from a terminal or another window"
            if st.get("torch_version"):
                text += f": torch {st['torch_version']} ({build}) in {st.get('python') or _env_dir()}"
            if elsewhere:
                text += ". Nothing to install here"
            problems = st.get("problems") or []
            status: Status = "warn" if problems else "good"
            self.step.setText("<br>".join([_escape(text + "."), *(_escape(p) for p in problems)]))
            self.run_button.setEnabled(False)
            self.close_button.setDefault(True)
            self.close_button.setFocus()
        else:
            status = "bad"
            # Whatever stopped it, installing again continues: a repair resumes as an install.
            self.action = INSTALL
            self.run_button.setText("Resume")
            text = f"{message.rstrip('.')}. Press Resume to continue where it stopped."
            if not self._stopping:
                text += (" The log says which wheels to fetch, and how." if self.offline.isChecked()
                         else f" No internet access? Choose “{OFFLINE_CHOICE}”.")  # fmt: skip
            self.step.setText(_escape(text))
            self._update_terminal_line()
        self.step.setTextFormat(Qt.TextFormat.RichText)
        set_status(self.step, status)
        self.sig_done.emit(ok, dict(st))

    def closeEvent(self, event: QCloseEvent) -> None:
        self._stop_and_wait()
        super().closeEvent(event)

    def reject(self) -> None:
        self._stop_and_wait()
        super().reject()

    def _stop_and_wait(self) -> None:
        """Closing stops the installer: it resumes next time, and nothing is left running unseen."""
        process = self.process
        if process is None:
            return
        self.stop()
        if not process.waitForFinished(STOP_GRACE_MS):
            self._signal(signal.SIGKILL)
            process.waitForFinished(2000)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# -- at start-up --------------------------------------------------------------------------------------------


def probe_status() -> dict[str, Any]:
    """rigpilot.engine.runtime.status() as a dict (runs the worker interpreter: call it off the GUI thread)."""
    from rigpilot.engine import runtime

    return runtime.status().to_dict()


def check_at_startup(
    parent: QWidget,
    *,
    probe: Callable[[], dict[str, Any]] = probe_status,
    command: list[str] | None = None,
) -> None:
    """Ask in the background whether the worker environment exists; if not, show the install dialog.

    The dialog is a child of `parent` (find it with `parent.findChild(EngineEnvDialog)`). A failed check
    is logged and shows nothing: jobs then say themselves what is missing.
    """

    def answered(status: dict[str, Any]) -> None:
        if status.get("installed") or parent.findChild(EngineEnvDialog) is not None:
            return
        dialog = EngineEnvDialog(parent, action=INSTALL, status=status, command=command)
        dialog.show()

    run_in_background(probe, answered, lambda e: log.warning("could not check the engine environment: %s", e))
