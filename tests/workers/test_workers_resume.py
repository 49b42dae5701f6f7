"""Where a training job ends and where it starts again.

A resume passes over a damaged newest checkpoint for the one before it (never step 0 while a complete
checkpoint loads), and a cancel that arrives once the last step is trained lets the job finish: the
worker finishes it (real torchrun jobs on CPU ranks), and the supervisor calls it completed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rigpilot.engine.jobs.following import trained_every_step
from rigpilot.engine.jobs.runs import run_outcome
from rigpilot.engine.jobs.store import CANCELLED, COMPLETED
from rigpilot.engine.jobspec.spec import JobSpec

from support.job_records import ended_run
from support.paths import REPO, TINY_LLAMA_CONFIG
from support.worker_jobs import JOB_TIMEOUT_S, LLAMA_TRAIN, job_env, losses, records, run_job, torchrun, write_job


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_passed_over_for_the_one_before_with_a_note(tmp_path: Path) -> None:
    train = {**LLAMA_TRAIN, "max_steps": 8, "checkpoint_every": 4, "eval_every": 0, "keep_checkpoints": 0}
    first = write_job(tmp_path / "first", kind="train", model=str(TINY_LLAMA_CONFIG),
                      parallelism={"dp_replicate": 2}, train=train)  # fmt: skip
    run_job(first, 2)
    again = tmp_path / "again"
    spec = JobSpec.read(first)
    spec.resume = True
    spec.write(again)
    shutil.copytree(first / "checkpoints", again / "checkpoints")
    shard = sorted((again / "checkpoints" / "step-8").glob("*.distcp"))[0]
    shard.unlink()  # complete, and damaged since: a file lost
    proc = run_job(again, 2)
    notes = [r["message"] for r in records(again) if r.get("kind") == "note"]
    passed = next(n for n in notes if "resuming from step-4" in n)
    assert passed.startswith("checkpoint step-8 is damaged (") and passed.endswith(
        "): resuming from step-4, the newest checkpoint that loads"
    )
    assert "resumed from step-4 at step 4" in proc.stdout + proc.stderr
    mine, theirs = losses(again), losses(first)
    assert sorted(mine) == [5, 6, 7, 8] and all(mine[s] == theirs[s] for s in mine)
    assert shard.is_file()  # step-8 was written whole again
    # The damaged one was set aside at the resume: kept for a look, never the newest a later prune keeps.
    assert sorted((again / "checkpoints" / "step-8.damaged").glob("*.distcp"))
    assert [d.name for d in sorted((again / "checkpoints").iterdir())] == ["step-4", "step-8", "step-8.damaged"]


@pytest.mark.slow
def test_a_cancel_once_the_last_step_is_trained_lets_the_job_finish(tmp_path: Path) -> None:
    job = write_job(
        tmp_path / "last", kind="train", model=str(TINY_LLAMA_CONFIG), parallelism={},
        train={**LLAMA_TRAIN, "max_steps": 1, "checkpoint_every": 1, "eval_every": 0},
    )  # fmt: skip
    proc = subprocess.Popen(torchrun(job, 1), cwd=REPO, env=job_env(job), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        metrics = job / "metrics" / "rank0.jsonl"
        while not (metrics.is_file() and any(r.get("phase") == "training" for r in records(job))):
            assert proc.poll() is None and time.monotonic() < deadline, "the job ended or stalled before training"
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGTERM)  # the cancel reaches the one step, or what follows it
        proc.wait(timeout=120)  # torchrun itself exits 1 on the SIGTERM; the rank's own ending is in its records
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ended = [r for r in records(job) if r.get("kind") == "status" and r.get("phase") in ("done", "cancelled")]
    assert [(r["phase"], r["exit_code"]) for r in ended] == [("done", 0)]
    assert (job / "checkpoints" / "step-1" / "COMPLETE").is_file() and (job / "output" / "config.json").is_file()


def test_a_cancel_that_found_every_step_done_ends_the_job_completed(tmp_path):
    done = {0: {"code": 0}, 1: {"code": 0}}
    assert run_outcome(ended_run(tmp_path, done, cancel_requested=True), 0)["state"] == COMPLETED
    script = ended_run(tmp_path, done, cancel_requested=True, kind="script")
    assert run_outcome(script, 0)["state"] == CANCELLED  # a script may exit 0 on SIGTERM: it was stopped
    stopped = ended_run(tmp_path, {0: {"code": 143}, 1: {"code": 143}}, cancel_requested=True)
    assert run_outcome(stopped, 143)["state"] == CANCELLED


def test_a_cancel_after_the_last_step_is_not_sent_to_the_ranks(tmp_path):
    run = ended_run(tmp_path, {})
    run.summary.max_steps = 40
    for step in (39, 40):
        run.summary.add({"step": step, "loss": 1.0, "rank": 0, "run": 1})
        run.stepped = True
        assert trained_every_step(run.rec, run) == (step == 40)
    run.rec.kind = "script"
    assert not trained_every_step(run.rec, run)  # a script's steps are its own to count
