"""Where a training job starts again: a resume passes over a damaged newest checkpoint for the one before it,
never step 0 while a complete checkpoint loads (real torchrun jobs on CPU ranks).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_workers_jobs import LLAMA_TRAIN, TINY_LLAMA_CONFIG, losses, records, run_job, write_job

from rigpilot.engine.jobs.spec import JobSpec

pytestmark = pytest.mark.slow


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
