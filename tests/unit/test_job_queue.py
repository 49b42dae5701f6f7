"""The queue's order (engine.jobs.launching.due), without starting anything: a queued job starts once none of
its GPUs is held by a run or wanted by a job queued before it, so a big job is never starved by small ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rigpilot.engine.jobs.launching import due
from rigpilot.engine.jobs.runs import Run
from rigpilot.engine.jobs.store import QUEUED, RUNNING, STARTING, JobRecord


def job(job_id: str, seq: int, gpus: list[int], state: str = QUEUED, slurm: dict[str, Any] | None = None) -> JobRecord:
    return JobRecord(id=job_id, seq=seq, kind="script", name=job_id, state=state, gpus=gpus, ranks=len(gpus),
                     simulated=True, created=0.0, slurm=slurm)  # fmt: skip


def running(*recs: JobRecord) -> dict[str, Run]:
    return {r.id: Run(r, Path("/nonexistent") / r.id, None) for r in recs}


def ids(recs: list[JobRecord]) -> list[str]:
    return [r.id for r in recs]


def test_a_big_job_is_not_starved_by_small_ones_queued_after_it():
    held = running(job("r", 1, [0], RUNNING))
    big, small, other = job("big", 2, [0, 1, 2, 3]), job("small", 3, [1]), job("other", 4, [3])
    # GPUs 1 and 3 are free, but the big job queued first waits for them too.
    assert ids(due([small, other, big], held)) == []
    assert ids(due([small, other, big], {})) == ["big"]  # GPU 0 freed: the big job first, alone


def test_jobs_on_disjoint_gpus_start_together_in_the_order_they_were_queued():
    a, b, c, d = job("a", 3, [0]), job("b", 1, [1]), job("c", 2, [0]), job("d", 4, [2, 3])
    assert ids(due([a, b, c, d], {})) == ["b", "c", "d"]  # c was queued before a, for the same GPU
    assert ids(due([a, d], running(job("s", 1, [3], STARTING)))) == ["a"]  # a starting run holds its GPUs


def test_slurm_decides_for_its_jobs_and_its_runs_hold_none_of_this_machines_gpus():
    on_slurm = {"partition": "gpu"}
    held = running(job("r", 1, [0], RUNNING), job("s", 2, [1], RUNNING, slurm={**on_slurm, "job_id": "7"}))
    queued = [job("to-slurm", 3, [0], slurm=on_slurm), job("here", 4, [1]), job("blocked", 5, [0])]
    assert ids(due(queued, held)) == ["to-slurm", "here"]
