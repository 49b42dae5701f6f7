"""A job's run as the supervisor follows it, and how a run ended, read from what its processes left.

The local launcher (engine.jobs.supervisor) and SLURM (engine.jobs.slurm) both follow runs and
judge their ends with these, so neither has to reach into the other.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rigpilot.engine.diskspace import NO_ROOM_BYTES, DiskFull, free_bytes
from rigpilot.engine.jobs import energy
from rigpilot.engine.jobs.metrics import Cursor, MetricsSummary
from rigpilot.engine.jobs.store import CANCELLED, COMPLETED, FAILED, INTERRUPTED, JobRecord
from rigpilot.engine.jobs.tensorboard import TensorboardLog
from rigpilot.engine.jobspec.spec import JobSpec
from rigpilot.engine.workers import EXIT_DISK_FULL

LAST_LOG_LINES = 20


@dataclass
class Run:
    """A job that has processes (or had, until the next tick notices)."""

    rec: JobRecord
    job_dir: Path
    popen: subprocess.Popen | None  # None for a job re-adopted after a service restart
    launcher_log: IO[bytes] | None = None
    summary: MetricsSummary = field(default_factory=MetricsSummary)
    cursor: Cursor = field(default_factory=dict)
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    stop_reason: str | None = None  # "cancel" | "rank_failed"
    kill_at: float | None = None
    killed: bool = False
    last_publish: float = 0.0
    dirty: bool = False
    stepped: bool = False  # a step of this run was reported (the summary also holds earlier runs')
    energy: energy.EnergyMeter | None = None
    tensorboard: TensorboardLog | None = None  # the job asked for TensorBoard event files (engine.jobs.tensorboard)
    launcher_ended: float | None = None  # monotonic: when the launcher was first seen gone

    @property
    def token(self) -> str:
        return run_token(self.rec)


def local_gpus_in_use(runs: Mapping[str, Run]) -> set[int]:
    """The GPUs of this machine that followed runs hold (a SLURM job's GPUs are the cluster's)."""
    return {g for r in runs.values() if r.rec.slurm is None for g in r.rec.gpus}


def run_token(rec: JobRecord) -> str:
    """The marker every process of one run of a job carries; a multi-node job's nodes may share a computer,
    so each node's part has its own (else one node's sweep would kill another's ranks)."""
    node = (rec.nodes or {}).get("node")
    return f"{rec.id}:{rec.run}" + (f":{node}" if node else "")


def run_outcome(run: Run, rc: int | None, *, service_was_down: bool = False) -> dict[str, Any]:
    """How a job ended, from the launcher's status, the ranks' exit records and the metrics."""
    rec = run.rec
    job_dir = run.job_dir
    exits = {r: s["exit"] for r, s in run.ranks.items() if s.get("exit")}
    failures = sorted(((e.get("time") or 0.0, r) for r, e in exits.items() if not clean_exit(e)))
    errors = [e for e in run.summary.errors if e.get("run", rec.run) == rec.run]  # not an earlier run's
    oom = next((e for e in reversed(errors) if e.get("error") == "out_of_memory"), None)
    base: dict[str, Any] = {"cancel_requested": rec.cancel_requested, "exit_code": rc}

    all_clean = len(exits) >= rec.ranks and not failures
    # Every rank's own exit decides, where each recorded one: torchrun exits 1 when it was sent the SIGTERM itself.
    finished = not failures and oom is None and (rc == 0 or all_clean)
    # Rigpilot's workers exit 0 only once their work is done: a cancel that came after a training job's last
    # step, or a generation's last batch, found nothing left to stop. A script may exit 0 on SIGTERM itself.
    if finished and (rec.kind != "script" or not (run.stop_reason == "cancel" or rec.cancel_requested)):
        return {**base, "state": COMPLETED, "exit_reason": None, "failed_rank": None, "last_log": [], "resumable": False}

    if run.stop_reason == "cancel" or rec.cancel_requested:
        how = "killed after the grace period" if run.killed else "stopped"
        return {**base, "state": CANCELLED, "exit_reason": f"cancelled by the user ({how})", "resumable": True,
                "failed_rank": None, "last_log": []}  # fmt: skip

    if service_was_down and not failures and oom is None:
        return {**base, "state": INTERRUPTED, "failed_rank": None, "resumable": True,
                "exit_reason": "the engine service stopped while the job ran and its processes are gone; "
                               "resume continues from the newest checkpoint",
                "last_log": log_tail(job_dir / "logs" / "launcher.log")}  # fmt: skip

    failed_rank = oom.get("rank") if oom else (failures[0][1] if failures else None)
    # torchrun names the first rank it saw fail. A rank whose wrapper was killed outright leaves no exit
    # record, and the ranks torchrun then stopped would otherwise be blamed for exiting on its SIGTERM.
    # Where that rank did record its exit, the records' times are finer than torchrun's monitor interval:
    # a rank killed by SIGKILL and its peer failing on the broken connection end within one interval.
    root = _torchrun_root_cause(job_dir / "logs" / "launcher.log", rec.run) if oom is None else None
    if root is not None and root[0] not in exits:
        failed_rank = root[0]
        exits.setdefault(failed_rank, root[1])
    if oom is not None:
        reason = _oom_reason(oom, rec.predicted)
        error: dict[str, Any] | None = {**oom, "predicted": rec.predicted}
    elif failed_rank is not None:
        reason = f"rank {failed_rank} {_describe_exit(exits[failed_rank])}"
        # engine.workers reports why it gave up ("user_error", "crash") before exiting.
        said = next((e for e in reversed(errors) if e.get("rank") == failed_rank), None)
        if said and isinstance(said.get("message"), str) and said["message"]:
            reason += f": {said['message']}"
        error = said
    else:
        reason = f"torchrun exited with code {rc} before any rank ended" if rc is not None else "the launcher vanished"
        error = None
    if oom is None:
        failed_rank, reason, error = _disk_full_cause(run, errors, exits, failed_rank, reason, error)
    log_file = job_dir / "logs" / (f"rank{failed_rank}.log" if failed_rank is not None else "launcher.log")
    return {**base, "state": FAILED, "exit_reason": reason, "failed_rank": failed_rank, "resumable": True,
            "last_log": log_tail(log_file), "error": error}  # fmt: skip


def _disk_full_cause(
    run: Run,
    errors: list[dict[str, Any]],
    exits: dict[int, dict[str, Any]],
    failed_rank: int | None,
    reason: str,
    error: dict[str, Any] | None,
) -> tuple[int | None, str, dict[str, Any] | None]:
    """(failed rank, reason, error) for a run that met a full disk, else as given.

    The one line a rank reported (engine.workers: error "disk_full") is the reason, whichever rank
    failed first: every rank of a failed checkpoint says the same. Where the disk was too full even for
    that line, the exit code says so, and where even the exit record is missing the folder's free space does.
    """
    said = next((e for e in reversed(errors) if e.get("error") == "disk_full"), None)
    if said is not None and isinstance(said.get("message"), str):
        rank = said.get("rank") if isinstance(said.get("rank"), int) else failed_rank
        return rank, said["message"], said
    coded = sorted(r for r, e in exits.items() if e.get("code") == EXIT_DISK_FULL)
    free = free_bytes(run.job_dir)
    # A rank that said what went wrong (bad data, a script's own exit) is believed; a crash may be the disk's.
    explained = error is not None and error.get("error") not in (None, "crash")
    if not coded and (explained or free is None or free >= NO_ROOM_BYTES):
        return failed_rank, reason, error
    full = DiskFull(run.job_dir, free)
    line = full.line() if coded else f"{full.line()} ({reason})"
    return (coded[0] if coded else failed_rank), line, {"error": "disk_full", "message": line, **full.fields}


_ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+)\b.*?exitcode\s*:\s*(-?\d+)", re.DOTALL
)


def _torchrun_root_cause(launcher_log: Path, run: int) -> tuple[int, dict[str, Any]] | None:
    """(rank, exit record) of the failure torchrun's ChildFailedError report names as the root cause in
    this run's part of the launcher log, or None."""
    try:
        with launcher_log.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(size - (256 << 10), 0))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    marker = text.rfind(f"--- run {run}:")
    if marker < 0:
        return None
    m = _ROOT_CAUSE.search(text, marker)
    if m is None:
        return None
    code = int(m.group(2))
    return int(m.group(1)), {"code": code if code >= 0 else None, "signal": -code if code < 0 else None}


def _oom_reason(oom: dict[str, Any], predicted: dict[str, Any] | None) -> str:
    parts = [f"out of memory on rank {oom.get('rank', '?')}"]
    # engine.workers reports the allocator's numbers as allocated/reserved/max_allocated/free/total (bytes).
    for key in ("allocated", "reserved", "max_allocated", "free", "total", "tried"):
        value = oom.get(key, oom.get(f"{key}_bytes"))
        if isinstance(value, int | float) and not isinstance(value, bool):
            parts.append(f"{key.replace('_', ' ')} {value / 2**30:.2f} GiB")
    if predicted and isinstance(predicted.get("peak_memory_bytes"), int | float):
        parts.append(f"the plan predicted a peak of {predicted['peak_memory_bytes'] / 2**30:.2f} GiB per GPU")
    if predicted and predicted.get("suggestion"):
        parts.append(f"suggested fix: {predicted['suggestion']}")
    return "; ".join(parts)


def clean_exit(ex: dict[str, Any]) -> bool:
    return ex.get("code") == 0 and not ex.get("signal")


def _describe_exit(ex: dict[str, Any]) -> str:
    if ex.get("signal"):
        try:
            name = signal.Signals(ex["signal"]).name
        except ValueError:
            name = f"signal {ex['signal']}"
        return f"was killed by {name}"
    return f"exited with code {ex.get('code')}"


def newest_checkpoint(job_dir: Path) -> dict[str, Any] | None:
    """The checkpoint a resumed training job will start from, by the workers' rule
    (engine.workers.checkpoint.latest_checkpoint: a `step-N` folder marked COMPLETE), without importing torch."""
    best: tuple[int, str] | None = None
    with contextlib.suppress(OSError):
        for d in (job_dir / "checkpoints").iterdir():
            step_text = d.name.removeprefix("step-")
            if d.name.startswith("step-") and step_text.isdigit() and (d / "COMPLETE").is_file():
                if best is None or int(step_text) > best[0]:
                    best = (int(step_text), d.name)
    return {"step": best[0], "name": best[1]} if best else None


def max_steps_of(spec: JobSpec) -> int | None:
    return spec.train.max_steps if spec.kind == "train" and spec.train else None


def log_tail(path: Path, lines: int = LAST_LOG_LINES) -> list[str]:
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(size - 16384, 0))
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()[-lines:]

