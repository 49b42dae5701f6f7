"""A window left open while Rigpilot is removed says the engine is gone, once, and stops reconnecting.

The removal is real where it matters: the interpreter the window runs on (as /opt/rigpilot/venv/bin/python
is for the package) is a link that is deleted, as the package's prerm deletes the environment, and there
is no engine service to reach, so the link's real client tries to start one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rigpilot.app.engine_link import GONE, EngineLink
from rigpilot.app.main_window import MainWindow
from rigpilot.engine import paths
from rigpilot.engine.api.client import EngineClient, EngineRemoved, removed_installation


@pytest.fixture
def removed_interpreter(tmp_path, monkeypatch) -> Path:
    """sys.executable as a link to the real one, then deleted; no engine service for this test's runtime folder."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    venv = tmp_path / "opt" / "rigpilot" / "venv" / "bin"
    venv.mkdir(parents=True)
    python = venv / "python"
    python.symlink_to(sys.executable)
    monkeypatch.setattr(sys, "executable", str(python))
    assert removed_installation() is None
    python.unlink()
    return python


def test_the_client_refuses_to_start_a_service_that_is_no_longer_installed(removed_interpreter):
    assert removed_installation() == str(removed_interpreter)
    with pytest.raises(EngineRemoved) as e:
        EngineClient().connect()
    assert "Rigpilot was removed from this computer" in str(e.value) and str(removed_interpreter) in str(e.value)
    assert not paths.service_log_path().exists()  # nothing was started: a start writes its log first


def test_the_window_says_the_engine_is_gone_and_stops_trying(qtbot, removed_interpreter):
    link = EngineLink()
    states: list[tuple[str, str]] = []
    link.sig_state.connect(lambda state, detail: states.append((state, detail)))
    window = MainWindow(link)
    qtbot.addWidget(window)
    window.show()
    try:
        qtbot.waitUntil(lambda: window.gone_bar.isVisible(), timeout=10000)
        assert "Rigpilot was removed from this computer" in window.gone_bar.text()
        assert "cannot start again" in window.gone_bar.text() and "Close this window" in window.gone_bar.text()
        assert window.connection_label.text() == "Engine: gone (Rigpilot was removed)"
        assert str(removed_interpreter) in window.gone_bar.toolTip()
        # No retrying for ever: the stream thread has ended, and GONE was the last word, said once.
        qtbot.waitUntil(lambda: link._thread is None or not link._thread.is_alive(), timeout=5000)
        qtbot.wait(300)
        assert [s for s, _ in states].count(GONE) == 1 and states[-1][0] == GONE
    finally:
        link.stop()
