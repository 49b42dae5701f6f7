"""Ongoing problems, logged once when each starts and once when it clears, never once per attempt.

The supervisor ticks ten times a second and telemetry arrives every second: a condition that lasts
(a full disk, a job folder that cannot be read) would otherwise write the same traceback into the
engine's log thousands of times, on the very disk that may be full.
"""

from __future__ import annotations

import logging
import threading

from rigpilot.engine.diskspace import is_disk_full


class Conditions:
    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._active: dict[str, str] = {}  # key -> the cause it was logged for
        self._lock = threading.Lock()

    def failing(self, key: str, line: str, error: BaseException | None = None, *, cause: str | None = None) -> None:
        """Log `line` unless `key` is failing for that `cause` (default: the line itself) already. An unexpected
        error (a bug) gets its traceback, once; a full disk is a condition, not a bug, and gets the line alone."""
        cause = line if cause is None else cause
        with self._lock:
            if self._active.get(key) == cause:
                return
            self._active[key] = cause
        if error is not None and not is_disk_full(error):
            self._log.error("%s", line, exc_info=error)
        else:
            self._log.warning("%s", line)

    def cleared(self, key: str, line: str | None = None) -> None:
        """`key` works again: say so (`line`) if it was failing."""
        with self._lock:
            if self._active.pop(key, None) is None:
                return
        if line:
            self._log.info("%s", line)

    def active(self, key: str) -> bool:
        with self._lock:
            return key in self._active
