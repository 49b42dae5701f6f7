"""A full disk: how Rigpilot recognises one, measures it and says so in one line.

Workers, the supervisor, the job store and the socket server all meet the same condition (ENOSPC,
a quota's EDQUOT, SQLite's "database or disk is full") and answer it the same way: `DiskFull`, a
UserError that names the folder, what was needed where that is known, and what is free, e.g.
"disk full: /home/u/.local/state/rigpilot/jobs/ab12cd/checkpoints needs about 1.2 GiB for step-600, 80.0 MiB free".
Free space is what an unprivileged user may still write (statvfs f_bavail, as `df` shows it).
"""

from __future__ import annotations

import errno
import os
import sqlite3
import time
from pathlib import Path

from rigpilot.engine.errors import UserError

_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# A folder with less room than this is full for any purpose: a failure there is taken for a full disk even where
# the error lost its errno on the way (torch wraps a callback's OSError in a RuntimeError's text).
NO_ROOM_BYTES = 1 << 20


class DiskFull(UserError):
    """A write found no room: the job or request fails in one line, and nothing already written is lost."""

    def __init__(
        self, folder: Path | str, free: int | None, needed: int | None = None, what: str = "",
        failed_at: float | None = None,
    ) -> None:  # fmt: skip
        self.folder = str(folder)
        self.free = free
        self.needed = needed
        self.what = what  # what the space was for ("for step-600"), said after the size
        self.failed_at = failed_at or time.time()  # when the write failed (seconds since the epoch)
        # The fields are what clients word it from, never the line (as an error record or reply carries them).
        super().__init__(self.line(), reason="disk_full", folder=self.folder, needed_bytes=needed, free_bytes=free,
                         failed_at=self.failed_at)  # fmt: skip

    def line(self) -> str:
        free = "an unknown amount" if self.free is None else human_size(self.free)
        if self.needed is None:
            return f"disk full: {self.folder} has {free} free" + (f" ({self.what})" if self.what else "")
        what = f" {self.what}" if self.what else ""
        return f"disk full: {self.folder} needs about {human_size(self.needed)}{what}, {free} free"


def human_size(n: float) -> str:
    """Bytes as the disk-full lines say them: "80.0 MiB", "1.2 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def is_disk_full(e: BaseException | None) -> bool:
    """Whether `e`, or an error it was raised from, is a write refused for want of space."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return True
        if isinstance(e, sqlite3.OperationalError) and "database or disk is full" in str(e):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def free_bytes(path: Path | str) -> int | None:
    """Bytes an unprivileged user may still write on the filesystem holding `path` (or its nearest existing parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def folder_bytes(path: Path | str) -> int:
    """What the files under `path` take (apparent sizes; 0 where it cannot be read)."""
    total = 0
    for top, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(top, name)).st_size
            except OSError:
                continue
    return total


def no_room(folder: Path | str) -> bool:
    """Whether `folder`'s filesystem is full (less than NO_ROOM_BYTES free)."""
    free = free_bytes(folder)
    return free is not None and free < NO_ROOM_BYTES


def disk_full(folder: Path | str, needed: int | None = None, what: str = "") -> DiskFull:
    """The DiskFull for `folder` as it is now."""
    return DiskFull(folder, free_bytes(folder), needed, what)


def check_room(folder: Path | str, needed: int, what: str = "") -> None:
    """Raise DiskFull unless `folder`'s filesystem has `needed` bytes free."""
    free = free_bytes(folder)
    if free is not None and free < needed:
        raise DiskFull(folder, free, needed, what)
