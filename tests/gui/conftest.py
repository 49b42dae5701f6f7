"""The window's tests: PySide6 widgets offscreen (or on Xvfb, for the X11 ones) over a FakeLink or a real engine.

A module here is named test_gui_*. Its fakes and page helpers are in tests/support (gui_fakes, gui_jobs,
gui_planner, gui_settings, gui_wizard).
"""

import pytest
from PySide6.QtCore import QSettings

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


@pytest.fixture
def settings(tmp_path) -> QSettings:
    """The wizard's own settings file, private to the test."""
    return QSettings(str(tmp_path / "wizard.ini"), QSettings.Format.IniFormat)
