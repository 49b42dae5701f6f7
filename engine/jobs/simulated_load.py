"""What a simulated machine's GPUs show while a job runs on them.

One reason to change: how a job appears on simulated GPUs (busy while it runs, holding the memory its
ranks measured or the plan predicted), so telemetry, the dashboard and energy see jobs on a machine that
has no GPUs. Real GPUs show their jobs by themselves.
"""

from __future__ import annotations

import contextlib

from rigpilot.engine.hardware.simulated import Load, SimulatedBackend
from rigpilot.engine.jobs.runs import Run
from rigpilot.engine.jobs.store import RUNNING, JobRecord

TRAINING_UTILIZATION = 90.0
STARTING_UTILIZATION = 15.0  # loading a model keeps a GPU mostly idle


def apply_load(backend: SimulatedBackend | None, run: Run) -> None:
    """Make the simulated GPUs show the job: busy while it runs, holding its memory."""
    if backend is None or not run.rec.simulated:
        return
    rec = run.rec
    util = TRAINING_UTILIZATION if rec.state == RUNNING else STARTING_UTILIZATION
    predicted = (rec.predicted or {}).get("peak_memory_bytes")
    for i, gpu in enumerate(rec.gpus):
        rank = i % max(rec.ranks, 1)
        memory = run.summary.peak_memory.get(rank) or predicted or 0
        pid = run.ranks.get(rank, {}).get("child_pid") or rec.launcher_pid
        load = Load(
            utilization=util, memory_bytes=int(memory), comm_fraction=0.15 if len(rec.gpus) > 1 else 0.0,
            pid=pid, command=f"rigpilot {rec.kind} {rec.name} (rank {rank})",
        )
        with contextlib.suppress(KeyError):
            backend.set_load(gpu, rec.id, load)


def clear_load(backend: SimulatedBackend | None, rec: JobRecord) -> None:
    if backend is None:
        return
    for gpu in rec.gpus:
        with contextlib.suppress(KeyError):
            backend.set_load(gpu, rec.id, None)
