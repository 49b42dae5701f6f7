"""A desktop notification when a job the window knew of completes, fails or restarts by itself, while the user
looks elsewhere.

Which changes count is the engine's decision (engine.jobs.notify.event_of, the one its webhook follows): a
cancel is the user's own doing and says nothing. Only while the window is not the active one: a user looking at
it sees the job change in place, and gets the status bar line instead. Settings → Display turns it off
(QSettings, as the app keeps its own preferences).

Sent to the freedesktop Notifications service on the session bus through `gdbus` (GLib's, on every desktop
that has the service), else `notify-send`, else not at all. Not through QtDBus: PySide6 cannot marshal the
uint32 and string-array arguments Notify takes (it sends int32 and a variant array, which the service refuses).
Started detached, so the window never waits on a busy notification daemon.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QProcess, QSettings

from rigpilot.app.identity import APP_ID, APP_NAME
from rigpilot.engine.jobs.notify import event_of, message_of

KEY_DESKTOP_NOTIFICATIONS = "notifications/desktop"
ICON = APP_ID  # the desktop file's icon name, as the window's
EXPIRE_MS = 10000
TITLES = {"completed": "{name} completed", "failed": "{name} failed", "restarted": "{name} restarts"}


@dataclass(frozen=True)
class Notification:
    event: str
    title: str
    body: str
    urgency: int  # the freedesktop hint: 1 normal, 2 critical (stays until read)


def notification_for(job: dict[str, Any], before: dict[str, Any] | None) -> Notification | None:
    """What to show for `job`'s new view, given the view the window had of it (None: unknown to it)."""
    seen = (int(before.get("run") or 0), str(before.get("state"))) if before else None
    event = event_of(job, seen)
    if event is None:
        return None
    name = job.get("name") or job.get("id")
    return Notification(event, TITLES[event].format(name=name), message_of(event, job), 2 if event == "failed" else 1)


def enabled(settings: QSettings | None = None) -> bool:
    raw = (settings or QSettings()).value(KEY_DESKTOP_NOTIFICATIONS, True)
    return raw not in (False, "false", "0", 0)


def save_enabled(on: bool, settings: QSettings | None = None) -> None:
    s = settings or QSettings()
    s.setValue(KEY_DESKTOP_NOTIFICATIONS, bool(on))
    s.sync()


def _gvariant_string(text: str) -> str:
    """`text` as a GVariant string literal: gdbus parses every argument, so a quote in a job's name stays text."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def command_for(n: Notification, which: Callable[[str], str | None] = shutil.which) -> list[str] | None:
    """The argv that shows `n` (no shell), or None when neither gdbus nor notify-send is installed."""
    if gdbus := which("gdbus"):
        return [
            gdbus, "call", "--session", "--dest=org.freedesktop.Notifications",
            "--object-path=/org/freedesktop/Notifications", "--method=org.freedesktop.Notifications.Notify",
            _gvariant_string(APP_NAME), "0", _gvariant_string(ICON), _gvariant_string(n.title),
            _gvariant_string(n.body), "[]", f"{{'urgency': <byte {n.urgency}>}}", "--", str(EXPIRE_MS),
        ]  # fmt: skip
    if send := which("notify-send"):
        level = "critical" if n.urgency == 2 else "normal"
        return [send, f"--app-name={APP_NAME}", f"--icon={ICON}", f"--urgency={level}", "--", n.title, n.body]
    return None


def has_session_bus(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a session bus is there to ask: without one, gdbus and notify-send would autolaunch a bus daemon."""
    if environ.get("DBUS_SESSION_BUS_ADDRESS"):
        return True
    runtime = environ.get("XDG_RUNTIME_DIR")
    return runtime is not None and runtime != "" and os.path.exists(os.path.join(runtime, "bus"))


def send(n: Notification) -> bool:
    """Show `n` on the desktop; False when there is no way to (the caller then says it in the window)."""
    argv = command_for(n) if has_session_bus() else None
    if argv is None:
        return False
    ok, _pid = QProcess.startDetached(argv[0], argv[1:])
    return bool(ok)
