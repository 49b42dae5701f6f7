"""EngineLink once its window has closed: requests in flight still reach the engine, but their answers
are dropped, and nothing new is sent (a late request would otherwise start an engine service again)."""

from __future__ import annotations

import threading
from typing import Any

import shiboken6

from rigpilot.app.engine_link import EngineLink


class SlowClient:
    """Answers each request once `release` is set; records what it was asked."""

    def __init__(self, asked: list[str], release: threading.Event):
        self.asked = asked
        self.release = release
        self.autostart = True

    def request(self, rtype: str, **args: Any) -> dict[str, Any]:
        self.asked.append(rtype)
        try:
            if not self.release.wait(10):
                raise TimeoutError("the test never released the request")
            if rtype == "broken":
                raise ConnectionError("engine went away")
            return {"rtype": rtype}
        finally:
            self.asked.append(f"{rtype} answered")


def make_link(asked: list[str], release: threading.Event) -> tuple[EngineLink, list[str], list[SlowClient]]:
    made: list[str] = []
    clients: list[SlowClient] = []

    def factory(**kw: Any) -> SlowClient:
        made.append(kw["client_name"])
        clients.append(SlowClient(asked, release))
        return clients[-1]

    return EngineLink(client_factory=factory), made, clients


def test_answers_arrive_while_the_link_is_open(qtbot):
    asked: list[str] = []
    release = threading.Event()
    release.set()
    link, _, _ = make_link(asked, release)
    answers: list[Any] = []
    link.call("jobs", on_done=answers.append)
    link.call("broken", on_error=answers.append)
    qtbot.waitUntil(lambda: len(answers) == 2, timeout=5000)
    assert {"rtype": "jobs"} in answers
    assert any(isinstance(a, ConnectionError) for a in answers)


def test_after_stop_answers_in_flight_are_dropped_and_nothing_new_is_sent(qtbot):
    asked: list[str] = []
    release = threading.Event()
    link, made, clients = make_link(asked, release)
    answers: list[Any] = []
    link.call("cancel", on_done=answers.append, on_error=answers.append, job="j1")
    link.call("broken", on_done=answers.append, on_error=answers.append)
    qtbot.waitUntil(lambda: len(asked) == 2, timeout=5000)  # both are with the engine
    assert clients and all(c.autostart for c in clients)
    link.stop()
    # A request that loses its engine after this reconnects without starting one.
    assert all(not c.autostart for c in clients)
    release.set()
    link.call("jobs", on_done=answers.append, on_error=answers.append)
    link.start()
    qtbot.waitUntil(lambda: len(asked) == 4, timeout=5000)
    qtbot.wait(100)  # the answers are queued to the GUI thread by now
    assert sorted(asked) == ["broken", "broken answered", "cancel", "cancel answered"]  # the cancel reached the engine; "jobs" was never sent
    assert answers == []  # neither the answer nor the error reached the closed window
    assert "gui-stream" not in made  # start() after stop() starts no stream


def test_a_result_for_a_deleted_widget_is_dropped(qtbot):
    from PySide6.QtWidgets import QLabel

    from rigpilot.app.tasks import run_in_background

    label, alive = QLabel(), QLabel()
    qtbot.addWidget(alive)
    label.deleteLater()
    qtbot.waitUntil(lambda: not shiboken6.isValid(label), timeout=2000)
    run_in_background(lambda: "late", label.setText)  # would raise: the C++ object is gone
    run_in_background(lambda: "on time", alive.setText)
    qtbot.waitUntil(lambda: alive.text() == "on time", timeout=5000)


def test_a_notice_heard_on_both_connections_is_passed_on_once(qtbot):
    hooks: list[Any] = []

    def factory(**kw: Any) -> SlowClient:
        hooks.append(kw["on_notice"])
        release = threading.Event()
        release.set()
        return SlowClient([], release)

    link = EngineLink(client_factory=factory)
    heard: list[dict] = []
    link.sig_notice.connect(heard.append)
    done: list[Any] = []
    link.call("jobs", on_done=done.append)
    qtbot.waitUntil(lambda: bool(done))
    notice = {"code": "telemetry_reset", "message": "the telemetry history was reset", "time": 5.0}
    for hook in (hooks[0], hooks[0], *hooks):  # the request client twice, as it reconnects; then every client
        hook(dict(notice))
    assert heard == [notice]
    later = {**notice, "time": 6.0}
    hooks[0](later)
    assert heard == [notice, later]
    link.stop()
