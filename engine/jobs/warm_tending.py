"""When the warm worker runs: started while the engine is idle and memory allows, stopped when memory runs short.

One reason to change: the policy around engine.launch.warm's worker (which holds torch imported so ranks
start without importing it). Idle means no job running, starting or queued, so its imports (seconds of CPU)
never compete with a job; memory allows means at least warm.MIN_AVAILABLE_BYTES available (it holds about
0.5-1 GiB). A worker that failed is tried again later, less and less often.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from rigpilot.engine import paths
from rigpilot.engine.errors import UserError
from rigpilot.engine.launch import warm
from rigpilot.engine.runtime import worker_python

log = logging.getLogger(__name__)


class WarmTending:
    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.worker: warm.WarmWorker | None = None  # made when first started
        # Not in the engine's first seconds, while the app that started it may still be drawing its first frames.
        self.check_at = time.monotonic() + 2.0
        self._retry_at = 0.0
        self._failures = 0

    def tend(self, wanted: bool, busy: Callable[[], bool], niceness: int) -> None:
        """Start the worker (at the jobs' `niceness`) when `wanted`, the engine is not `busy` and memory allows;
        stop it when memory runs short."""
        now = time.monotonic()
        if not (wanted and warm.enabled()) or now < self.check_at:
            return
        self.check_at = now + 1.0
        if self.worker is None:
            self.worker = warm.WarmWorker(paths.runtime_dir(), self.log_path)
        w = self.worker
        if w.running():
            if not warm.memory_allows(int(psutil.virtual_memory().available * 2)):
                log.info("warm worker stopped: memory is short")
                w.stop()
            elif w.ready():
                self._failures = 0
            return
        if w.popen is not None and w.popen.returncode == 0:
            w.popen = None  # it retired (the engine environment changed): a fresh one when idle
        elif w.popen is not None:  # it failed or was killed: try again later, less and less often
            self._failures += 1
            self._retry_at = now + min(30.0 * 2**self._failures, 3600.0)
            log.warning("warm worker exited with %s; see %s", w.popen.returncode, w.log_path)
            w.popen = None
        if now < self._retry_at or busy() or not warm.memory_allows():
            return
        try:
            python = worker_python()
        except UserError:
            return
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        w.start(python, env, niceness)

    def make_way(self) -> None:
        """A job is starting: a worker still importing would take the CPU its ranks need to start."""
        if self.worker is not None and self.worker.running() and not self.worker.ready():
            self.worker.stop()

    def socket_for(self, python: str) -> str | None:
        """The socket of a ready worker that runs `python`, for ranks to start through; None: start afresh."""
        if self.worker is not None and self.worker.ready() and self.worker.python == python:
            return str(self.worker.socket_path)
        shared = os.environ.get(warm.SHARED_ENV)
        if shared and os.path.exists(shared):
            return shared  # it declines a rank whose interpreter or import-time variables differ from its own
        return None

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()
