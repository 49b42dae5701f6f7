"""The job list as the job folders hold it, for when the job database is lost.

Every job folder carries `record.json`, a copy of the job's row that the store writes whenever the
row changes (engine.jobs.resilient_store), so the folders alone give the job table back exactly.
A folder an older Rigpilot made has none: its job is pieced together from job.json, the launcher
log's run markers, the ranks' exit records and the metrics, and judged as the supervisor judges a
job whose engine was gone (engine.jobs.runs.run_outcome); one whose processes still run is
listed running, with its launcher, so the supervisor adopts it again. A folder whose job.json cannot
be read is listed as a failed job that says so in one line, never skipped and never a crash.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rigpilot.engine import paths
from rigpilot.engine.jobs import recovery
from rigpilot.engine.jobs.metrics import summarize
from rigpilot.engine.jobs.processes import job_processes
from rigpilot.engine.jobs.runs import Run, max_steps_of, run_outcome, run_token
from rigpilot.engine.jobs.store import (
    ACTIVE_STATES,
    ALL_STATES,
    FAILED,
    INTERRUPTED,
    RUNNING,
    STARTING,
    JobRecord,
)
from rigpilot.engine.jobs.submission import plan_prediction
from rigpilot.engine.jobspec.spec import JobSpec

log = logging.getLogger(__name__)

RECORD_FILE = "record.json"
RECORD_SCHEMA = "rigpilot.job_record/1"
DAMAGED_FOLDER = "job_folder_damaged"  # the `error` code of a job listed from a folder whose job.json is unreadable

_FIELDS = {f.name for f in dataclasses.fields(JobRecord)}
_RUN_MARKER = re.compile(rb"^--- run (\d+):", re.MULTILINE)
_RANK_LOG = re.compile(r"^rank(\d+)\.log$")


@dataclass
class FolderJobs:
    """What the job folders under one root hold."""

    records: list[JobRecord] = field(default_factory=list)
    pieced: list[str] = field(default_factory=list)  # jobs with no record.json, pieced together from what runs left
    damaged: list[str] = field(default_factory=list)  # jobs listed as failed because job.json is unreadable


def write_record(job_dir: Path, rec: JobRecord) -> None:
    """Keep the job's row in its folder (0600, replaced atomically). Raises OSError."""
    paths.write_private(job_dir / RECORD_FILE, json.dumps({"schema": RECORD_SCHEMA, "record": rec.to_dict()}))


def write_deleted(job_dir: Path) -> None:
    """Mark a folder whose job was deleted, so a folder the deletion could not remove is never listed again."""
    paths.write_private(job_dir / RECORD_FILE, json.dumps({"schema": RECORD_SCHEMA, "deleted": True}))


def has_record(job_dir: Path) -> bool:
    return (job_dir / RECORD_FILE).is_file()


def read_record(job_dir: Path) -> tuple[JobRecord | str | None, float]:
    """The job's record.json: the record, "deleted", or None when there is none it can be read from; and
    when it was written (0 without one)."""
    try:
        written = (job_dir / RECORD_FILE).stat().st_mtime
    except OSError:
        return None, 0.0
    return _read_record(job_dir), written


def job_folders(jobs_root: Path) -> list[Path]:
    """The folders under `jobs_root` that may hold a job (not hidden, not empty)."""
    try:
        with os.scandir(jobs_root) as it:
            entries = [e for e in it if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    return sorted(Path(e.path) for e in entries if not _empty(e.path))


def _empty(folder: str) -> bool:
    try:
        with os.scandir(folder) as it:
            return next(it, None) is None
    except OSError:
        return False  # a folder that cannot be listed is still a job to name; reading it says why


def read_jobs(jobs_root: Path, skip: Collection[str] = ()) -> FolderJobs:
    """Every job under `jobs_root` but those in `skip`, from its record.json where it has one."""
    found = FolderJobs()
    without_record: list[JobRecord] = []
    for job_dir in job_folders(jobs_root):
        if job_dir.name in skip:
            continue
        try:
            rec, how = read_job(job_dir)
        except Exception as e:  # a folder unlike any this code expects: named, never the end of the rebuild
            log.exception("reading job folder %s failed", job_dir)
            rec, how = _damaged(job_dir, f"it cannot be read ({type(e).__name__}: {_one_line(e)})"), "damaged"
        if rec is None:
            continue
        if how == "damaged":
            found.damaged.append(rec.id)
        elif how == "pieced":
            found.pieced.append(rec.id)
        (found.records if how == "recorded" else without_record).append(rec)
    # The queue order of recorded jobs stands; the others, made before records were kept, go before them.
    first = min((r.seq for r in found.records), default=1)
    for i, rec in enumerate(sorted(without_record, key=lambda r: r.created)):
        rec.seq = first - len(without_record) + i
    found.records += without_record
    return found


def read_job(job_dir: Path) -> tuple[JobRecord | None, str]:
    """The job in `job_dir` and how it was found: "recorded", "pieced" or "damaged"; (None, "deleted") for a
    deleted job's leftover folder."""
    record = _read_record(job_dir)
    if record == "deleted":
        return None, "deleted"
    try:
        spec: JobSpec | None = JobSpec.read(job_dir)
        spec_trouble = None
    except FileNotFoundError:
        spec, spec_trouble = None, "job.json is missing"
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        spec, spec_trouble = None, f"job.json is unreadable ({_one_line(e)})"
    if isinstance(record, JobRecord):
        record.id = job_dir.name  # a folder copied by hand under another name is that name's job
        if spec_trouble is not None and not _alive(record):
            return _damaged(job_dir, spec_trouble, record), "damaged"
        return record, "recorded"
    if spec is None:
        return _damaged(job_dir, spec_trouble or "job.json is unreadable"), "damaged"
    return _piece_together(job_dir, spec), "pieced"


def _read_record(job_dir: Path) -> JobRecord | str | None:
    try:
        data = json.loads((job_dir / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("schema") != RECORD_SCHEMA:
        return None
    if data.get("deleted"):
        return "deleted"
    values = data.get("record")
    if not isinstance(values, dict):
        return None
    try:
        rec = JobRecord(**{k: v for k, v in values.items() if k in _FIELDS})
    except TypeError:
        return None
    ok = (
        isinstance(rec.state, str) and rec.state in ALL_STATES and isinstance(rec.seq, int)
        and isinstance(rec.gpus, list) and isinstance(rec.created, int | float) and isinstance(rec.name, str)
    )  # fmt: skip
    return rec if ok else None


def _alive(rec: JobRecord) -> bool:
    """Whether the record's run still has processes (then the supervisor must go on following it)."""
    return rec.state in ACTIVE_STATES and bool(job_processes(run_token(rec)))


def _damaged(job_dir: Path, trouble: str, record: JobRecord | None = None) -> JobRecord:
    rec = record or JobRecord(
        id=job_dir.name, seq=0, kind="unknown", name=job_dir.name, state=FAILED, gpus=[], ranks=0, simulated=False,
        created=_created(job_dir),
    )  # fmt: skip
    rec.state, rec.resumable, rec.launcher_pid, rec.launcher_start = FAILED, False, None, None
    rec.ended = rec.ended or _last_change(job_dir)
    rec.exit_reason = f"its folder is damaged: {trouble}; the folder is kept as it was"
    rec.error = {"error": DAMAGED_FOLDER, "message": trouble, "folder": str(job_dir)}
    return rec


def _piece_together(job_dir: Path, spec: JobSpec) -> JobRecord:
    run = _last_run(job_dir / "logs" / "launcher.log")
    plan = _read_json(job_dir / "plan.json")
    rec = JobRecord(
        id=job_dir.name, seq=0, kind=spec.kind, name=spec.name or job_dir.name, state=INTERRUPTED,
        gpus=list(spec.gpus), ranks=_ranks(job_dir, spec), simulated=spec.simulated, created=_created(job_dir),
        run=run or 1, resumable=True, predicted=plan_prediction(plan if isinstance(plan, dict) else None),
        max_restarts=recovery.max_restarts_of(spec),
    )  # fmt: skip
    if run is None:
        rec.exit_reason = "it had not started when its record was lost; resume it to run it"
        return rec
    summary, _ = summarize(job_dir / "metrics", max_steps_of(spec))
    ranks = _rank_states(job_dir)
    starts = [s["create_time"] for s in ranks.values() if isinstance(s.get("create_time"), int | float)]
    rec.started = min(starts) if starts else summary.first_time
    procs = job_processes(run_token(rec))
    if procs:  # still running: its launcher is the run's first process
        launcher = min(procs, key=lambda p: p.create_time())
        rec.state = RUNNING if summary.step is not None else STARTING
        rec.launcher_pid, rec.launcher_start = launcher.pid, launcher.create_time()
        rec.resumable = False
        return rec
    outcome = run_outcome(Run(rec, job_dir, None, summary=summary, ranks=ranks), None, service_was_down=True)
    for name, value in outcome.items():
        if name in _FIELDS:
            setattr(rec, name, value)
    rec.ended = _last_change(job_dir)
    rec.measured = summary.to_dict()
    return rec


def _last_run(launcher_log: Path) -> int | None:
    """The newest run the launcher log announces, or None when the job was never launched."""
    try:
        with launcher_log.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(size - (1 << 20), 0))
            text = f.read()
    except OSError:
        return None
    runs = [int(m.group(1)) for m in _RUN_MARKER.finditer(text)]
    return max(runs) if runs else None


def _ranks(job_dir: Path, spec: JobSpec) -> int:
    try:
        seen = [int(m.group(1)) for p in (job_dir / "logs").iterdir() if (m := _RANK_LOG.match(p.name))]
    except OSError:
        seen = []
    return max(seen) + 1 if seen else max(len(spec.gpus), 1)


def _rank_states(job_dir: Path) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    try:
        files = list((job_dir / "ranks").glob("rank*.json"))
    except OSError:
        return out
    for f in files:
        state = _read_json(f)
        if isinstance(state, dict) and isinstance(state.get("rank"), int):
            out[state["rank"]] = state
    return out


def _created(job_dir: Path) -> float:
    """When the job was submitted, near enough: the oldest change among the folder's first files and folders."""
    times = []
    for p in (job_dir, *(job_dir / n for n in ("job.json", "plan.json", "logs", "metrics", "checkpoints", "output"))):
        try:
            times.append(p.stat().st_mtime)
        except OSError:
            pass
    return min(times) if times else 0.0


def _last_change(job_dir: Path) -> float:
    times = []
    for p in (job_dir / "ranks", job_dir / "logs", job_dir / "metrics"):
        try:
            times += [p.stat().st_mtime, *(c.stat().st_mtime for c in p.iterdir())]
        except OSError:
            pass
    return max(times) if times else _created(job_dir)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _one_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:200]
