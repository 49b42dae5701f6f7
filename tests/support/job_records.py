"""Job records and ended runs made by hand, for the parts that judge them without a running engine."""

import time
from pathlib import Path

from rigpilot.engine.jobs.runs import Run
from rigpilot.engine.jobs.store import RUNNING, JobRecord


def job_record(job_id: str = "ab12cd", **fields) -> JobRecord:
    base = {"seq": 1, "kind": "train", "name": "t", "state": RUNNING, "gpus": [0, 1], "ranks": 2, "simulated": True,
            "created": time.time()}  # fmt: skip
    return JobRecord(id=job_id, **{**base, **fields})


def ended_run(job_dir: Path, exits: dict[int, dict], errors: list[dict] | None = None, **rec_fields) -> Run:
    run = Run(job_record(**rec_fields), job_dir, None)
    run.ranks = {r: {"rank": r, "exit": {"time": 1.0 + r, "signal": None, **e}} for r, e in exits.items()}
    for e in errors or []:
        run.summary.add({"kind": "error", "run": 1, **e})
    return run
