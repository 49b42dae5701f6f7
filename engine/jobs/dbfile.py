"""One of the engine's SQLite files, checked before it is trusted and set aside when it cannot serve.

SQLite keeps its promises only for the file it wrote. A file truncated or overwritten, a folder or a
FIFO where the file should be, another database's WAL left beside it, or a schema from a newer
Rigpilot answers every query with an error (or, a FIFO, never answers). So each database is checked
at start (`prepare`: the file's type, its header, SQLite's `quick_check`, the schema version), and
watched while the engine runs (`Watch`: the file replaced, removed or overwritten under the open
connection; `damage_of`: a query answering SQLITE_CORRUPT or SQLITE_NOTADB). A file that cannot
serve is renamed aside with a timestamp, its -wal and -shm with it, never deleted: it may still hold
something its user wants back.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from rigpilot.engine.errors import UserError

SQLITE_ERROR, SQLITE_CORRUPT, SQLITE_NOTADB = 1, 11, 26
_MAGIC = b"SQLite format 3\x00"
_SIDECARS = ("-wal", "-shm")
WATCH_PERIOD_S = 1.0  # how often a Watch looks at its file (tests set 0)


@dataclass
class SetAside:
    """A database file moved out of the way, and why."""

    reason: str  # why the file could not serve, in words: "it is a folder", "database disk image is malformed"
    cause: str  # "damaged", "newer" (a newer Rigpilot's schema) or "missing" (only its -wal/-shm were left)
    moved_to: Path | None  # where it went; None when it could not be moved (or there was nothing but sidecars)


def damage_of(e: BaseException) -> str | None:
    """The words for an error that means the file itself is damaged (not busy, not full), else None."""
    if isinstance(e, sqlite3.DatabaseError) and (getattr(e, "sqlite_errorcode", 0) & 0xFF) in (
        SQLITE_CORRUPT,
        SQLITE_NOTADB,
    ):
        return str(e)
    return None


def unusable_at_open(e: BaseException) -> str | None:
    """Like `damage_of`, for an error while a checked file is first opened and brought to the current schema:
    there a plain SQL error (a table without the columns it must have) also means the file is not what it
    should be."""
    if isinstance(e, sqlite3.DatabaseError) and (getattr(e, "sqlite_errorcode", 0) & 0xFF) == SQLITE_ERROR:
        return str(e)
    return damage_of(e)


def check_folder(path: Path, what: str) -> None:
    """Refuse, in one line, a database whose folder the engine cannot write: SQLite needs its -wal and -shm there."""
    folder = path.parent
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(
            f"the engine cannot write in {folder}, where it keeps its {what} ({path.name}); make the folder "
            f"writable again (chmod 700 {folder}) and start the engine again; jobs that run keep running"
        )
    if path.exists() and path.is_file() and not os.access(path, os.R_OK | os.W_OK):
        raise UserError(f"the engine cannot write its {what} {path}; make it writable again (chmod 600 {path})")


def examine(path: Path, *, schema_version: int, table: str, columns: frozenset[str] = frozenset()) -> SetAside | None:
    """Why the file at `path` cannot serve as the database whose main table is `table` (with at least `columns`),
    or None.

    None also when there is no file yet. Opens the file only once its type and header say it is a
    SQLite database, so a FIFO or a device is never read.
    """
    try:
        st = path.lstat()
    except FileNotFoundError:
        if any(Path(f"{path}{s}").exists() for s in _SIDECARS):
            return SetAside("only its -wal and -shm files were there", "missing", None)
        return None
    if stat.S_ISLNK(st.st_mode):
        try:
            st = path.stat()
        except OSError:
            return SetAside("it is a link to nothing", "damaged", None)
    if stat.S_ISDIR(st.st_mode):
        return SetAside("it is a folder, not a file", "damaged", None)
    if not stat.S_ISREG(st.st_mode):
        return SetAside(f"it is a {_file_type(st.st_mode)}, not a file", "damaged", None)
    if st.st_size == 0:
        return SetAside("it is empty (0 bytes)", "damaged", None)
    try:
        with path.open("rb") as f:
            header = f.read(len(_MAGIC))
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if header != _MAGIC:
        return SetAside("it is not a SQLite database (its first bytes are something else)", "damaged", None)
    try:
        db = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=10)
    except sqlite3.Error as e:
        raise UserError(f"cannot open {path}: {e}") from None
    try:
        problems = [row[0] for row in db.execute("PRAGMA quick_check(3)")]
        if problems != ["ok"]:
            return SetAside(
                f"SQLite's quick_check found damage: {'; '.join(map(str, problems))[:300]}", "damaged", None
            )
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > schema_version:
            return SetAside(
                f"a newer Rigpilot wrote it (schema {version}; this one reads {schema_version})", "newer", None
            )
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if tables and table not in tables:
            return SetAside(f"it holds no {table} table (another program's database?)", "damaged", None)
        have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        if table in tables and not columns <= have:
            lacking = ", ".join(sorted(columns - have))
            return SetAside(
                f"its {table} table lacks the columns {lacking} (another program's table?)", "damaged", None
            )
    except sqlite3.DatabaseError as e:
        why = damage_of(e)
        if why is None:
            raise UserError(f"cannot read {path}: {e}") from None
        return SetAside(why, "damaged", None)
    finally:
        db.close()
    return None


def move_aside(path: Path, cause: str) -> Path | None:
    """Rename `path` (and its -wal and -shm) to `<stem>.<cause>-<YYYYmmdd-HHMMSS>[-n]<suffix>`; the new name,
    or None when there was nothing to move.

    Raises OSError when the folder does not allow it.
    """
    if not any(os.path.lexists(f"{path}{s}") for s in ("", *_SIDECARS)):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    n = 0
    while True:
        target = path.with_name(f"{path.stem}.{cause}-{stamp}{f'-{n}' if n else ''}{path.suffix}")
        if not any(os.path.lexists(f"{target}{s}") for s in ("", *_SIDECARS)):
            break
        n += 1
    for s in ("", *_SIDECARS):
        if os.path.lexists(f"{path}{s}"):
            os.rename(f"{path}{s}", f"{target}{s}")
    return target


def prepare(
    path: Path, *, what: str, schema_version: int, table: str, columns: frozenset[str] = frozenset()
) -> tuple[SetAside | None, bool]:
    """Make `path` safe to open: refuse an unwritable folder, set aside a file that cannot serve.

    Returns what was set aside (or None) and whether a database file was there to begin with (so the
    caller knows a new one is about to be made, which may need filling from elsewhere).
    """
    check_folder(path, what)
    aside = examine(path, schema_version=schema_version, table=table, columns=columns)
    if aside is None:
        return None, path.exists()
    return set_aside(path, aside, what), False


def set_aside(path: Path, aside: SetAside, what: str) -> SetAside:
    """Move the file `aside` speaks of out of the way (filling in `moved_to`); a refusal in one line when it cannot."""
    try:
        aside.moved_to = move_aside(path, aside.cause)
    except OSError as e:
        raise UserError(
            f"the engine's {what} {path} cannot be used ({aside.reason}) and cannot be moved aside "
            f"({e.strerror}); move it away by hand and start the engine again"
        ) from None
    return aside


class Watch:
    """Notices the file of an open database being replaced, removed or overwritten from outside.

    The open connection would go on reading its cache and writing to a file nobody will open again,
    or into bytes that are no longer a database. Checked at most once a second (a stat and a 16-byte
    read), so it costs nothing a request would feel.
    """

    def __init__(self, path: Path):
        self.path = path
        st = os.stat(path)
        self._identity = (st.st_dev, st.st_ino)
        self._next = 0.0

    def check(self) -> str | None:
        """What happened to the file, in words, or None while it is still the database that was opened."""
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + WATCH_PERIOD_S
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return "it was removed while the engine ran"
        except OSError as e:
            return f"it cannot be reached ({e.strerror})"
        if (st.st_dev, st.st_ino) != self._identity:
            return "another file replaced it while the engine ran"
        try:
            with open(self.path, "rb") as f:
                header = f.read(len(_MAGIC))
        except OSError as e:
            return f"it cannot be read ({e.strerror})"
        if header != _MAGIC:
            return "it was overwritten while the engine ran: it is no longer a SQLite database"
        return None


def _file_type(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"
