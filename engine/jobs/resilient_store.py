"""The engine's two databases as the service uses them: checked at start, recovered when damaged.

The job folders are the truth. `ResilientJobStore` copies each job's row into its folder whenever
the row changes (engine.jobs.job_folders), so when engine.db cannot serve, at start (its file's
type, SQLite's quick_check, a newer schema: engine.jobs.dbfile) or while the engine runs (a query
answers SQLITE_CORRUPT or SQLITE_NOTADB, the file is replaced, removed or overwritten under it), the
file is moved aside with a timestamp, a new one is made and every job is put back from its folder.
Jobs that run keep their records, so the supervisor keeps following them. Where the new file cannot
be made (its folder went read-only under the engine), the table lives in memory until the next start,
which finds the damaged file and rebuilds again. `ResilientTelemetryStore` does the same for the
telemetry history, which is simply started afresh.

Each recovery is told once, as a `Recovery`, to `on_recovery` (the service logs it and tells each
client once); the damaged file itself is never deleted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import sqlite3
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rigpilot.engine.api.protocol import JOB_DATABASE_REBUILT, JOBS_PUT_BACK, TELEMETRY_RESET
from rigpilot.engine.diskspace import DiskFull
from rigpilot.engine.errors import UserError
from rigpilot.engine.jobs import dbfile, job_folders
from rigpilot.engine.jobs.store import SCHEMA_VERSION, JobRecord, JobStore
from rigpilot.engine.jobs.telemetry_store import TelemetryStore

log = logging.getLogger(__name__)


T = TypeVar("T")
_FIELDS = [f.name for f in dataclasses.fields(JobRecord)]
# A jobs table without these is not one a Rigpilot made (later fields get their columns added when missing).
_KEY_COLUMNS = frozenset({"id", "seq", "state", "kind", "name"})


@dataclass
class Recovery:
    """What the engine did about one of its databases by itself: the notice its users get once."""

    code: str  # JOB_DATABASE_REBUILT, JOBS_PUT_BACK or TELEMETRY_RESET
    path: Path
    cause: str = "damaged"  # "damaged", "newer" (a newer Rigpilot's schema) or "missing"
    reason: str = ""  # why the file could not serve, in words
    moved_to: Path | None = None  # where the file (or, when it was missing, its leftover -wal and -shm) went
    in_memory: str | None = None  # why the database now lives in memory until the next start
    jobs: list[str] = field(default_factory=list)  # the jobs put back from their folders
    updated: list[str] = field(default_factory=list)  # rows brought up to date from a newer record in the folder
    pieced: list[str] = field(default_factory=list)  # of those, the ones with no record.json (an older Rigpilot's)
    damaged: list[str] = field(default_factory=list)  # of those, the ones listed as failed: job.json unreadable

    def message(self) -> str:
        if self.code == TELEMETRY_RESET:
            line = f"the telemetry history {self.path} could not be used ({self.reason})"
            line += f"; it was moved to {self.moved_to.name}" if self.moved_to else ""
            line += "; the history starts again from now"
        elif self.code == JOBS_PUT_BACK:
            done = [f"{_count(self.jobs, 'job')} put back ({_ids(self.jobs)})"] if self.jobs else []
            done += [f"{_count(self.updated, 'job')} brought up to date ({_ids(self.updated)})"] if self.updated else []
            line = f"the job database {self.path} was behind the job folders: {' and '.join(done)} from their folders"
        elif self.cause == "missing":
            line = f"the job database {self.path} was missing"
            line += f"; its leftover -wal and -shm were moved aside as {self.moved_to.name}-*" if self.moved_to else ""
            line += f"; the list of {_count(self.jobs, 'job')} was rebuilt from the job folders"
        else:
            line = f"the job database {self.path} could not be used ({self.reason})"
            line += f"; it was moved to {self.moved_to.name}" if self.moved_to else ""
            line += f"; the list of {_count(self.jobs, 'job')} was rebuilt from the job folders"
        if self.code == JOB_DATABASE_REBUILT and self.pieced:
            line += f" ({len(self.pieced)} made by an older Rigpilot, judged from their logs)"
        if self.damaged:
            line += f"; {_count(self.damaged, 'job folder')} damaged, listed as failed ({_ids(self.damaged)})"
        if self.in_memory:
            kept = "history" if self.code == TELEMETRY_RESET else "list"
            line += f"; a new file could not be made ({self.in_memory}), so the {kept} is kept in memory until the engine restarts"
        return line

    def notice(self) -> dict[str, Any]:
        """The protocol's notice: a code, the message, and the fields a client may word it from."""
        return {
            "code": self.code, "message": self.message(), "path": str(self.path), "cause": self.cause, "reason": self.reason,
            "moved_to": str(self.moved_to) if self.moved_to else None, "in_memory": self.in_memory is not None,
            "jobs": len(self.jobs), "updated": self.updated, "damaged": self.damaged,
        }  # fmt: skip


class _Guard:
    """Runs a database's operations so that damage found on the way is recovered from, once, and the
    operation tried again. Shared by both stores; `recover` is theirs."""

    def __init__(self, path: Path, recover: Callable[[str, Collection[str]], None]):
        self.lock = threading.RLock()
        self.watch: dbfile.Watch | None = dbfile.Watch(path)
        self._recover = recover

    def run(self, op: Callable[[], T], skip: Collection[str] = ()) -> T:
        with self.lock:
            why = self.watch.check() if self.watch is not None else None
            if why is not None:
                self._recover(why, skip)
            try:
                return op()
            except sqlite3.DatabaseError as e:
                why = dbfile.damage_of(e)
                if why is None:
                    raise
            self._recover(why, skip)
            return op()


class ResilientJobStore(JobStore):
    """The job table, kept in step with each job folder's record.json and rebuilt from them when damaged."""

    def __init__(self, path: Path, jobs_root: Path, *, on_recovery: Callable[[Recovery], None] = lambda r: None):
        self.jobs_root = jobs_root
        self._on_recovery = on_recovery
        self._in_memory: str | None = None
        self._mirror_failed = False
        # Before anything opens it: checking the file may write back what its -wal holds, and so touch it.
        changed_at = max(_mtime(Path(f"{path}{s}")) for s in ("", "-wal"))
        aside, existed = dbfile.prepare(
            path, what="job database", schema_version=SCHEMA_VERSION, table="jobs", columns=_KEY_COLUMNS
        )
        try:
            super().__init__(path)
        except sqlite3.DatabaseError as e:  # damage quick_check does not look for (a schema it cannot alter)
            why = dbfile.unusable_at_open(e)
            if why is None:
                raise UserError(f"cannot open the job database {path}: {e}") from None
            with contextlib.suppress(AttributeError, sqlite3.Error):
                self._db.close()
            aside = dbfile.set_aside(path, dbfile.SetAside(why, "damaged", None), "job database")
            super().__init__(path)
        self._guard = _Guard(path, self._recover)
        if aside is not None:
            self._rebuild(Recovery(JOB_DATABASE_REBUILT, path, aside.cause, aside.reason, aside.moved_to))
        elif not existed and job_folders.job_folders(jobs_root):
            self._rebuild(Recovery(JOB_DATABASE_REBUILT, path, "missing"))
        else:
            self._reconcile(changed_at)

    def _connect(self) -> sqlite3.Connection:
        if self._in_memory is None:
            return super()._connect()
        db = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
        db.row_factory = sqlite3.Row
        return db

    # -- the table's operations, guarded ----------------------------------------------

    def next_seq(self) -> int:
        return self._guard.run(super().next_seq)

    def insert(self, rec: JobRecord) -> None:
        with self._guard.lock:  # row and record.json change together: two changes never cross on their way
            # A rebuild on the way must leave this job out: its folder is made, its row is not yet.
            self._guard.run(functools.partial(super().insert, rec), skip={rec.id})
            self._mirror(rec)

    def update(self, rec: JobRecord, **changes: Any) -> JobRecord:
        with self._guard.lock:
            self._guard.run(functools.partial(super().update, rec, **changes))
            # The row, not `rec`: another copy of the record may have changed other fields of it.
            self._mirror(self._guard.run(functools.partial(super().get, rec.id)) or rec)
        return rec

    def flush_unsaved(self) -> bool:
        with self._guard.lock:  # not while a recovery replaces the connection under it
            held = list(self._unsaved)
            done = self._guard.run(super().flush_unsaved)
            for job_id in held:
                rec = None if job_id in self._unsaved else self._guard.run(functools.partial(super().get, job_id))
                if rec is not None:
                    self._mirror(rec)  # the folder's copy missed these changes too, for the same want of room
        return done

    def get(self, job_id: str) -> JobRecord | None:
        return self._guard.run(functools.partial(super().get, job_id))

    def find(self, ref: str) -> list[JobRecord]:
        return self._guard.run(functools.partial(super().find, ref))

    def list(self, states: frozenset[str] | set[str] | None = None, limit: int | None = None) -> list[JobRecord]:
        return self._guard.run(functools.partial(super().list, states, limit))

    def delete(self, job_id: str) -> None:
        # Marked first: a folder the deletion cannot remove completely must not come back as a job.
        with contextlib.suppress(OSError):
            job_folders.write_deleted(self.jobs_root / job_id)
        self._guard.run(functools.partial(super().delete, job_id))

    # -- keeping the folders the truth ------------------------------------------------

    def _mirror(self, rec: JobRecord) -> None:
        try:
            job_folders.write_record(self.jobs_root / rec.id, rec)
        except OSError as e:
            if not self._mirror_failed:  # once: a full disk would otherwise say so at every change
                self._mirror_failed = True
                log.warning(
                    "cannot keep job %s's record in its folder (%s); if the job database were lost now, the "
                    "job list would be rebuilt from what the runs left instead", rec.id, e.strerror or e,
                )  # fmt: skip

    def _reconcile(self, changed_at: float) -> None:
        """At start, on a sound database, bring it level with the job folders.

        A row whose folder has no record yet (an older Rigpilot made it) is copied there. A record written
        after the database last changed wins over its row: the engine kept the list in memory while a
        damaged file it could not replace stayed behind, and closing that file may have made it sound but
        old. A job whose folder has a record but no row (an older copy of engine.db put back) is put back.
        """
        rows = {r.id: r for r in super().list()}
        newer: list[JobRecord] = []
        for rec in rows.values():
            job_dir = self.jobs_root / rec.id
            if not job_dir.is_dir():
                continue
            kept, written = job_folders.read_record(job_dir)
            if kept is None:
                self._mirror(rec)
            elif isinstance(kept, JobRecord) and written > changed_at and kept != rec:
                kept.id = rec.id
                newer.append(kept)
        for rec in newer:
            super().update(rec, **{name: getattr(rec, name) for name in _FIELDS if name != "id"})
        back, damaged = [], []
        for job_dir in job_folders.job_folders(self.jobs_root):
            if job_dir.name not in rows and job_folders.has_record(job_dir):
                found, how = job_folders.read_job(job_dir)
                if found is not None:
                    super().insert(found)
                    back.append(found.id)
                    damaged += [found.id] if how == "damaged" else []
        if back or newer:
            self._on_recovery(Recovery(
                JOBS_PUT_BACK, self.path, jobs=back, updated=[r.id for r in newer], damaged=damaged,
            ))  # fmt: skip

    def _recover(self, reason: str, skip: Collection[str]) -> None:
        """Damage found while the engine runs: a new table (a new file, else memory), rebuilt from the folders."""
        recovery = Recovery(JOB_DATABASE_REBUILT, self.path, "damaged", reason)
        _replace_file(self, recovery, "job database", self._reopen)
        self._rebuild(recovery, skip)

    def _reopen(self) -> None:
        self._db = self._connect()
        self._migrate()

    def _rebuild(self, recovery: Recovery, skip: Collection[str] = ()) -> None:
        found = job_folders.read_jobs(self.jobs_root, skip)
        try:
            for rec in found.records:
                super().insert(rec)
        except DiskFull:
            if self._in_memory is not None:
                raise
            # The new file has no room for the list: the list lives in memory until the next start, which
            # finds this file sound but short and puts the rest back from the folders.
            _to_memory(self, recovery, "the disk is full", self._reopen)
            self._rebuild(recovery, skip)
            return
        for rec in found.records:
            if rec.id in found.pieced or rec.id in found.damaged:
                self._mirror(rec)  # from now on this folder has its record too
        recovery.jobs = [r.id for r in found.records]
        recovery.pieced, recovery.damaged = found.pieced, found.damaged
        self._on_recovery(recovery)


class ResilientTelemetryStore(TelemetryStore):
    """Telemetry history that is started afresh (the damaged file moved aside) when its file cannot serve."""

    def __init__(self, path: Path, *, on_recovery: Callable[[Recovery], None] = lambda r: None, **options: Any):
        self._on_recovery = on_recovery
        self._in_memory: str | None = None
        aside, _ = dbfile.prepare(
            path, what="telemetry history", schema_version=0, table="telemetry", columns=frozenset({"time", "data"})
        )
        try:
            super().__init__(path, **options)
        except sqlite3.DatabaseError as e:  # damage quick_check does not look for
            why = dbfile.unusable_at_open(e)
            if why is None:
                raise UserError(f"cannot open the telemetry history {path}: {e}") from None
            with contextlib.suppress(AttributeError, sqlite3.Error):
                self._db.close()
            aside = dbfile.set_aside(path, dbfile.SetAside(why, "damaged", None), "telemetry history")
            super().__init__(path, **options)
        self._guard = _Guard(path, self._recover)
        if aside is not None and aside.cause != "missing":  # -wal and -shm alone held nothing to miss
            on_recovery(Recovery(TELEMETRY_RESET, path, aside.cause, aside.reason, aside.moved_to))

    def _connect(self) -> sqlite3.Connection:
        if self._in_memory is None:
            return super()._connect()
        return sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)

    def add(self, sample: Any) -> bool:
        return self._guard.run(functools.partial(super().add, sample))

    def prune(self) -> None:
        self._guard.run(super().prune)

    def since(
        self, since: float | None, *, limit: int = 10_000, max_bytes: int | None = None
    ) -> tuple[list[dict[str, Any]], bool]:
        return self._guard.run(functools.partial(super().since, since, limit=limit, max_bytes=max_bytes))

    def count(self) -> int:
        return self._guard.run(super().count)

    def _recover(self, reason: str, skip: Collection[str]) -> None:
        recovery = Recovery(TELEMETRY_RESET, self.path, "damaged", reason)
        _replace_file(self, recovery, "telemetry history", self._open)
        self._on_recovery(recovery)


def _replace_file(store: Any, recovery: Recovery, what: str, reopen: Callable[[], None]) -> None:
    """Move a store's damaged file aside and open a new one in its place; where none can be made (its folder
    went read-only), the store lives in memory until the next start. Both stores do this the same way."""
    with contextlib.suppress(sqlite3.Error):
        store._db.close()
    try:
        recovery.moved_to = dbfile.move_aside(store.path, "damaged")
        dbfile.check_folder(store.path, what)
        reopen()
        store._guard.watch = dbfile.Watch(store.path)
    except (OSError, sqlite3.Error, UserError) as e:
        _to_memory(store, recovery, _why_not(e), reopen)
        return
    recovery.in_memory = store._in_memory


def _to_memory(store: Any, recovery: Recovery, why: str, reopen: Callable[[], None]) -> None:
    """From now on the store's table is in memory (its `_connect` opens one there), for `why`."""
    with contextlib.suppress(sqlite3.Error):
        store._db.close()
    store._in_memory = why
    reopen()
    store._guard.watch = None
    recovery.in_memory = why


def _why_not(e: Exception) -> str:
    """Why a new database file could not be made, in a few words for the notice."""
    if isinstance(e, UserError):
        return "its folder cannot be written"
    return (e.strerror if isinstance(e, OSError) else None) or str(e)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _count(items: Collection[Any], noun: str) -> str:
    return f"{len(items)} {noun}{'s' * (len(items) != 1)}"


def _ids(ids: list[str]) -> str:
    return ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
