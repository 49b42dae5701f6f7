"""A damaged engine.db or telemetry.db: the job folders are the truth, and no job is lost.

Every shape of damage is made for real (a truncated, emptied or overwritten file, a folder or a FIFO
in its place, a newer schema, another program's database, a -wal and -shm left without their database
or another database's beside a sound one, a folder the engine cannot write) on real SQLite files. The first part opens the stores on them directly; the second
starts a real engine service on a copy of a state folder whose jobs a real engine ran (torchrun,
CPU ranks), and asks through the real client and CLI: every job is listed with its state, the
damaged file is moved aside with a timestamp, and the log and each client get one line about it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rigpilot.engine import paths
from rigpilot.engine.api.client import EngineClient
from rigpilot.engine.cli.entry import main as cli_main
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.telemetry import GpuSample, TelemetrySample
from rigpilot.engine.jobs import dbfile, job_folders
from rigpilot.engine.jobs.resilient_store import (
    JOB_DATABASE_REBUILT,
    JOBS_PUT_BACK,
    TELEMETRY_RESET,
    Recovery,
    ResilientJobStore,
    ResilientTelemetryStore,
)
from rigpilot.engine.jobs.store import (
    CANCELLED,
    COMPLETED,
    FAILED,
    INTERRUPTED,
    QUEUED,
    RUNNING,
    SCHEMA_VERSION,
    JobRecord,
)
from rigpilot.engine.jobspec.spec import JobSpec

from support.engine import CRASH_SCRIPT, GATE_SCRIPT, QUICK_SCRIPT, Engine, engine_home, leftover_job_processes
from support.paths import REPO
from support.waiting import wait_for

ASIDE = re.compile(r"^engine\.(damaged|newer|missing)-\d{8}-\d{6}(-\d+)?\.db$")


# -- damage, made for real -----------------------------------------------------------------


def truncated(db: Path) -> None:
    with db.open("r+b") as f:
        f.truncate(db.stat().st_size // 2)


def zero_bytes(db: Path) -> None:
    db.write_bytes(b"")


def random_bytes(db: Path) -> None:
    db.write_bytes(os.urandom(max(db.stat().st_size, 8192)))


def pages_overwritten(db: Path) -> None:
    """The header stays a SQLite header; the pages after it are noise (a disk that lost writes)."""
    with db.open("r+b") as f:
        f.seek(100)
        f.write(os.urandom(db.stat().st_size - 100))


def a_folder(db: Path) -> None:
    db.unlink()
    db.mkdir()
    (db / "stray").write_text("x")


def a_fifo(db: Path) -> None:
    db.unlink()
    os.mkfifo(db)


def newer_schema(db: Path) -> None:
    con = sqlite3.connect(db)
    con.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    con.commit()
    con.close()


def another_programs_database(db: Path) -> None:
    db.unlink()
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE bookmarks (url TEXT)")
    con.commit()
    con.close()


def wal_and_shm_left_behind(db: Path) -> None:
    """The -wal and -shm of a live connection, left in place after the database itself went."""
    con = sqlite3.connect(db, isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA wal_autocheckpoint=0")
    con.execute("CREATE TABLE IF NOT EXISTS scratch (x)")
    con.execute("INSERT INTO scratch VALUES (1)")
    kept = {s: Path(f"{db}{s}").read_bytes() for s in ("-wal", "-shm")}
    con.close()
    db.unlink()
    for s, data in kept.items():
        Path(f"{db}{s}").write_bytes(data)


def another_databases_wal(db: Path) -> None:
    """A sound file with another database's -wal and -shm beside it, which SQLite applies when it opens it."""
    other = db.with_name("other.db")
    con = sqlite3.connect(other, isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA wal_autocheckpoint=0")
    con.execute("CREATE TABLE jobs (a)")
    con.executemany("INSERT INTO jobs VALUES (?)", [("z" * 500,)] * 50)
    kept = {s: Path(f"{other}{s}").read_bytes() for s in ("-wal", "-shm")}
    con.close()
    other.unlink()
    for s, data in kept.items():
        Path(f"{db}{s}").write_bytes(data)


SHAPES: dict[str, Callable[[Path], None]] = {
    "truncated": truncated,
    "zero bytes": zero_bytes,
    "random bytes": random_bytes,
    "pages overwritten": pages_overwritten,
    "a folder": a_folder,
    "a FIFO": a_fifo,
    "a newer schema": newer_schema,
    "another program's database": another_programs_database,
    "-wal and -shm without it": wal_and_shm_left_behind,
    "another database's -wal beside it": another_databases_wal,
}


def set_aside(folder: Path, stem: str = "engine") -> list[Path]:
    """What was moved aside from `<stem>.db` (with any -wal and -shm)."""
    return sorted(p for p in folder.iterdir() if re.match(rf"{stem}\.(damaged|newer|missing)-", p.name))


class Unwritable:
    """A folder the engine cannot write in: read-only for its owner, or, for root (whom modes do not stop),
    immutable."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.strerror = "Operation not permitted" if os.geteuid() == 0 else "Permission denied"

    def __enter__(self) -> Unwritable:
        if os.geteuid() == 0:
            if subprocess.run(["chattr", "+i", str(self.folder)], capture_output=True).returncode != 0:
                pytest.skip("root, and this file system cannot make a folder immutable (chattr +i)")
        else:
            self.folder.chmod(0o500)
        return self

    def __exit__(self, *exc: object) -> None:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(self.folder)], check=True)
        else:
            self.folder.chmod(0o700)


# -- the stores on their own -----------------------------------------------------------------

STATES = [QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED, INTERRUPTED]


def make_jobs(store: ResilientJobStore) -> dict[str, str]:
    """A job in every state, made as the supervisor makes one (folder and job.json, then the row); id → state."""
    made = {}
    for i, state in enumerate(STATES):
        job_id = f"a{i}b{i}c{i}"
        spec = JobSpec(id=job_id, kind="script", name=f"job {state}", gpus=[i % 4], script=["/bin/true"])
        spec.write(store.jobs_root / job_id)
        rec = JobRecord(id=job_id, seq=store.next_seq(), kind="script", name=spec.name, state=QUEUED,
                        gpus=spec.gpus, ranks=1, simulated=True, created=1000.0 + i)  # fmt: skip
        store.insert(rec)
        if state != QUEUED:
            store.update(rec, state=state, exit_reason=f"ended {state}" if state != RUNNING else None, run=2)
        made[job_id] = state
    return made


def listed(store: ResilientJobStore) -> dict[str, str]:
    return {r.id: r.state for r in store.list()}


@pytest.fixture
def stores(tmp_path, monkeypatch):
    """A state folder with engine.db and jobs/, as the engine lays them out, and every recovery heard."""
    monkeypatch.setattr(dbfile, "WATCH_PERIOD_S", 0.0)  # look at the file at every call, not once a second
    state = tmp_path / "state"
    (state / "jobs").mkdir(parents=True)
    heard: list[Recovery] = []

    def open_store() -> ResilientJobStore:
        return ResilientJobStore(state / "engine.db", state / "jobs", on_recovery=heard.append)

    return state, open_store, heard


def test_every_change_to_a_job_is_kept_in_its_folder_and_a_deleted_job_stays_deleted(stores):
    state, open_store, heard = stores
    store = open_store()
    made = make_jobs(store)
    rec = store.get("a3b3c3")
    store.update(rec, name="renamed", failed_rank=1)
    record = json.loads((state / "jobs" / "a3b3c3" / job_folders.RECORD_FILE).read_text())["record"]
    assert JobRecord(**record) == store.get("a3b3c3")
    assert (state / "jobs" / "a3b3c3" / job_folders.RECORD_FILE).stat().st_mode & 0o077 == 0
    store.delete("a0b0c0")  # the supervisor then removes the folder; here it stays, as when that fails
    store.close()
    (state / "engine.db").unlink()
    again = open_store()
    del made["a0b0c0"]
    assert listed(again) == made and again.get("a3b3c3").name == "renamed"
    (recovery,) = heard
    assert recovery.code == JOB_DATABASE_REBUILT and recovery.cause == "missing" and len(recovery.jobs) == 5
    assert recovery.message().startswith(f"the job database {state / 'engine.db'} was missing")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_damaged_database_at_start_is_moved_aside_and_every_job_rebuilt(stores, shape):
    state, open_store, heard = stores
    store = open_store()
    made = make_jobs(store)
    store.close()
    SHAPES[shape](state / "engine.db")
    again = open_store()
    assert listed(again) == made
    assert again.get("a3b3c3").exit_reason == "ended failed" and again.get("a1b1c1").run == 2
    (recovery,) = heard  # one recovery, one message
    assert recovery.code == JOB_DATABASE_REBUILT and sorted(recovery.jobs) == sorted(made)
    (aside,) = {p.name.removesuffix("-wal").removesuffix("-shm") for p in set_aside(state)}
    assert ASIDE.match(aside), aside
    assert recovery.moved_to == state / aside
    assert "\n" not in recovery.message() and str(state / "engine.db") in recovery.message()
    # The new file is sound: the next start finds nothing to say.
    again.close()
    assert listed(open_store()) == made and len(heard) == 1


def test_a_job_folder_whose_job_json_is_unreadable_is_listed_as_damaged_in_one_line(stores):
    state, open_store, heard = stores
    store = open_store()
    made = make_jobs(store)
    store.close()
    (state / "jobs" / "a2b2c2" / "job.json").write_text("{not json")  # it has its record.json still
    (state / "jobs" / "a4b4c4" / job_folders.RECORD_FILE).unlink()  # and this one has nothing readable
    (state / "jobs" / "a4b4c4" / "job.json").write_bytes(os.urandom(64))
    (state / "jobs" / "zzzzzz").mkdir()  # an empty folder is not a job
    random_bytes(state / "engine.db")
    again = open_store()
    assert set(listed(again)) == set(made)
    for job_id in ("a2b2c2", "a4b4c4"):
        rec = again.get(job_id)
        assert rec.state == FAILED and not rec.resumable and rec.error["error"] == job_folders.DAMAGED_FOLDER
        assert rec.exit_reason.startswith("its folder is damaged: job.json is unreadable (")
        assert "\n" not in rec.exit_reason
    assert again.get("a2b2c2").name == "job completed"  # what its record knew stays
    (recovery,) = heard
    assert sorted(recovery.damaged) == ["a2b2c2", "a4b4c4"]
    assert "2 job folders damaged, listed as failed (a2b2c2, a4b4c4)" in recovery.message()


def test_jobs_missing_from_a_sound_database_are_put_back_from_their_folders(stores):
    state, open_store, heard = stores
    store = open_store()
    made = make_jobs(store)
    store.close()
    con = sqlite3.connect(state / "engine.db")  # an older copy of engine.db, put back by hand
    con.execute("DELETE FROM jobs WHERE id IN ('a4b4c4', 'a5b5c5')")
    con.commit()
    con.close()
    assert listed(open_store()) == made
    (recovery,) = heard
    assert recovery.code == JOBS_PUT_BACK and sorted(recovery.jobs) == ["a4b4c4", "a5b5c5"]
    assert recovery.message() == (
        f"the job database {state / 'engine.db'} was behind the job folders: 2 jobs put back (a4b4c4, a5b5c5) "
        "from their folders"
    )
    assert not set_aside(state)


@pytest.mark.parametrize("how", ["overwritten in place", "replaced", "removed", "a page answers SQLITE_CORRUPT"])
def test_damage_while_the_engine_runs_is_recovered_at_the_next_call(stores, how):
    state, open_store, heard = stores
    store = open_store()
    made = make_jobs(store)
    db = state / "engine.db"
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # every page in the file, none only in the WAL
    if how == "overwritten in place":
        with db.open("r+b") as f:
            f.write(os.urandom(db.stat().st_size))
    elif how == "replaced":
        (state / "other").write_bytes(os.urandom(8192))
        os.replace(state / "other", db)
    elif how == "removed":
        db.unlink()
    else:
        pages_overwritten(db)
        store._db.execute("PRAGMA shrink_memory")  # the page cache lets go, as it would under memory pressure
    assert listed(store) == made
    (recovery,) = heard
    assert recovery.code == JOB_DATABASE_REBUILT and recovery.in_memory is None and len(recovery.jobs) == 6
    store.update(store.get("a1b1c1"), state=COMPLETED)  # the engine goes on, on the new file
    made["a1b1c1"] = COMPLETED
    store.close()
    assert listed(open_store()) == made and len(heard) == 1


def test_damage_while_the_folder_is_unwritable_keeps_the_list_in_memory_and_loses_nothing(stores):
    state, open_store, heard = stores
    store = open_store()
    made = make_jobs(store)
    db = state / "engine.db"
    with Unwritable(state):
        with db.open("r+b") as f:
            f.write(os.urandom(db.stat().st_size))
        assert listed(store) == made
        (recovery,) = heard
        assert recovery.in_memory and recovery.moved_to is None
        assert "kept in memory until the engine restarts" in recovery.message()
        store.update(store.get("a1b1c1"), state=COMPLETED, exit_reason=None)  # recorded in its folder still
        made["a1b1c1"] = COMPLETED
        assert listed(store) == made
        store.close()
        with pytest.raises(UserError, match=r"^the engine cannot write in .*chmod 700"):
            open_store()  # a start refuses in one line; the jobs are untouched
    # Closing the damaged file may have written the pages it still held back into it, old but sound; either
    # way the next start lists what the folders say, the change made meanwhile included, and says so.
    assert listed(open_store()) == made
    assert len(heard) == 2 and heard[1].code in (JOB_DATABASE_REBUILT, JOBS_PUT_BACK)


def test_the_telemetry_history_starts_again_when_its_file_is_damaged(tmp_path, monkeypatch):
    monkeypatch.setattr(dbfile, "WATCH_PERIOD_S", 0.0)
    path = tmp_path / "telemetry.db"
    heard: list[Recovery] = []

    now = time.time()

    def sample(t: float) -> TelemetrySample:
        return TelemetrySample(time=now + t, gpus=[GpuSample(index=0, gpu_util=50.0)])

    ts = ResilientTelemetryStore(path, on_recovery=heard.append, prune_every=1e9)
    assert ts.add(sample(100.0)) and ts.count() == 1
    ts.close()
    random_bytes(path)
    ts = ResilientTelemetryStore(path, on_recovery=heard.append, prune_every=1e9)
    assert ts.count() == 0 and ts.add(sample(200.0))
    with path.open("r+b") as f:
        f.write(os.urandom(path.stat().st_size))
    assert ts.since(None)[0] == []  # damaged under it: a fresh history, no error
    assert ts.add(sample(300.0)) and [s["time"] for s in ts.since(None)[0]] == [now + 300.0]
    assert [r.code for r in heard] == [TELEMETRY_RESET, TELEMETRY_RESET]
    assert heard[0].message().endswith("the history starts again from now")
    assert len(set_aside(tmp_path, "telemetry")) >= 2


# -- a real engine ---------------------------------------------------------------------------------


class DamageEngine(Engine):
    """test_service_engine's engine, on a copy of a state folder whose jobs a real engine ran."""

    @property
    def state(self) -> Path:
        return self.tmp / "state" / "rigpilot"

    @property
    def db(self) -> Path:
        return self.state / "engine.db"

    def jobs(self) -> dict[str, str]:
        with EngineClient(autostart=False, client_name="test", timeout=30) as c:  # not "cli": the CLI's notice stays
            return {j["name"]: j["state"] for j in c.request("jobs")["jobs"]}

    def log_text(self) -> str:
        return (self.tmp / "engine.log").read_text()


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """A state folder after a real engine ran jobs to each end: completed, failed (rank 1 raised), cancelled
    before it started, and one renamed. Copied by each test; never changed."""
    base = tmp_path_factory.mktemp("ran")
    with pytest.MonkeyPatch.context() as mp:
        engine_home(base, mp)
        e = Engine(base)
        e.start()
        try:
            gate = base / "gate"
            with e.client() as c:
                held = e.submit(c, e.script("gate.py", GATE_SCRIPT), str(gate), gpus=[0], name="held")
                behind = e.submit(c, e.script("quick.py", QUICK_SCRIPT), gpus=[0], name="cancelled")
                c.request("cancel", job=behind["id"])
                crash = e.submit(c, e.script("crash.py", CRASH_SCRIPT), gpus=[1, 2], name="crash")
                e.wait_state(c, held["id"], "running", timeout=120)
                gate.touch()
                e.wait_state(c, held["id"], "completed", "failed", timeout=120)
                e.wait_state(c, crash["id"], "failed", "completed", timeout=120)
                c.request("rename", job=held["id"], name="renamed")
        finally:
            e.stop()
    return base


EXPECTED = {"renamed": COMPLETED, "cancelled": CANCELLED, "crash": FAILED}


@pytest.fixture
def engine(ran, tmp_path, monkeypatch):
    engine_home(tmp_path, monkeypatch)
    for part in ("state", "config"):
        if (ran / part).exists():
            shutil.copytree(ran / part, tmp_path / part, symlinks=True)
    e = DamageEngine(tmp_path)
    yield e
    e.stop()
    for p in leftover_job_processes(tmp_path):
        p.kill()


def told_once(engine: DamageEngine, capsys, words: str, names: tuple[str, ...] = tuple(EXPECTED)) -> str:
    """`rigpilot jobs` twice: the notice comes on the first only, as one line; and once in the log."""
    assert cli_main(["jobs"]) == 0
    first = capsys.readouterr()
    assert cli_main(["jobs"]) == 0
    second = capsys.readouterr()
    (line,) = first.err.splitlines()
    assert line.startswith(f"rigpilot: {words}"), line
    assert second.err == ""
    for name in names:
        assert name in first.out and name in second.out
    log = engine.log_text()
    assert log.count(line.removeprefix("rigpilot: ")) == 1
    assert "Traceback" not in log and "hit a bug" not in log
    return line


def test_the_engine_starts_on_a_sound_copy_and_says_nothing(engine, capsys):
    engine.start()
    assert engine.jobs() == EXPECTED
    assert cli_main(["jobs"]) == 0 and capsys.readouterr().err == ""
    assert not set_aside(engine.state)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_engine_on_a_damaged_database_lists_every_job_and_says_so_once(engine, capsys, shape):
    SHAPES[shape](engine.db)
    engine.start()
    assert engine.jobs() == EXPECTED
    words = "the job database" if shape != "-wal and -shm without it" else f"the job database {engine.db} was missing"
    line = told_once(engine, capsys, words)
    (aside,) = {p.name.removesuffix("-wal").removesuffix("-shm") for p in set_aside(engine.state)}
    assert ASIDE.match(aside) and aside in line


def test_an_older_schema_is_brought_up_to_date_without_a_word(engine, capsys):
    # engine.db as the first Rigpilot made it: the first 25 columns only.
    con = sqlite3.connect(engine.db)
    first = [row[1] for row in con.execute("PRAGMA table_info(jobs)")][:25]
    con.execute(f"CREATE TABLE old AS SELECT {', '.join(first)} FROM jobs")
    con.execute("DROP TABLE jobs")
    con.execute("ALTER TABLE old RENAME TO jobs")
    con.commit()
    con.close()
    engine.start()
    assert engine.jobs() == EXPECTED
    assert cli_main(["jobs"]) == 0 and capsys.readouterr().err == ""
    assert not set_aside(engine.state)


def test_a_job_folder_whose_job_json_is_unreadable_is_listed_as_damaged(engine, capsys):
    crash = next(d for d in (engine.state / "jobs").iterdir() if "crash" in (d / "job.json").read_text())
    (crash / "job.json").write_text("[")
    random_bytes(engine.db)
    engine.start()
    with EngineClient(autostart=False, client_name="test") as c:
        job = c.request("job", job=crash.name)["job"]
    assert job["state"] == FAILED and not job["resumable"]
    assert job["error"]["error"] == job_folders.DAMAGED_FOLDER
    told_once(engine, capsys, "the job database")


def test_a_database_folder_the_engine_cannot_write_is_refused_in_one_line(engine, capsys):
    refusal = (
        f"rigpilot engine: error: the engine cannot write in {engine.state}, where it keeps its job database "
        f"(engine.db); make the folder writable again (chmod 700 {engine.state}) and start the engine again; "
        "jobs that run keep running"
    )
    log = paths.service_log_path()
    with Unwritable(engine.state) as unwritable:
        r = subprocess.run([sys.executable, "-m", "rigpilot.engine.service"], cwd=REPO, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
        assert r.returncode == 2 and r.stderr.splitlines() == [refusal]
        # The CLI starts the engine itself; with no engine.log to write its output to, it says so.
        assert cli_main(["jobs"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"rigpilot: error: the engine service cannot start: its log {log} cannot be written "
            f"({unwritable.strerror}); make {engine.state} writable again (chmod 700 {engine.state})"
        ]
    log.touch()
    with Unwritable(engine.state):
        assert cli_main(["jobs"]) == 2  # with it, the engine's own line
        (line,) = capsys.readouterr().err.splitlines()
        assert line == f"rigpilot: error: the engine service did not start (see {log}): {refusal}"
    engine.start()  # once it is writable again, nothing was lost
    assert engine.jobs() == EXPECTED
    assert not set_aside(engine.state)


def test_a_damaged_telemetry_history_is_dropped_and_said_once(engine, capsys):
    random_bytes(engine.state / "telemetry.db")
    engine.start()
    assert engine.jobs() == EXPECTED
    told_once(engine, capsys, f"the telemetry history {engine.state / 'telemetry.db'} could not be used")
    with EngineClient(autostart=False, client_name="test") as c:
        wait_for(lambda: c.request("telemetry_history")["samples"], 30, what="telemetry to be stored again")


@pytest.mark.slow
def test_damage_under_a_running_engine_loses_no_job_and_the_running_one_is_still_followed(engine, capsys):
    engine.start()
    gate = engine.tmp / "gate-live"
    with engine.client() as c:
        live = engine.submit(c, engine.script("gate.py", GATE_SCRIPT), str(gate), gpus=[3], name="live")
        engine.wait_state(c, live["id"], "running", timeout=120)
    with engine.db.open("r+b") as f:  # overwritten in place, under the engine's open connection
        f.write(os.urandom(engine.db.stat().st_size))
    # The engine looks at its file at most once a second, at a request: meanwhile its cache still answers.
    wait_for(lambda: engine.jobs() and set_aside(engine.state), 30, 0.2, "the engine to notice the damage")
    told_once(engine, capsys, "the job database")
    assert engine.jobs() == {**EXPECTED, "live": RUNNING}
    gate.touch()
    with engine.client() as c:
        assert engine.wait_state(c, live["id"], "completed", "failed", timeout=120)["state"] == COMPLETED
    (aside,) = set_aside(engine.state)
    assert ASIDE.match(aside.name)
    engine.stop()
    engine.start()
    assert engine.jobs() == {**EXPECTED, "live": COMPLETED}


@pytest.mark.slow
def test_folders_an_older_rigpilot_made_are_judged_from_their_runs_and_a_running_job_is_adopted(engine, capsys):
    """No record.json anywhere (an older Rigpilot's folders), the engine killed while a job runs, engine.db lost."""
    engine.start()
    gate = engine.tmp / "gate-old"
    with engine.client() as c:
        live = engine.submit(c, engine.script("gate.py", GATE_SCRIPT), str(gate), gpus=[3], name="live")
        engine.wait_state(c, live["id"], "running", timeout=120)
    engine.kill()
    for d in (engine.state / "jobs").iterdir():
        (d / job_folders.RECORD_FILE).unlink()
    engine.db.unlink()
    engine.start()
    # A rename lived in the row alone, so the first job has its first name again; the one cancelled before it
    # started has no trace of the cancel and waits to be resumed.
    assert engine.jobs() == {"held": COMPLETED, "cancelled": INTERRUPTED, "crash": FAILED, "live": RUNNING}
    line = told_once(engine, capsys, f"the job database {engine.db} was missing", ("held", "crash", "live"))
    assert "the list of 4 jobs was rebuilt from the job folders (4 made by an older Rigpilot" in line
    with EngineClient(autostart=False, client_name="test") as c:
        crash = next(j for j in c.request("jobs")["jobs"] if j["name"] == "crash")
        assert crash["failed_rank"] == 1 and crash["exit_reason"].startswith("rank 1 exited with code 1")
        gate.touch()
        assert engine.wait_state(c, live["id"], "completed", "failed", timeout=120)["state"] == COMPLETED
    wait_for(lambda: not leftover_job_processes(engine.tmp), 30, what="the live job's processes to end")


def test_a_client_that_only_listens_hears_a_recovery_at_once_and_once(engine):
    # The app's stream connection sends no request for minutes; the notice comes to it as an event.
    engine.start()
    heard: list[dict] = []
    with EngineClient(autostart=False, client_name="gui-stream", on_notice=heard.append, timeout=30) as listener:
        listener.request("subscribe", topics=["jobs"])
        with engine.db.open("r+b") as f:
            f.write(os.urandom(engine.db.stat().st_size))
        wait_for(lambda: engine.jobs() and set_aside(engine.state), 30, 0.2, "the engine to notice the damage")
        deadline = time.monotonic() + 10
        while not heard and time.monotonic() < deadline:
            listener.next_event(0.2)
        assert [n["code"] for n in heard] == [JOB_DATABASE_REBUILT]
        listener.request("jobs")  # its next reply does not tell it again
        assert len(heard) == 1
