"""The window's tests: PySide6 widgets offscreen (or on Xvfb, for the X11 ones) over a FakeLink or a real engine.

A module here is named test_gui_*. Its fakes and page helpers are in tests/support (gui_fakes, gui_jobs,
gui_planner, gui_settings, gui_wizard).
"""

import pytest
from PySide6.QtCore import QSettings, QTimer
from PySide6.QtWidgets import QDialog, QFileDialog, QInputDialog, QMessageBox

from support.gui_fakes import fail_on_qt_warnings, isolated_config


@pytest.fixture(autouse=True)
def _gui_test_isolation(request):
    """In every GUI test, a Qt warning fails the test and settings go to a temporary folder, never the user's.

    The end-to-end test sets up its own (it also runs a real engine service).
    """
    if request.module.__name__ == "test_gui_e2e":
        yield
        return
    config = isolated_config(request.getfixturevalue("tmp_path"), request.getfixturevalue("monkeypatch"))
    warnings = fail_on_qt_warnings()
    next(config)
    next(warnings)
    yield
    try:
        next(warnings, None)  # fails the test here if Qt warned
    finally:
        next(config, None)


# How long a modal dialog may wait for its answer in a test. Tests answer theirs within milliseconds (a timer
# clicks the button); one nobody answers would block the test in Qt's own event loop, where pytest-timeout's
# signal cannot interrupt it, and hang the whole run.
UNANSWERED_DIALOG_S = 30
STATIC_DIALOGS = {
    QMessageBox: ("question", "information", "warning", "critical", "about"),
    QInputDialog: ("getText", "getInt", "getDouble", "getItem", "getMultiLineText"),
    QFileDialog: ("getOpenFileName", "getOpenFileNames", "getSaveFileName", "getExistingDirectory"),
}


@pytest.fixture(autouse=True)
def _no_unanswered_dialog(monkeypatch):
    """A modal dialog nobody answers fails its test (closed after UNANSWERED_DIALOG_S) instead of hanging the run;
    the static ones (QMessageBox.question, QFileDialog.getOpenFileName, ...) fail at once unless the test
    replaced them with its answer."""
    left: list[str] = []
    for cls in (QDialog, QMessageBox):
        original = cls.exec

        def exec_guarded(self, *args, _original=original):
            def give_up() -> None:
                if self.isVisible():
                    text = self.text() if isinstance(self, QMessageBox) else ""
                    left.append(f"{type(self).__name__} {self.windowTitle()!r} {text!r}")
                    self.reject()

            timer = QTimer(self)
            timer.setSingleShot(True)
            timer.timeout.connect(give_up)
            timer.start(UNANSWERED_DIALOG_S * 1000)
            try:
                return _original(self, *args)
            finally:
                timer.stop()

        monkeypatch.setattr(cls, "exec", exec_guarded)
    for cls, names in STATIC_DIALOGS.items():
        for name in names:

            def refuse(*args, _name=f"{cls.__name__}.{name}", **kwargs):
                raise AssertionError(f"{_name} opened a modal dialog the test does not answer")

            monkeypatch.setattr(cls, name, refuse)
    yield
    assert not left, f"a modal dialog was left unanswered: {left}"


@pytest.fixture
def settings(tmp_path) -> QSettings:
    """The wizard's own settings file, private to the test."""
    return QSettings(str(tmp_path / "wizard.ini"), QSettings.Format.IniFormat)
