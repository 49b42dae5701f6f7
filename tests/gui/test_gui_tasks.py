"""The GUI's task pool: its threads start with the app, not inside the first click that needs one."""

from __future__ import annotations

import threading

from rigpilot.app import tasks


def test_every_worker_thread_is_running_once_the_pool_has_started(qapp):
    tasks.start()
    running = [t for t in threading.enumerate() if t.name.startswith("gui-task")]
    assert len(running) == tasks.WORKERS
    tasks.start()  # a second start (the first run_in_background after the app's) starts nothing more
    assert len([t for t in threading.enumerate() if t.name.startswith("gui-task")]) == tasks.WORKERS
