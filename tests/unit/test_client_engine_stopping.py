"""A client meeting a service that is stopping: greeted by a socket that accepts and then hangs up, it says so
in one line (or, when it may start one, gets the next service); it never raises a bare ConnectionError."""

from __future__ import annotations

import socket
import threading

import pytest

from rigpilot.engine.api import client as client_module
from rigpilot.engine.api.client import EngineClient, EngineUnavailable


def test_a_service_that_hangs_up_on_the_greeting_is_one_line_not_a_traceback(tmp_path, monkeypatch):
    path = tmp_path / "engine.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)
    accepted = []

    def hang_up() -> None:  # what a stopping service does with a connection it took: closes it unanswered
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(conn)
            conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    monkeypatch.setattr(client_module.paths, "socket_path", lambda: path)
    monkeypatch.setattr(client_module, "START_TIMEOUT_S", 0.5)
    try:
        with pytest.raises(EngineUnavailable, match="hung up before it answered: it is stopping"):
            EngineClient(autostart=False, timeout=5).connect()
        assert len(accepted) == 1  # without autostart it does not keep knocking
        # With autostart it tries again until its deadline, then says the same in one line.
        with pytest.raises(EngineUnavailable, match="hung up before it answered"):
            EngineClient(autostart=True, timeout=5).connect()
        assert len(accepted) > 1
    finally:
        server.close()
