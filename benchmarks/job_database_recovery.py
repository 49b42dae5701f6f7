"""What keeping the job folders the truth costs: an update, a start on a sound engine.db, a rebuild.

    .venv/bin/python benchmarks/job_database_recovery.py [--jobs 1000]

Makes N jobs in a temporary state folder through the engine's own store (each with its folder, job.json
and record.json), then times: one update (the row, then its record.json), opening the store on the sound
database (quick_check plus reading every record.json to find any the database is behind), the same with
plain JobStore for comparison, and opening it on a damaged engine.db (set aside, every job put back from
its folder). Targets: an update under 1 ms, a start on 1,000 jobs under 0.5 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from rigpilot.engine.jobs.resilient_store import ResilientJobStore
from rigpilot.engine.jobs.store import COMPLETED, QUEUED, JobRecord, JobStore
from rigpilot.engine.jobspec.spec import JobSpec


def timed(fn, n: int = 1) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=1000)
    n = ap.parse_args().jobs
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        jobs = state / "jobs"
        jobs.mkdir()
        db = state / "engine.db"
        store = ResilientJobStore(db, jobs)
        for i in range(n):
            job_id = f"j{i:05x}"
            JobSpec(id=job_id, kind="script", name=f"job {i}", gpus=[0], script=["/bin/true"]).write(jobs / job_id)
            rec = JobRecord(id=job_id, seq=i + 1, kind="script", name=f"job {i}", state=QUEUED, gpus=[0], ranks=1,
                            simulated=True, created=time.time())  # fmt: skip
            store.insert(rec)
            store.update(rec, state=COMPLETED, measured={"step": 100, "loss": 1.0}, exit_reason=None)
        rec = store.get("j00000")
        update = timed(lambda: store.update(rec, name="renamed"), 200)
        store.close()

        def reopen(cls, *args):
            cls(db, *args).close()

        plain = timed(lambda: reopen(JobStore), 5)
        sound = timed(lambda: reopen(ResilientJobStore, jobs), 5)
        with db.open("r+b") as f:
            f.write(os.urandom(4096))
        rebuild = timed(lambda: reopen(ResilientJobStore, jobs))
    print(f"{n} jobs")
    print(f"  update (row + record.json):          {update * 1e3:8.2f} ms")
    print(f"  start on a sound engine.db:          {sound * 1e3:8.1f} ms  (plain JobStore: {plain * 1e3:.1f} ms)")
    print(f"  start on a damaged one (rebuild):    {rebuild * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
