"""Automatic recovery: whether a job whose rank failed runs again by itself, and on which GPUs.

The engine relaunches the job itself, as `resume` would (the newest complete checkpoint, the next
run number, a new rendezvous id), rather than torchrun's `--max-restarts`: torchrun would restart
the same ranks on the same GPUs, while a GPU that fell off the bus or reports uncorrectable ECC or
hardware XID errors must be left out and the layout fitted to the GPUs that are left.

Policy (a job setting, `JobSpec.max_restarts`, bounded in engine.jobs.limits): None asks for the
default, which restarts a training job up to 3 times when it runs past its checkpoint interval
(a shorter one loses nothing by being started again by hand) and never restarts anything else;
0 turns restarts off. The limit counts restarts in a row: a run the user resumes starts afresh.

Not restarted, with the cause added to the job's reason: a cancel (the user's), a completed job,
out of memory (the same plan would run out again), a rank's user error (bad data or settings), and
a job whose layout cannot shrink to the healthy GPUs (its tensor or pipeline degree no longer
fits): that one waits for the user, failed and resumable, with one line saying why.

A full disk is not retried while it is full: the job stays failed (and resumable) and, where it has
restarts left, `restart_when_space_returns` queues it again once the folder has the room its
checkpoint needs. A restart whose job.json cannot be written is not made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rigpilot.engine.diskspace import free_bytes, human_size
from rigpilot.engine.errors import UserError
from rigpilot.engine.jobs.store import FAILED, QUEUED, JobRecord
from rigpilot.engine.jobspec.spec import JobSpec

DEFAULT_RESTARTS = 3


def default_max_restarts(spec: JobSpec) -> int:
    """The restarts a job gets when the user did not say: 3 for training that outlasts a checkpoint interval."""
    t = spec.train
    if spec.kind == "train" and t is not None and 0 < t.checkpoint_every < t.max_steps:
        return DEFAULT_RESTARTS
    return 0


def max_restarts_of(spec: JobSpec) -> int:
    return default_max_restarts(spec) if spec.max_restarts is None else spec.max_restarts


class CannotShrink(Exception):
    """The job's model-parallel layout needs more GPUs than are healthy."""


@dataclass
class Refit:
    gpus: list[int]
    ranks: int
    notes: list[str] = field(default_factory=list)


def refit(spec: JobSpec, healthy: list[int], *, simulated: bool, max_cpu_ranks: int) -> Refit:
    """Fit `spec` (changed in place) to the `healthy` GPUs of its own, keeping the global batch.

    Tensor and pipeline degrees shape the model and its checkpoint's sharding, so they stay; data
    parallelism shrinks to the largest divisor of its degree that fits, and each replica accumulates
    that many times more micro-batches (as submission does for CPU ranks). Raises CannotShrink.
    """
    slots = min(len(healthy), max_cpu_ranks) if simulated else len(healthy)
    if spec.kind == "script":
        if slots < 1:
            raise CannotShrink("no healthy GPU of the job is left")
        gpus = healthy if simulated else healthy[:slots]
        return Refit(gpus, slots, [f"the script runs as {slots} rank{'s' * (slots != 1)} on GPUs {_list(gpus)}"])
    p = spec.parallelism
    model = p.tp * p.pp
    if model > slots:
        raise CannotShrink(
            f"tp {p.tp} × pp {p.pp} needs {model} GPUs and {len(healthy)} healthy "
            f"{'is' if len(healthy) == 1 else 'are'} left"
        )
    dp_old = p.dp_replicate * p.dp_shard
    dp_new = max(d for d in range(1, dp_old + 1) if dp_old % d == 0 and d * model <= slots)
    ranks = dp_new * model
    gpus = healthy if simulated else healthy[:ranks]
    notes: list[str] = []
    if dp_new < dp_old:
        before = f"dp {p.dp_replicate} × fsdp {p.dp_shard}"
        shard = max(d for d in range(1, min(p.dp_shard, dp_new) + 1) if dp_new % d == 0)
        spec.parallelism = p = dataclasses.replace(p, dp_replicate=dp_new // shard, dp_shard=shard)
        notes.append(f"data parallelism shrinks from {before} to dp {p.dp_replicate} × fsdp {p.dp_shard}")
        if spec.kind == "train" and spec.train is not None:
            t = spec.train
            before_accum = t.grad_accum
            t.grad_accum *= dp_old // dp_new
            notes.append(
                f"gradient accumulation rises from {before_accum} to {t.grad_accum} so each step still trains "
                "the same global batch"
            )
    spec.gpus = list(gpus)
    return Refit(list(gpus), ranks, notes)


def restarts_in_a_row(rec: JobRecord) -> int:
    """Automatic restarts that led to the current run, each from the run just before it."""
    runs = {r.get("run") for r in rec.restarts}
    n, run = 0, rec.run - 1
    while run in runs:
        n, run = n + 1, run - 1
    return n


def after_failure(
    rec: JobRecord,
    outcome: dict[str, Any],
    errors: list[dict[str, Any]],
    job_dir: Path,
    faults: Callable[[], dict[int, str]],
    *,
    simulated: bool,
    max_cpu_ranks: int,
    from_step: int | None,
) -> dict[str, Any]:
    """The record's changes once a run ended as `outcome` (engine.jobs.runs.run_outcome): `outcome` itself, its
    reason completed with why the job is not restarted, or the fields that queue it again.

    `faults` is asked only when a restart is due, so a clean ending costs no driver call. A restart
    rewrites job.json (resume from the newest checkpoint, and any re-fitted layout).
    """
    if outcome.get("state") != FAILED or rec.max_restarts <= 0:
        return outcome
    cause = outcome.get("exit_reason") or "the job failed"
    error = _dict(outcome.get("error"))
    said = {e.get("error") for e in errors if e.get("run", rec.run) == rec.run}  # not an earlier run's
    if error.get("error") == "out_of_memory":
        return _not_restarted(outcome, "out of memory would recur under the same plan")
    if error.get("error") == "user_error" or "user_error" in said:
        return _not_restarted(outcome, "a rank reported a problem with the job's data or settings")
    done = restarts_in_a_row(rec)
    if done >= rec.max_restarts:
        return _not_restarted(outcome, f"it already restarted {done} time{'s' * (done != 1)} in a row (the limit)")
    if error.get("error") == "disk_full":
        room = human_size(room_needed(error))
        return {**outcome, "exit_reason": f"{cause}; not restarted while the disk is full: it restarts by itself "
                f"once {room} is free there, or resume it"}  # fmt: skip
    return _restart(rec, outcome, cause, job_dir, faults, simulated=simulated, max_cpu_ranks=max_cpu_ranks,
                    from_step=from_step)  # fmt: skip


# Room a disk-full job waits for when its ranks could not say what they needed: its logs and metrics, at least.
MIN_ROOM_BYTES = 16 << 20


def _dict(value: object) -> dict[str, Any]:
    """`value` if it is a dict, else an empty one: a record's error or an outcome read back from JSON may be neither."""
    return value if isinstance(value, dict) else {}


def room_needed(error: dict[str, Any]) -> int:
    """The free bytes a job that failed on a full disk (`error`: its error record) waits for before it restarts."""
    needed = error.get("needed_bytes")
    return needed if isinstance(needed, int) and not isinstance(needed, bool) and needed > 0 else MIN_ROOM_BYTES


def waits_for_space(rec: JobRecord) -> bool:
    """A job that failed on a full disk and restarts by itself once there is room."""
    error = _dict(rec.error)
    return (
        rec.state == FAILED and error.get("error") == "disk_full" and rec.resumable
        and rec.max_restarts > restarts_in_a_row(rec)
    )  # fmt: skip


def restart_when_space_returns(
    rec: JobRecord,
    job_dir: Path,
    faults: Callable[[], dict[int, str]],
    *,
    simulated: bool,
    max_cpu_ranks: int,
    from_step: int | None,
) -> dict[str, Any] | None:
    """The record's changes that queue a disk-full job (`waits_for_space`) again, once its folder has room; else None."""
    error = _dict(rec.error)
    named = error.get("folder")
    folder = named if isinstance(named, str) else str(job_dir)
    free = free_bytes(folder)
    if free is None or free < room_needed(error):
        return None
    outcome = {"state": FAILED, "exit_reason": rec.exit_reason, "error": rec.error}
    cause = str(error.get("message") or rec.exit_reason or "the disk was full")
    changes = _restart(rec, outcome, cause, job_dir, faults, simulated=simulated, max_cpu_ranks=max_cpu_ranks,
                       from_step=from_step)  # fmt: skip
    return changes if changes.get("state") == QUEUED else None


def _restart(
    rec: JobRecord,
    outcome: dict[str, Any],
    cause: str,
    job_dir: Path,
    faults: Callable[[], dict[int, str]],
    *,
    simulated: bool,
    max_cpu_ranks: int,
    from_step: int | None,
) -> dict[str, Any]:
    """The fields that queue the job again from its newest checkpoint, or `outcome` saying why it cannot be."""
    try:
        spec = JobSpec.read(job_dir)
    except (OSError, ValueError) as e:
        return _not_restarted(outcome, f"its job.json is unreadable ({e})")
    bad = {g: why for g, why in faults().items() if g in rec.gpus}
    notes = [f"GPU {g} {why}: left out" for g, why in sorted(bad.items())]
    gpus, ranks = rec.gpus, rec.ranks
    if bad:
        healthy = [g for g in rec.gpus if g not in bad]
        try:
            fit = refit(spec, healthy, simulated=simulated, max_cpu_ranks=max_cpu_ranks)
        except CannotShrink as e:
            which = ", ".join(f"GPU {g} {why}" for g, why in sorted(bad.items()))
            return {
                **outcome,
                "exit_reason": f"{cause}; waiting for you, not restarted: {which}, and {e}; "
                f"fix or replace the GPU, then resume the job",
            }
        gpus, ranks = fit.gpus, fit.ranks
        notes += fit.notes
    spec.resume = True
    try:
        spec.write(job_dir)
    except OSError as e:  # a restart that would not resume must not start from step 0
        return _not_restarted(outcome, f"its job.json could not be written ({e.strerror or e})")
    with contextlib.suppress(OSError):
        os.chmod(job_dir / "job.json", 0o600)  # as the supervisor writes it: the job's settings are its user's
    entry = {
        "time": time.time(), "run": rec.run, "cause": cause, "from_step": from_step,
        "left_out_gpus": sorted(bad), "notes": notes,
    }  # fmt: skip
    return {
        "state": QUEUED, "run": rec.run + 1, "gpus": list(gpus), "ranks": ranks,
        "restarts": [*rec.restarts, entry], "cancel_requested": False, "started": None, "ended": None,
        "exit_reason": None, "exit_code": None, "failed_rank": None, "last_log": [], "error": None,
        "resumable": False, "launcher_pid": None, "launcher_start": None,
    }  # fmt: skip


def refuse_faulty_gpus(rec: JobRecord, faults: dict[int, str]) -> None:
    """A resume by hand must not start the job on a GPU that reports a hardware fault: one line, naming it."""
    bad = sorted(g for g in rec.gpus if g in faults)
    if bad:
        g = bad[0]
        raise UserError(
            f"cannot resume {rec.id}: GPU {g} {faults[g]}; reset or replace it first (the engine forgets an "
            "XID when it restarts), or clone the job onto other GPUs"
        )


def _not_restarted(outcome: dict[str, Any], why: str) -> dict[str, Any]:
    return {**outcome, "exit_reason": f"{outcome.get('exit_reason') or 'the job failed'}; not restarted: {why}"}


def _list(gpus: list[int]) -> str:
    return ",".join(map(str, gpus))
