import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

_XDG = {"XDG_RUNTIME_DIR": "run", "XDG_STATE_HOME": "state", "XDG_CONFIG_HOME": "config", "XDG_DATA_HOME": "data"}


def pytest_configure(config):
    """The whole session runs with its own XDG folders, so no test can touch the user's jobs or settings.

    Tests that need their own folders still set them; this catches the rest, such as a GUI request
    that autostarts an engine service after a test's own environment was undone.
    """
    base = Path(tempfile.mkdtemp(prefix="rigpilot-tests-"))
    for var, sub in _XDG.items():
        (base / sub).mkdir(mode=0o700)
        os.environ[var] = str(base / sub)
    config.rigpilot_xdg = base


def pytest_unconfigure(config):
    base = getattr(config, "rigpilot_xdg", None)
    if base is None:
        return
    from engine.service.client import EngineClient, service_running

    if service_running():  # one that something started in the session's folders
        with contextlib.suppress(Exception), EngineClient(autostart=False, timeout=10) as c:
            c.request("shutdown")
    shutil.rmtree(base, ignore_errors=True)

REPO = Path(__file__).resolve().parents[1]
# Real nvidia-smi outputs live beside the checkout (../shared), also in CI.
SMI_DATA = REPO.parent / "shared" / "testdata" / "nvidia-smi"


@pytest.fixture
def smi_data() -> Path:
    if not SMI_DATA.is_dir():
        pytest.fail(f"test data missing: {SMI_DATA} (the shared/ folder must sit beside the checkout)")
    return SMI_DATA


@pytest.fixture(autouse=True)
def _gui_test_isolation(request):
    """In every GUI test, a Qt warning fails the test and settings go to a temporary folder, never the user's.

    The end-to-end test sets up its own (it also runs a real engine service).
    """
    module = request.module.__name__
    if not module.startswith("test_gui_") or module == "test_gui_e2e":
        yield
        return
    from gui_fakes import fail_on_qt_warnings, isolated_config

    config = isolated_config(request.getfixturevalue("tmp_path"), request.getfixturevalue("monkeypatch"))
    warnings = fail_on_qt_warnings()
    next(config)
    next(warnings)
    yield
    try:
        next(warnings, None)  # fails the test here if Qt warned
    finally:
        next(config, None)
