"""The job table: one SQLite row per job, in `<state dir>/engine.db` (WAL).

The row is the service's memory across restarts: the queue order, which
process runs a job (pid plus start time, so a recycled pid is never mistaken
for it), and how each job ended. Everything bulky (logs, metrics, checkpoints)
stays in the job folder; the row keeps only the last log lines of a failure.
The engine uses it through engine.jobs.resilient_store, which keeps a copy
of each row in its job folder and rebuilds the table from them when the file
is damaged.

A full disk does not lose a change: an update SQLite refuses for want of room
("database or disk is full") is kept in memory, shown in every record read back,
and written by `flush_unsaved()` once there is room again. A new row is refused
(`DiskFull`): a submission fails in one line rather than exist in memory only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rigpilot.engine import schema
from rigpilot.engine.diskspace import disk_full, is_disk_full
from rigpilot.engine.schema import JobState

# The states are engine.schema.JobState; plain strings here, as SQLite and job.json hold them.
QUEUED, STARTING, RUNNING, COMPLETED, FAILED, CANCELLED, INTERRUPTED = (s.value for s in JobState)
ACTIVE_STATES = frozenset(s.value for s in schema.ACTIVE_STATES)
TERMINAL_STATES = frozenset(s.value for s in schema.TERMINAL_STATES)
ALL_STATES = frozenset({QUEUED}) | ACTIVE_STATES | TERMINAL_STATES
RESUMABLE_STATES = frozenset(s.value for s in schema.UNSUCCESSFUL_STATES)

SCHEMA_VERSION = 1


@dataclass
class JobRecord:
    id: str
    seq: int  # submission order; the queue is served in this order
    kind: str
    name: str
    state: str
    gpus: list[int]
    ranks: int  # processes torchrun starts (one per GPU; capped for CPU ranks on simulated machines)
    simulated: bool
    created: float
    cwd: str | None = None
    started: float | None = None
    ended: float | None = None
    run: int = 1  # 1 for the first run, +1 for each resume
    exit_reason: str | None = None
    exit_code: int | None = None
    failed_rank: int | None = None
    last_log: list[str] = field(default_factory=list)
    launcher_pid: int | None = None
    launcher_start: float | None = None  # psutil create_time of launcher_pid
    port: int | None = None
    cancel_requested: bool = False
    resumable: bool = False
    predicted: dict[str, Any] | None = None  # from the plan: peak memory, tokens/s, step time
    measured: dict[str, Any] | None = None  # the metrics summary, frozen when the job ends
    error: dict[str, Any] | None = None  # an "error" metrics record (e.g. out_of_memory) with the plan's advice
    # A job submitted to SLURM: its SLURM job id, queue state and reason, partition, login host, script (engine.jobs.slurm)
    slurm: dict[str, Any] | None = None
    # Automatic recovery (engine.jobs.recovery): each restart as {time, run, cause, from_step,
    # left_out_gpus, notes}, oldest first; and how many restarts in a row the job may make.
    restarts: list[dict[str, Any]] = field(default_factory=list)
    max_restarts: int = 0
    # A job spanning several engines (engine.service.multinode): its role here ("head" or "member"), the
    # rendezvous endpoint, the node names and which ranks each runs. None for a job on this machine alone.
    nodes: dict[str, Any] | None = None
    # GPU energy (engine.jobs.energy): per run and in all, per GPU, with the seconds no power reading covered.
    energy: dict[str, Any] | None = None
    study: str | None = None  # the scaling study this job is a point of (engine.jobs.scaling)
    # What the machine check set in the job's environment and why (engine.jobs.machine_check), or None.
    machine_check: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = [f.name for f in dataclasses.fields(JobRecord)]
# A NULL in a column added after the row was written means "the field's default".
_DEFAULTS = {
    f.name: (f.default_factory if f.default_factory is not dataclasses.MISSING else (lambda d=f.default: d))
    for f in dataclasses.fields(JobRecord)
    if f.default_factory is not dataclasses.MISSING or (f.default is not dataclasses.MISSING and f.default is not None)
}
_JSON_FIELDS = {"gpus", "last_log", "predicted", "measured", "error", "slurm", "restarts", "nodes", "energy", "machine_check"}
_BOOL_FIELDS = {"simulated", "cancel_requested", "resumable"}


def _to_sql(name: str, value: Any) -> Any:
    if name in _JSON_FIELDS:
        return None if value is None else json.dumps(value)
    if name in _BOOL_FIELDS:
        return int(bool(value))
    return value


def _from_row(row: sqlite3.Row) -> JobRecord:
    values = {}
    for name in _FIELDS:
        v = row[name]
        if v is None and name in _DEFAULTS:
            values[name] = _DEFAULTS[name]()
            continue
        if name in _JSON_FIELDS and v is not None:
            v = json.loads(v)
        elif name in _BOOL_FIELDS:
            v = bool(v)
        values[name] = v
    return JobRecord(**values)


class JobStore:
    """Thread-safe access to the job table (one connection, one lock: the load is tiny)."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = self._connect()
        self._unsaved: dict[str, dict[str, Any]] = {}  # job id -> changes the disk refused, newest values
        self._migrate()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode may lose the last commits on power loss but never corrupts the file.
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    def _migrate(self) -> None:
        with self._lock:
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version == 0:
                self._db.execute(
                    """CREATE TABLE IF NOT EXISTS jobs (
                        id TEXT PRIMARY KEY, seq INTEGER NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL,
                        state TEXT NOT NULL, gpus TEXT NOT NULL, ranks INTEGER NOT NULL, simulated INTEGER NOT NULL,
                        created REAL NOT NULL, cwd TEXT, started REAL, ended REAL, run INTEGER NOT NULL,
                        exit_reason TEXT, exit_code INTEGER, failed_rank INTEGER, last_log TEXT,
                        launcher_pid INTEGER, launcher_start REAL, port INTEGER,
                        cancel_requested INTEGER NOT NULL, resumable INTEGER NOT NULL,
                        predicted TEXT, measured TEXT, error TEXT)"""
                )
                self._db.execute("CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state, seq)")
                self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            elif version > SCHEMA_VERSION:
                raise RuntimeError(f"{self.path} was written by a newer Rigpilot (schema {version})")
            # Fields added to JobRecord since the table was made get a column of their own; rows written
            # before read as the field's default. Older engines ignore columns they do not know, so this
            # needs no schema version of its own.
            have = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
            for name in _FIELDS:
                if name not in have:
                    self._db.execute(f"ALTER TABLE jobs ADD COLUMN {name}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def next_seq(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()[0]

    def insert(self, rec: JobRecord) -> None:
        cols = ", ".join(_FIELDS)
        marks = ", ".join("?" for _ in _FIELDS)
        with self._lock, self._refused_for_room():
            self._db.execute(f"INSERT INTO jobs ({cols}) VALUES ({marks})", [_to_sql(n, getattr(rec, n)) for n in _FIELDS])

    def update(self, rec: JobRecord, **changes: Any) -> JobRecord:
        """Apply `changes` to the record and to its row, in one statement (kept in memory while the disk is full)."""
        for name, value in changes.items():
            if name not in _FIELDS or name == "id":
                raise KeyError(name)
            setattr(rec, name, value)
        with self._lock:
            # Taken out only once written: a write that fails otherwise (a damaged file, which the caller
            # may recover from and try again) must not lose what a full disk held back before.
            pending = {**self._unsaved.get(rec.id, {}), **changes}
            try:
                self._write(rec.id, pending)
            except sqlite3.OperationalError as e:
                if not is_disk_full(e):
                    raise
                self._unsaved[rec.id] = pending
                return rec
            self._unsaved.pop(rec.id, None)
        return rec

    def _write(self, job_id: str, changes: dict[str, Any]) -> None:
        sets = ", ".join(f"{n} = ?" for n in changes)
        self._db.execute(f"UPDATE jobs SET {sets} WHERE id = ?", [*(_to_sql(n, v) for n, v in changes.items()), job_id])

    @property
    def unsaved(self) -> int:
        """Jobs whose latest changes are in memory only, for want of room."""
        return len(self._unsaved)

    def flush_unsaved(self) -> bool:
        """Write the changes a full disk refused; True when none are left."""
        with self._lock:
            for job_id, changes in list(self._unsaved.items()):
                try:
                    self._write(job_id, changes)
                except sqlite3.OperationalError as e:
                    if not is_disk_full(e):
                        raise
                    return False
                del self._unsaved[job_id]
        return True

    @contextlib.contextmanager
    def _refused_for_room(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.OperationalError as e:
            if is_disk_full(e):
                raise disk_full(self.path.parent) from None
            raise

    def _record(self, row: sqlite3.Row) -> JobRecord:
        rec = _from_row(row)
        for name, value in self._unsaved.get(rec.id, {}).items():
            setattr(rec, name, value)
        return rec

    def get(self, job_id: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            return self._record(row) if row else None

    def find(self, ref: str) -> list[JobRecord]:
        """Jobs a user could mean by `ref`: the exact id, else a unique id prefix, else the name."""
        exact = self.get(ref)
        if exact:
            return [exact]
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM jobs WHERE substr(id, 1, ?) = ? ORDER BY seq", (len(ref), ref)
            ).fetchall()
            if not rows:
                rows = self._db.execute("SELECT * FROM jobs WHERE name = ? ORDER BY seq", (ref,)).fetchall()
            return [self._record(r) for r in rows]

    def list(self, states: frozenset[str] | set[str] | None = None, limit: int | None = None) -> list[JobRecord]:
        sql = "SELECT * FROM jobs"
        params: list[str | int] = []
        with self._lock:
            # A change kept in memory may have moved a job to another state: then the state is checked here.
            in_sql = states is not None and not self._unsaved
            if in_sql and states is not None:
                sql += f" WHERE state IN ({', '.join('?' for _ in states)})"
                params += sorted(states)
            # Newest first for listings; the scheduler sorts queued jobs by seq itself.
            sql += " ORDER BY seq DESC"
            if limit is not None and (in_sql or states is None):
                sql += " LIMIT ?"
                params.append(limit)
            recs = [self._record(r) for r in self._db.execute(sql, params).fetchall()]
        if states is not None and not in_sql:
            recs = [r for r in recs if r.state in states][:limit]
        return recs

    def delete(self, job_id: str) -> None:
        with self._lock, self._refused_for_room():
            self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            self._unsaved.pop(job_id, None)
