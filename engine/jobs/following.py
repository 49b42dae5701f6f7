"""Following a running job through what its ranks write into its folder.

One reason to change: the files a run's ranks leave while they run (metric records under `metrics/`, one
state file per rank under `ranks/`) and what the engine concludes from them: new progress, a rank that
failed, whether the job has started, whether every step is trained. The local launcher
(engine.jobs.supervisor) and SLURM (engine.jobs.slurm) follow runs alike through these.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rigpilot.engine.jobs.metrics import read_records
from rigpilot.engine.jobs.runs import Run, clean_exit
from rigpilot.engine.jobs.store import JobRecord


def read_metrics(run: Run) -> bool:
    """Take in the metric records written since the last read; whether there were any."""
    got = False
    while True:
        records, run.cursor, more = read_records(run.job_dir / "metrics", run.cursor)
        for r in records:
            run.summary.add(r)
            run.stepped = run.stepped or (r.get("kind") is None and r.get("step") is not None)
        got = got or bool(records)
        if not more:
            break
    if got:
        run.dirty = True
        if run.tensorboard is not None:
            run.tensorboard.catch_up()
    return got


def read_ranks(run: Run, failure_grace_s: float) -> None:
    """Take in each rank's state file; the first rank that exited unclean stops the run within `failure_grace_s`."""
    for f in (run.job_dir / "ranks").glob("rank*.json"):
        try:
            state = _read_json(f)
            rank = int(state["rank"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # written atomically, so this is a foreign file; ignore it
        run.ranks[rank] = state
        ex = state.get("exit")
        if ex and run.stop_reason is None and not clean_exit(ex):
            run.stop_reason = "rank_failed"
            # torchrun notices within its monitor interval and stops the other ranks itself;
            # this bounds how long that may take when a rank hangs in a collective.
            run.kill_at = time.monotonic() + failure_grace_s


# Job kinds without steps, and the status phase their ranks report once they run (engine.workers).
MEASURING = {"doctor": "checking", "calibrate": "calibrating", "serve": "serving"}


def has_started(run: Run) -> bool:
    if run.stepped:
        return True
    # The machine check, a calibration and a server take no steps: they run once their ranks say they measure
    # (or, a server, once it listens: engine.workers.serve's "serving" status).
    if run.rec.kind in MEASURING:
        return run.summary.phase == MEASURING[run.rec.kind]
    # A script need not report steps; it runs once every rank has started it.
    if run.rec.kind == "script":
        if run.summary.records:
            return True
        started = [r for r in run.ranks.values() if "child_pid" in r or "exit" in r]
        return len(started) >= run.rec.ranks
    return False


def trained_every_step(rec: JobRecord, run: Run) -> bool:
    """A training job whose ranks reported its last step: what is left (the final checkpoint, the evaluation,
    the model) finishes the job, and a cancel now would only cut that short."""
    max_steps = run.summary.max_steps
    return rec.kind == "train" and run.stepped and max_steps is not None and max_steps > 0 and (run.summary.step or 0) >= max_steps


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())
