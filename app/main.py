"""Starting the desktop app."""

from __future__ import annotations

import os
import sys

from rigpilot.app.identity import APP_ID, APP_NAME, COMMAND, ORGANIZATION

STARTUP_CHECK_DELAY_MS = 1500  # the engine-environment check waits until the window is up and drawn

NO_DISPLAY = (
    "rigpilot: no display found (DISPLAY and WAYLAND_DISPLAY are unset, e.g. over SSH); "
    "use 'rigpilot watch' for a live terminal view"
)


def has_display() -> bool:
    if os.environ.get("QT_QPA_PLATFORM", "").split(":")[0] in ("offscreen", "minimal", "vnc", "eglfs", "linuxfb"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def _check_engine_env(window) -> None:
    # Imported here, after the window is up: the dialog's modules are not needed for the first frame.
    from rigpilot.app.engine_env.dialog import check_at_startup

    check_at_startup(window)


def main(argv: list[str] | None = None) -> int:
    if not has_display():
        print(NO_DISPLAY, file=sys.stderr)
        return 2
    from PySide6.QtGui import QGuiApplication, QIcon
    from PySide6.QtWidgets import QApplication

    from rigpilot.app.engine_link import EngineLink
    from rigpilot.app.main_window import MainWindow
    from rigpilot.app.settings.model import engine_link_options, read_theme
    from rigpilot.app.tasks import start as start_tasks
    from rigpilot.app.widgets.theme import apply_theme

    QGuiApplication.setDesktopFileName(APP_ID)
    app = QApplication.instance() or QApplication([COMMAND, *(argv or [])])
    app.setApplicationName(APP_NAME)
    app.setOrganizationName(ORGANIZATION)
    QGuiApplication.setWindowIcon(QIcon.fromTheme(APP_ID))  # static: instance() is typed as QCoreApplication
    apply_theme(app, read_theme())  # before the first window: it is built in its colours
    start_tasks()  # the background threads, before any page needs one
    # A remote engine (Settings → Engine address) drives a workstation from another computer.
    window = MainWindow(EngineLink(**engine_link_options()))
    window.show()
    if window.link.remote is None:
        # Packaged installs provision PyTorch per user: offer to install it when it is not there yet.
        from PySide6.QtCore import QTimer

        QTimer.singleShot(STARTUP_CHECK_DELAY_MS, lambda: _check_engine_env(window))
    return app.exec()
