import os
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# Plans are verified by a traced step (seconds each): only the tests of that turn it on.
os.environ.setdefault("RIGPILOT_PLAN_VERIFY", "0")
# Every test engine would import torch in a warm worker while idle: only the warm-worker tests turn it on.
os.environ.setdefault("RIGPILOT_WARM_WORKER", "0")

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
