"""The Settings page: the simulated machine, how to reach the engine, chart refresh, CPU ranks,
restarting the engine, and repairing the engine environment (the per-user PyTorch the jobs run in).

Values load off the GUI thread (the profile list and the engine settings are
files); Save checks every field first and shows each problem beside its field,
and writes nothing until all are valid. Saved engine settings apply at once:
the engine reloads its machine (or says which jobs hold it) and pushes it to
every page through the EngineLink.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app import desktop_notify
from rigpilot.app.doctor.view import MachineCheckView
from rigpilot.app.settings.model import (
    DEFAULT_CPU_RANKS,
    MAX_CPU_RANKS,
    REFRESH_RANGE,
    SettingsValues,
    cpu_ranks_note,
    load_engine_side,
    load_gui_side,
    read_theme,
    save_engine_side,
    save_gui_side,
    save_theme,
)
from rigpilot.app.settings.nodes import NodesBox
from rigpilot.app.settings.prices import PricesBox
from rigpilot.app.tasks import run_in_background
from rigpilot.app.widgets.icons import set_icon
from rigpilot.app.widgets.style import mark_primary, set_status
from rigpilot.app.widgets.theme import THEME_LABELS, THEMES, Theme, apply_theme
from rigpilot.engine.api.client import EngineUnavailable
from rigpilot.engine.api.pins import pinned
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.machine import is_simulated
from rigpilot.engine.schema import UNFINISHED_STATES


def _error_label(name: str) -> QLabel:
    label = QLabel()
    label.setObjectName(f"error-{name}")
    label.setWordWrap(True)
    set_status(label, "bad")
    label.hide()
    return label


def _note(text: str) -> QLabel:
    label = QLabel(text)
    label.setWordWrap(True)
    label.setForegroundRole(QPalette.ColorRole.PlaceholderText)  # muted, in light and dark themes alike
    return label


def restart_consequences(active: int | None) -> str:
    """What restarting the engine does, truthfully: the service stops, its jobs do not (engine `shutdown`)."""
    after = "The engine reads Settings anew as it starts, and every page reconnects by itself."
    if active == 0:
        return f"No job is queued or running. {after}"
    if active == 1:
        jobs, them, their = "1 job is queued or running. It keeps", "it", "its"
    else:
        jobs = f"{active} jobs are queued or running. They keep" if active else "Jobs keep"
        them, their = "them", "their"
    return (
        f"{jobs} running: {their} processes do not belong to the engine, and the new engine picks {them} up "
        f"again ({their} charts pause for a few seconds). Secret values given to a job, such as tokens, are "
        f"forgotten: resuming that job later asks for them again. {after}"
    )


class SettingsPage(QWidget):
    sig_loaded = Signal()
    sig_saved = Signal(dict)  # the SettingsValues saved, as a dict
    sig_applied = Signal(dict)  # the engine's reload_machine reply after a save
    sig_not_applied = Signal(str)  # why the engine kept its machine (or could not be asked)
    sig_restarted = Signal(dict)  # the new engine's hello
    sig_invalid = Signal(dict)  # field name -> message, when Save found problems

    def __init__(self, link: Any = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.link = link
        self.profile_ids: list[str] = []
        self.loaded = False

        self.profile = QComboBox()
        self.profile.setObjectName("simulatedProfile")
        self.profile.setAccessibleName("Simulated machine")
        self.profile.addItem("Loading…")
        self.profile_error = _error_label("simulated_profile")
        self.cpu_ranks = QSpinBox()
        self.cpu_ranks.setObjectName("maxCpuRanks")
        self.cpu_ranks.setAccessibleName("CPU ranks per simulated job")
        self.cpu_ranks.setRange(1, MAX_CPU_RANKS)
        self.cpu_ranks.setValue(DEFAULT_CPU_RANKS)
        self.cpu_ranks_error = _error_label("max_cpu_ranks")
        self.cpu_ranks_note = _note("")
        self.cpu_ranks_note.setObjectName("cpuRanksNote")
        self.cpu_ranks.valueChanged.connect(lambda n: self.cpu_ranks_note.setText(cpu_ranks_note(n)))
        sim = QGroupBox("Simulated machine (used when no NVIDIA GPU is present)")
        sim_form = QFormLayout(sim)
        sim_form.addRow("Profile", self.profile)
        sim_form.addRow("", self.profile_error)
        sim_form.addRow("CPU ranks per job", self.cpu_ranks)
        sim_form.addRow("", self.cpu_ranks_error)
        sim_form.addRow("", self.cpu_ranks_note)
        self.settings_path = _note("")
        sim_form.addRow(_note("A simulated job runs one process per simulated GPU, at most this many. "
                              "Both apply when you save: the engine switches machines at once, unless jobs are "
                              "queued or running (it says which)."))  # fmt: skip
        sim_form.addRow(self.settings_path)

        # The program `engine-env repair` is run with (tests point it at a stand-in); None: the real one.
        self.engine_env_command: list[str] | None = None
        self.engine_env_dialog: QWidget | None = None
        self.repair_button = QPushButton("Repair engine environment…")
        set_icon(self.repair_button, "repair")
        self.repair_button.setObjectName("repairEngineEnv")
        self.repair_button.clicked.connect(self.repair_engine_env)
        repair_row = QHBoxLayout()
        repair_row.addWidget(self.repair_button)
        repair_row.addWidget(_note(
            "Jobs run in a Python environment with PyTorch, set up once for your user on this computer. If "
            "jobs fail because PyTorch is missing or broken, Repair removes it and installs it again."
        ), 1)  # fmt: skip

        self.address = QLineEdit()
        self.address.setObjectName("engineAddress")
        self.address.setAccessibleName("Remote engine address")
        self.address.setPlaceholderText("empty: the engine on this computer; or host:port")
        self.address_error = _error_label("engine_address")
        self.token = QLineEdit()
        self.token.setObjectName("engineToken")
        self.token.setAccessibleName("Remote engine token")
        self.token.setEchoMode(QLineEdit.EchoMode.Password)
        self.show_token = QCheckBox("Show")
        self.show_token.setObjectName("showToken")
        self.show_token.toggled.connect(
            lambda on: self.token.setEchoMode(QLineEdit.EchoMode.Normal if on else QLineEdit.EchoMode.Password)
        )
        token_row = QHBoxLayout()
        token_row.addWidget(self.token, 1)
        token_row.addWidget(self.show_token)
        self.token_error = _error_label("engine_token")
        remote = QGroupBox("Engine")
        remote_form = QFormLayout(remote)
        remote_form.addRow("Address", self.address)
        remote_form.addRow("", self.address_error)
        remote_form.addRow("Token", token_row)
        remote_form.addRow("", self.token_error)
        self.certificate = QLabel()
        self.certificate.setObjectName("engineCertificate")
        self.certificate.setWordWrap(True)
        self.certificate.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        remote_form.addRow("Certificate", self.certificate)
        remote_form.addRow(_note(
            "To drive a workstation from this computer, start its engine with `rigpilot engine --tcp ADDR:PORT` "
            "and copy its token here. The connection is encrypted (TLS) and the token is never sent: the login "
            "proves it. The token is stored in this app's settings file in plain text. "
            "Takes effect the next time Rigpilot starts."
        ))  # fmt: skip
        remote_form.addRow("Environment", repair_row)
        self.restart_button = QPushButton("Restart engine…")
        set_icon(self.restart_button, "restart")
        self.restart_button.setObjectName("restartEngine")
        self.restart_button.clicked.connect(self.ask_restart)
        restart_row = QHBoxLayout()
        restart_row.addWidget(self.restart_button)
        self.restart_note = _note(
            "Stops the engine service and starts it again. Running jobs keep running and the new engine picks "
            "them up; it asks first."
        )
        restart_row.addWidget(self.restart_note, 1)
        remote_form.addRow("Service", restart_row)
        if getattr(link, "remote", None):
            self.restart_button.setEnabled(False)
            self.restart_note.setText("A remote engine is restarted on its own computer.")

        self.refresh_hz = QDoubleSpinBox()
        self.refresh_hz.setObjectName("refreshHz")
        self.refresh_hz.setAccessibleName("Chart refresh rate")
        self.refresh_hz.setDecimals(1)
        self.refresh_hz.setSingleStep(0.5)
        self.refresh_hz.setSuffix(" per second")
        # Wider than the valid range, so an out-of-range value gets a message rather than a silent clamp.
        self.refresh_hz.setRange(0.0, 60.0)
        self.refresh_error = _error_label("refresh_hz")
        display = QGroupBox("Display")
        display_form = QFormLayout(display)
        display_form.addRow("Chart refresh", self.refresh_hz)
        display_form.addRow("", self.refresh_error)
        display_form.addRow(_note(
            f"Charts redraw at most this often ({REFRESH_RANGE[0]:g}–{REFRESH_RANGE[1]:g}), and only while visible. "
            "The engine samples the GPUs about once a second."
        ))  # fmt: skip
        self.appearance = QComboBox()
        self.appearance.setObjectName("appearance")
        self.appearance.setAccessibleName("Appearance")
        for theme in THEMES:
            self.appearance.addItem(THEME_LABELS[theme], theme)
        self.appearance.setCurrentIndex(THEMES.index(read_theme()))
        self.appearance.currentIndexChanged.connect(lambda _: self.set_theme(self.appearance.currentData()))
        display_form.addRow("Appearance", self.appearance)
        display_form.addRow(_note("System follows the desktop's light or dark setting. Applies and is kept at "
                                  "once, without Save."))  # fmt: skip
        self.desktop_notifications = QCheckBox("Notify the desktop when a job completes, fails or restarts")
        self.desktop_notifications.setObjectName("desktopNotifications")
        self.desktop_notifications.setChecked(desktop_notify.enabled())
        self.desktop_notifications.toggled.connect(lambda on: desktop_notify.save_enabled(on))
        display_form.addRow("Notifications", self.desktop_notifications)
        display_form.addRow(_note("Only while the Rigpilot window is not the active one. Kept at once, without "
                                  "Save. A headless engine can call a webhook or command instead: see the README."))  # fmt: skip

        self.save_button = QPushButton("Save")
        set_icon(self.save_button, "save")
        mark_primary(self.save_button)
        self.save_button.setObjectName("save")
        self.save_button.setDefault(True)
        self.save_button.clicked.connect(self.save)
        self.revert_button = QPushButton("Revert")
        set_icon(self.revert_button, "revert")
        self.revert_button.setObjectName("revert")
        self.revert_button.clicked.connect(self.load)
        self.status = QLabel()
        self.status.setObjectName("settingsStatus")
        self.status.setWordWrap(True)
        buttons = QHBoxLayout()
        buttons.addWidget(self.status, 1)
        buttons.addWidget(self.revert_button)
        buttons.addWidget(self.save_button)

        body = QWidget()
        body_layout = QVBoxLayout(body)
        self.machine_check: MachineCheckView | None = None
        self.machine_check_box: QGroupBox | None = None
        if link is not None and hasattr(link, "sig_job"):  # a page built without an engine has nothing to check
            self.machine_check = MachineCheckView(link)
            self.machine_check_box = QGroupBox("Check this machine")
            self.machine_check_box.setObjectName("machineCheckBox")
            check_layout = QVBoxLayout(self.machine_check_box)
            check_layout.addWidget(self.machine_check)
            check_layout.addWidget(_note(
                "Measures each GPU and the link between each pair, and acts on what it finds: where peer-to-peer "
                "copies are wrong or slower than through host memory, jobs on those GPUs run with "
                "NCCL_P2P_DISABLE=1. Runs as a job, at once, apart from Save."
            ))  # fmt: skip
            body_layout.addWidget(self.machine_check_box)
        body_layout.addWidget(sim)
        body_layout.addWidget(remote)
        self.nodes_box = NodesBox(link)  # saved on its own: each change goes to the engine at once
        body_layout.addWidget(self.nodes_box)
        body_layout.addWidget(display)
        self.prices = PricesBox()  # saves its own keys, apart from the fields above
        # Read after the page's own read, which sets an unreadable file aside and reports it.
        self.sig_loaded.connect(self.prices.load)
        body_layout.addWidget(self.prices)
        body_layout.addStretch(1)
        area = QScrollArea()
        area.setWidgetResizable(True)
        area.setWidget(body)
        area.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        self.area = area
        layout = QVBoxLayout(self)
        layout.addWidget(area, 1)
        layout.addLayout(buttons)

        self.errors = {
            "simulated_profile": self.profile_error,
            "max_cpu_ranks": self.cpu_ranks_error,
            "engine_address": self.address_error,
            "engine_token": self.token_error,
            "refresh_hz": self.refresh_error,
        }
        # Fields re-check as they are edited, once Save has shown a problem with them.
        self.address.textEdited.connect(lambda _: self._recheck())
        self.address.textChanged.connect(lambda _: self._show_certificate())
        self.token.textEdited.connect(lambda _: self._recheck())
        self.refresh_hz.valueChanged.connect(lambda _: self._recheck())
        self.cpu_ranks.valueChanged.connect(lambda _: self._recheck())
        self.saved_profile = ""  # the profile in the settings file, as last read or written here
        self.switch_waits_for: str | None = None  # the machine a deferred switch goes to, once its jobs end
        if link is not None and hasattr(link, "sig_machine"):
            link.sig_machine.connect(self.on_machine)
        self.load()

    def _show_certificate(self) -> None:
        """The certificate fingerprint pinned for the address (as the first login pinned it), to check by eye."""
        address = self.address.text().strip()
        if not address:
            self.certificate.setText("none: the engine on this computer is reached through a local socket")
            return
        try:
            fingerprint = pinned(address)
        except UserError as e:
            self.certificate.setText(str(e))
            return
        if fingerprint is None:
            self.certificate.setText(
                "not pinned yet: pinned at the first login; compare it with `rigpilot engine --fingerprint` "
                "on that machine"
            )
        else:
            self.certificate.setText(f"{fingerprint} (pinned: another certificate at this address is refused)")

    def show_machine_check(self, start: bool = False) -> MachineCheckView | None:
        """Scroll to the machine check (the Dashboard's card links here); `start` runs one unless one runs."""
        view, box = self.machine_check, self.machine_check_box
        if view is None or box is None:
            return None
        self.area.ensureWidgetVisible(box, 0, 0)
        if start and view.check_button.isVisible():
            view.start_check()
        return view

    def set_theme(self, theme: Theme) -> None:
        """Applied and stored as picked, like the desktop's own appearance switch: no Save, no restart."""
        from PySide6.QtWidgets import QApplication

        save_theme(theme)
        apply_theme(QApplication.instance(), theme)

    # -- the engine environment ------------------------------------------------------------------------
    def repair_engine_env(self) -> QWidget:
        """Open the dialog that runs `rigpilot engine-env repair` (nothing runs until its Repair button)."""
        from rigpilot.app.engine_env.dialog import REPAIR, EngineEnvDialog

        dialog = self.engine_env_dialog
        if dialog is not None and not dialog.isVisible():  # closed: start afresh
            dialog.deleteLater()
            dialog = None
        if dialog is None:
            dialog = EngineEnvDialog(self, action=REPAIR, command=self.engine_env_command)
            self.engine_env_dialog = dialog
        dialog.show()
        dialog.activateWindow()  # bring an open one forward
        return dialog

    # -- values -------------------------------------------------------------------------------------
    def values(self) -> SettingsValues:
        return SettingsValues(
            simulated_profile=self.profile.currentData() or "",
            max_cpu_ranks=self.cpu_ranks.value(),
            engine_address=self.address.text().strip(),
            engine_token=self.token.text().strip(),
            refresh_hz=self.refresh_hz.value(),
        )

    def load(self) -> None:
        """Read both stores: QSettings here, the engine's files off the GUI thread."""
        gui = load_gui_side()
        self.address.setText(gui["engine_address"])
        self._show_certificate()  # setText emits nothing when the address was already that
        self.token.setText(gui["engine_token"])
        self.refresh_hz.setValue(gui["refresh_hz"])
        self.save_button.setEnabled(False)
        run_in_background(load_engine_side, self._on_engine_loaded, self._on_failed("read"))

    def _on_engine_loaded(self, data: dict[str, Any]) -> None:
        self.profile.clear()
        self.profile_ids = [p["id"] for p in data["profiles"]]
        for p in data["profiles"]:
            self.profile.addItem(f"{p['title']}", p["id"])
            self.profile.setItemData(self.profile.count() - 1, p["label"], Qt.ItemDataRole.ToolTipRole)
        self.profile.setCurrentIndex(max(self.profile.findData(data["simulated_profile"]), 0))
        self.saved_profile = data["simulated_profile"]
        self.cpu_ranks.setValue(data["max_cpu_ranks"])
        self.cpu_ranks_note.setText(cpu_ranks_note(self.cpu_ranks.value()))
        self.settings_path.setText(f"Saved in {data['path']}")
        self.status.setText("\n".join(data["warnings"]))
        self._show_errors({})
        self.save_button.setEnabled(True)
        self.loaded = True
        self.sig_loaded.emit()

    def _on_failed(self, verb: str):
        def report(error: BaseException) -> None:
            self.save_button.setEnabled(self.loaded)
            self.status.setText(f"Could not {verb} the settings: {error}")

        return report

    # -- saving -------------------------------------------------------------------------------------
    def validate(self) -> dict[str, str]:
        errors = self.values().errors(self.profile_ids)
        self._show_errors(errors)
        return errors

    def save(self) -> bool:
        """Check every field; when all are valid, write them. False when something needs fixing."""
        errors = self.validate()
        if errors:
            self.status.setText("Please correct the highlighted fields.")
            first = {"engine_address": self.address, "engine_token": self.token, "refresh_hz": self.refresh_hz,
                     "max_cpu_ranks": self.cpu_ranks, "simulated_profile": self.profile}  # fmt: skip
            next(w for k, w in first.items() if k in errors).setFocus()
            self.sig_invalid.emit(errors)
            return False
        values = self.values()
        save_gui_side(values)
        self.save_button.setEnabled(False)
        self.status.setText("Saving…")
        run_in_background(
            lambda: save_engine_side(values), lambda path: self._on_saved(values, path), self._on_failed("save")
        )
        return True

    def _on_saved(self, values: SettingsValues, path: str) -> None:
        self.save_button.setEnabled(True)
        self.saved_profile = values.simulated_profile
        self.sig_saved.emit(dataclasses.asdict(values))
        if self.link is None:
            self.status.setText(f"Saved in {path}. The engine uses them when it starts.")
            return
        self.status.setText("Saved. Asking the engine to apply them…")
        # The profile travels with the request too: a remote engine keeps its own settings file.
        self.link.call(
            "reload_machine", on_done=self._on_applied, on_error=self._on_not_applied,
            simulated_profile=values.simulated_profile,
        )  # fmt: skip

    def on_machine(self, machine: dict[str, Any]) -> None:
        """The engine's machine changed, maybe by `rigpilot settings set …`: show the profile now in the
        settings file, unless the user is choosing one here."""
        if self.switch_waits_for and machine.get("label") == self.switch_waits_for:
            self.status.setText(f"The engine now serves {self.switch_waits_for}: it switched when its jobs ended.")
            self.switch_waits_for = None
        if self.loaded and is_simulated(machine):
            run_in_background(load_engine_side, self._on_file_changed, lambda _e: None)

    def _on_file_changed(self, data: dict[str, Any]) -> None:
        profile = data["simulated_profile"]
        if profile != self.saved_profile and self.profile.currentData() == self.saved_profile:
            self.profile.setCurrentIndex(max(self.profile.findData(profile), 0))
            self.saved_profile = profile

    def _on_applied(self, reply: dict[str, Any]) -> None:
        label = (reply.get("machine") or {}).get("label", "")
        if reply.get("changed"):
            self.status.setText(f"Saved. The engine now serves {label}; every page shows it.")
        else:
            self.status.setText(f"Saved. The engine serves {label}, as before.")
        self.sig_applied.emit(reply)

    def _on_not_applied(self, error: BaseException) -> None:
        fields = getattr(error, "fields", None) or {}
        if isinstance(error, EngineUnavailable):
            self.status.setText("Saved. The engine is not running; it uses these settings when it starts.")
        elif getattr(error, "reason", None) == "machine_switch_deferred":
            jobs = list(fields.get("jobs") or [])
            self.switch_waits_for = fields.get("to") or "the new machine"
            them = "its job ends" if len(jobs) == 1 else f"its {len(jobs)} jobs end"
            self.status.setText(
                f"Saved. The engine switches to {self.switch_waits_for} when {them} ({', '.join(jobs)}); "
                "cancel them on the Jobs page to switch now."
            )
        else:
            now = (getattr(self.link, "machine", None) or {}).get("label", "its machine")
            self.status.setText(f"Saved, but the engine keeps {now} for now: {error}")
        self.sig_not_applied.emit(str(error))

    # -- restarting the engine ----------------------------------------------------------------------
    def ask_restart(self) -> None:
        """Count the jobs a restart concerns, then ask; nothing happens unless the user agrees."""
        self.restart_button.setEnabled(False)
        self.link.call(
            "jobs", states=[s.value for s in UNFINISHED_STATES],
            on_done=lambda r: self._confirm_then_restart(len(r.get("jobs") or [])),
            on_error=lambda _e: self._confirm_then_restart(None),
        )  # fmt: skip

    def _confirm_then_restart(self, active: int | None) -> None:
        if self.confirm_restart(active):
            self.restart_engine()
        else:
            self.restart_button.setEnabled(True)

    def confirm_restart(self, active: int | None) -> bool:
        """The question, with what a restart does to jobs (tests answer it in their place)."""
        box = QMessageBox(self)
        box.setIcon(QMessageBox.Icon.Question)
        box.setWindowTitle("Restart the engine?")
        box.setText("Restart the engine service?")
        box.setInformativeText(restart_consequences(active))
        restart = box.addButton("Restart", QMessageBox.ButtonRole.AcceptRole)
        box.addButton(QMessageBox.StandardButton.Cancel)
        box.setDefaultButton(restart)
        box.exec()
        return box.clickedButton() is restart

    def restart_engine(self) -> None:
        self.restart_button.setEnabled(False)
        self.status.setText("Restarting the engine…")
        self.link.restart_engine(on_done=self._on_restarted, on_error=self._on_restart_failed)

    def _on_restarted(self, hello: dict[str, Any]) -> None:
        self.restart_button.setEnabled(True)
        self.status.setText(f"Engine restarted (pid {hello.get('pid')}, {hello.get('machine', '')}).")
        self.sig_restarted.emit(hello)

    def _on_restart_failed(self, error: BaseException) -> None:
        self.restart_button.setEnabled(True)
        self.status.setText(f"Could not restart the engine: {error}")

    def _show_errors(self, errors: dict[str, str]) -> None:
        for field, label in self.errors.items():
            message = errors.get(field)
            label.setText(message or "")
            label.setVisible(bool(message))

    def _recheck(self) -> None:
        if any(label.isVisible() for label in self.errors.values()):
            self.validate()
