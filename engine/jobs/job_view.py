"""A job as clients see it: its record with what is derived for display.

One reason to change: the fields the `jobs` and `job` replies and the job events add to a job's record
(progress, energy and its cost, wall time over all runs, the GPUs a queued job waits for, what a starting
job is doing, predictions beside measurements). The record itself is engine.jobs.store's.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rigpilot.engine.jobs import energy, tensorboard
from rigpilot.engine.jobs.runs import Run, local_gpus_in_use
from rigpilot.engine.jobs.store import QUEUED, STARTING, JobRecord


def job_view(rec: JobRecord, runs: Mapping[str, Run], job_dir: Path, *, detail: bool = True) -> dict[str, Any]:
    """A job as clients see it: the record, progress, and predictions beside measurements. `runs`: the
    runs the engine follows now, by job id."""
    run = runs.get(rec.id)
    d = rec.to_dict()
    d["job_dir"] = str(job_dir)
    progress = run.summary.to_dict(time.time()) if run else with_steady(rec.measured)
    d["progress"] = progress
    d["energy"] = energy.job_energy(rec, run.energy if run else None, time.time())
    d["energy_cost"] = energy.cost(d["energy"], progress, energy.electricity_price())
    d["wall_s"] = wall_s(rec, d["energy"], time.time())
    if rec.state == QUEUED:
        d["waiting_for"] = sorted(local_gpus_in_use(runs) & set(rec.gpus))
    if rec.state == STARTING and rec.slurm is None:
        d["startup_phase"] = startup_phase(run.summary.phase if run else None)
    if detail:
        d["comparison"] = compare(rec.predicted, progress)
        if tensorboard.folder(job_dir).is_dir():
            d["tensorboard_dir"] = str(tensorboard.folder(job_dir))
    return d


def with_steady(measured: dict[str, Any] | None) -> dict[str, Any] | None:
    """A finished job's frozen progress, with the steady speed and step time an engine before them did not
    store: its latest rate, and its wall time per step (the figures it showed then)."""
    if not measured or "steady_tokens_per_s" in measured:
        return measured or None
    rate = measured.get("steps_per_s")
    return {**measured, "steady_tokens_per_s": measured.get("tokens_per_s"),
            "steady_step_time_s": 1 / rate if isinstance(rate, int | float) and rate > 0 else None}  # fmt: skip


def compare(predicted: dict[str, Any] | None, progress: dict[str, Any] | None) -> dict[str, Any] | None:
    if not predicted:
        return None
    progress = progress or {}
    peaks = (progress.get("peak_memory_by_rank") or {}).values()
    measured = {
        "peak_memory_bytes": max(peaks) if peaks else None,
        "tokens_per_s": progress.get("steady_tokens_per_s"),
        "step_time_s": progress.get("steady_step_time_s"),
    }
    return {k: {"predicted": predicted.get(k), "measured": v} for k, v in measured.items()}


def startup_phase(phase: str | None) -> str:
    """What a starting job is doing, from the latest status its ranks reported (engine.workers)."""
    if phase is None:
        return "launching"  # torchrun starting, ranks meeting, interpreters starting
    if phase == "importing":
        return "importing"
    if phase == "loading model":
        return "loading weights"
    if phase == "compiling":
        return "compiling"  # torch.compile's warm-up: the first step compiles each block (engine.workers.compile)
    return "first step"


def wall_s(rec: JobRecord, spent: dict[str, Any] | None, now: float) -> float | None:
    """Seconds the job has run, over all its runs. `started` is the last run's start; the energy record
    times every run from its start to its end (the one running now included)."""
    runs = (spent or {}).get("runs") or []
    if rec.run > 1 and len(runs) == rec.run and all(isinstance(r.get("seconds"), int | float) for r in runs):
        return float(sum(r["seconds"] for r in runs))
    if rec.started is None:
        return None
    return max((rec.ended or now) - rec.started, 0.0)
