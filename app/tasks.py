"""The one way the GUI runs work off its thread.

    run_in_background(lambda: client.request("jobs"), on_done=self._show_jobs, on_error=self._show_error)

`fn` runs on a worker thread and must not touch widgets; `on_done` and
`on_error` run on the GUI thread. Errors never vanish: without an `on_error`
they go to the application's error sink (a status-bar message).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import shiboken6
from PySide6.QtCore import QObject, Signal

log = logging.getLogger(__name__)


class _Dispatcher(QObject):
    """Lives on the GUI thread; a signal emitted from a worker is queued to it."""

    sig_call = Signal(object, object)

    def __init__(self) -> None:
        super().__init__()
        self.sig_call.connect(self._call)

    @staticmethod
    def _call(fn: Callable[[Any], None], arg: Any) -> None:
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, QObject) and not shiboken6.isValid(owner):
            log.debug("dropped a result for a deleted %s", type(owner).__name__)  # its window closed meanwhile
            return
        fn(arg)


WORKERS = 4
_pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="gui-task")
_dispatcher: _Dispatcher | None = None
_error_sink: Callable[[BaseException], None] = lambda e: log.error("background task failed: %s", e)  # noqa: E731


def set_error_sink(sink: Callable[[BaseException], None]) -> None:
    global _error_sink
    _error_sink = sink


def report_error(error: BaseException) -> None:
    """Hand an error nobody else handles to the application's error sink (on the GUI thread)."""
    _error_sink(error)


def start() -> None:
    """Make the dispatcher and start every worker thread now, on the GUI thread, once QApplication exists.

    The app calls it at start-up; the first `run_in_background` does it otherwise. The pool would start a
    thread on each of its first submits, and `Thread.start` waits until the new thread has run: on a busy
    machine that wait, inside the click that opened a job page (four requests at once), was the longest
    stall of the session's first open (benchmarks/gui_job_open.py).
    """
    global _dispatcher
    if _dispatcher is not None:
        return
    _dispatcher = _Dispatcher()
    # Each worker waits for the others, so none is idle for the next submit to reuse: WORKERS threads.
    met = threading.Barrier(WORKERS)
    for _ in range(WORKERS):
        _pool.submit(_meet, met)


def _meet(met: threading.Barrier) -> None:
    try:
        met.wait(timeout=10)
    except threading.BrokenBarrierError:  # a thread that could not start in time: the pool starts it later
        pass


def _dispatch() -> _Dispatcher:
    if _dispatcher is None:
        start()
    assert _dispatcher is not None
    return _dispatcher


def run_on_gui_thread(fn: Callable[[Any], None], arg: Any = None) -> None:
    _dispatch().sig_call.emit(fn, arg)


def run_in_background(
    fn: Callable[[], Any],
    on_done: Callable[[Any], None] | None = None,
    on_error: Callable[[BaseException], None] | None = None,
) -> None:
    d = _dispatch()

    def work() -> None:
        try:
            result = fn()
        except BaseException as e:  # every failure is reported on the GUI thread
            d.sig_call.emit(on_error or report_error, e)
            return
        if on_done is not None:
            d.sig_call.emit(on_done, result)

    _pool.submit(work)
