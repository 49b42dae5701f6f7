"""Telling a user who is not watching that a job ended, failed or restarted: a webhook and a command from Settings.

For a headless box, where no app shows a desktop notification. The user's Settings (the engine's own user's,
`notify_webhook` and `notify_command`) name the targets; each gets one small JSON object per event:
{event, job, name, kind, state, exit_reason, time, message}, `message` in plain words. The webhook gets it as a
POST; the command on its stdin, with RIGPILOT_NOTIFY_EVENT, _JOB and _STATE in its environment, run directly
(never through a shell, so nothing in a job's name is ever run).

Events: "completed", "failed" (a job that ended unsuccessfully and waits for the user) and "restarted" (a job
that failed and was queued again by itself, engine.jobs.recovery). A cancel sends nothing: the user who
cancelled knows already, and a message for each of a sweep's cancelled jobs would bury the one that failed.
A job "stalled" is not an event: the engine has no detector of a job that stopped making progress while its
processes live (only ranks that died are noticed), and this module does not invent one.

The supervisor announces jobs under its lock, so `observe` only decides and queues; one thread sends, with a
short timeout per target. A target that fails is logged once with the reason (again only after it worked
once more), and nothing is raised; a webhook URL is logged by its scheme and host alone, as its path or
query may hold a token.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from rigpilot.engine.jobs.store import COMPLETED, FAILED, INTERRUPTED, QUEUED
from rigpilot.engine.settings import Settings, check_command

log = logging.getLogger(__name__)

EVENTS = ("completed", "failed", "restarted")
TIMEOUT_S = 10.0  # per target and event: a receiver slower than this is counted as failed


def event_of(job: dict[str, Any], before: tuple[int, str] | None) -> str | None:
    """The event a job's new view makes, given the (run, state) this engine last announced of it (None: not
    seen since the engine started: a view of a job that ended before then, say renamed, is no news)."""
    if before is None or job.get("id") is None:
        return None
    run, state = int(job.get("run") or 0), str(job.get("state"))
    if (run, state) == before:
        return None
    if state == COMPLETED:
        return "completed"
    if state in (FAILED, INTERRUPTED):
        return "failed"
    restarts = job.get("restarts") or []
    if state == QUEUED and restarts and restarts[-1].get("run") == run - 1:
        return "restarted"  # a user's resume also queues the next run, without a restart entry for it
    return None


def message_of(event: str, job: dict[str, Any]) -> str:
    who = f"Job {job.get('name') or job.get('id')} ({job.get('id')})"
    reason = job.get("exit_reason")
    if event == "completed":
        return f"{who} completed."
    if event == "failed":
        return f"{who} {'was interrupted' if job.get('state') == INTERRUPTED else 'failed'}" + (
            f": {reason}" if reason else "."
        )
    cause = ((job.get("restarts") or [{}])[-1]).get("cause")
    return f"{who} failed and restarts by itself as run {job.get('run')}" + (f": {cause}" if cause else ".")


def payload_of(event: str, job: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    restarts = job.get("restarts") or []
    reason = job.get("exit_reason") or (restarts[-1].get("cause") if event == "restarted" and restarts else None)
    ended = job.get("ended")
    when = float(ended) if event != "restarted" and isinstance(ended, int | float) else (now or time.time())
    return {
        "event": event, "job": job.get("id"), "name": job.get("name"), "kind": job.get("kind"),
        "state": job.get("state"), "exit_reason": reason,
        "time": datetime.fromtimestamp(when, UTC).isoformat(timespec="seconds"),
        "message": message_of(event, job),
    }  # fmt: skip


def shown_url(url: str) -> str:
    """The URL as a log may show it: scheme and host (and port), never the path, query or user, which may hold a token."""
    try:
        parts = urlsplit(url)
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "the webhook URL"
    return f"{parts.scheme}://{parts.hostname}{port}/…"


class Notifier:
    """Decides on each job view the supervisor announces and sends its event to the user's targets."""

    def __init__(self, settings: Callable[[], Settings] = Settings.load, timeout_s: float = TIMEOUT_S) -> None:
        self._settings = settings
        self._timeout_s = timeout_s
        self._seen: dict[str, tuple[int, str]] = {}
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._failing: set[str] = set()  # targets whose last try failed, so each failure is logged once
        self._warned: set[str] = set()

    def observe(self, job: dict[str, Any]) -> None:
        """Called with every job view the engine announces; never blocks, never raises."""
        job_id = job.get("id")
        if not isinstance(job_id, str):
            return
        with self._lock:  # the supervisor's thread and request handlers both announce jobs
            if job.get("state") == "deleted":
                self._seen.pop(job_id, None)
                return
            event = event_of(job, self._seen.get(job_id))
            self._seen[job_id] = (int(job.get("run") or 0), str(job.get("state")))
            if event is None:
                return
            try:
                self._queue.put(payload_of(event, job))
            except Exception:  # a view this module misreads costs its notification, never the supervisor's turn
                log.exception("notification of job %s not made", job_id)
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._send_all, name="notify", daemon=True)
                self._thread.start()

    def wait_idle(self, timeout: float) -> bool:
        """Whether every queued event was sent (or given up on) within `timeout` seconds (for tests and shutdown)."""
        end = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.02)
        return not self._queue.unfinished_tasks

    def _send_all(self) -> None:
        while True:
            payload = self._queue.get()
            try:
                self._send(payload)
            except Exception:  # a bug here must not end the thread that every later event needs
                log.exception("notification of job %s not sent", payload.get("job"))
            finally:
                self._queue.task_done()

    def _send(self, payload: dict[str, Any]) -> None:
        settings = self._settings()  # read per event: a target set in Settings works without restarting the engine
        for warning in settings.warnings:
            if warning.startswith("notify_") and warning not in self._warned:
                self._warned.add(warning)
                log.warning("%s", warning)
        body = json.dumps(payload).encode()
        if settings.notify_webhook:
            self._outcome(
                "webhook " + shown_url(settings.notify_webhook), _post(settings.notify_webhook, body, self._timeout_s)
            )
        if settings.notify_command:
            argv = check_command(settings.notify_command)
            self._outcome(f"command {argv[0]}", _run(argv, body, payload, self._timeout_s))

    def _outcome(self, target: str, problem: str | None) -> None:
        if problem is None:
            self._failing.discard(target)
        elif target not in self._failing:
            self._failing.add(target)
            log.warning("job notification to %s failed: %s (logged once until it works again)", target, problem)


def _post(url: str, body: bytes, timeout_s: float) -> str | None:
    """POST the JSON; None when the receiver took it, else the reason in a few words (never the URL)."""
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:  # http(s) only: checked in Settings
            reply.read(4096)
    except urllib.error.HTTPError as e:
        return f"the receiver answered HTTP {e.code}"
    except urllib.error.URLError as e:
        return f"cannot reach it ({e.reason})"
    except (OSError, ValueError) as e:  # a timeout mid-reply, a connection reset
        return f"{type(e).__name__}: {e}"
    return None


def _run(argv: list[str], body: bytes, payload: dict[str, Any], timeout_s: float) -> str | None:
    env = {
        **os.environ, "RIGPILOT_NOTIFY_EVENT": str(payload["event"]), "RIGPILOT_NOTIFY_JOB": str(payload["job"]),
        "RIGPILOT_NOTIFY_STATE": str(payload["state"]),
    }  # fmt: skip
    try:
        done = subprocess.run(argv, input=body, env=env, capture_output=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        return "it is not found"
    except PermissionError:
        return "it is not executable"
    except subprocess.TimeoutExpired:
        return f"it ran past {timeout_s:g} s and was stopped"
    except OSError as e:
        return f"it cannot be started ({e.strerror or e})"
    if done.returncode != 0:
        said = next((ln.strip() for ln in done.stderr.decode(errors="replace").splitlines() if ln.strip()), "")
        return f"it exited with {done.returncode}" + (f": {said[:200]}" if said else "")
    return None
