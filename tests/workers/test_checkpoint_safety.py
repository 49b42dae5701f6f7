"""Resuming runs no code from the job folder: a pickle planted in any file a resume reads is refused unexecuted.

A real two-rank DDP job writes a real checkpoint; copies of it get one planted file each (the DCP
`.metadata` pickle, a torch.save'd value inside a `.distcp` data file, the COMPLETE marker). Each
planted pickle is first shown to be live (an unrestricted load creates the marker file), then the
resume must fail on every rank with one line and leave no marker. An untouched copy still resumes.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from rigpilot.engine.jobspec.spec import JobSpec
from rigpilot.engine.workers import ERROR_PREFIX, EXIT_USER_ERROR
from rigpilot.engine.workers.checkpoint import SafeReader

from support.paths import TINY_LLAMA_CONFIG
from support.worker_jobs import LLAMA_TRAIN, losses, records, run_job, write_job

pytestmark = pytest.mark.slow


class Planted:
    """Unpickling this creates `marker`: the stand-in for any code a planted file could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("safety")
    job = write_job(
        root / "base", kind="train", model=str(TINY_LLAMA_CONFIG), parallelism={"dp_replicate": 2},
        train={**LLAMA_TRAIN, "max_steps": 4, "checkpoint_every": 4, "eval_every": 0},
    )  # fmt: skip
    run_job(job, 2)
    assert (job / "checkpoints" / "step-4" / "COMPLETE").is_file()
    return job


def resumable_copy(job: Path, name: str) -> Path:
    again = job.parent / name
    spec = JobSpec.read(job)
    spec.resume = True
    spec.train.max_steps = 6
    spec.write(again)
    shutil.copytree(job / "checkpoints" / "step-4", again / "checkpoints" / "step-4")
    return again


def assert_refused(job: Path, marker: Path, expected: str) -> None:
    logs = job / "logs"
    run_job(job, 2, expect=EXIT_USER_ERROR, log_dir=logs)
    assert not marker.exists(), "the planted pickle ran"
    rank_logs = sorted(logs.rglob("stderr.log"))
    assert len(rank_logs) == 2
    for log in rank_logs:
        last = log.read_text().strip().splitlines()[-1]
        assert last.startswith(f"{ERROR_PREFIX} checkpoint step-4: ") and expected in last, last
    assert not [r for r in records(job) if r.get("loss") is not None], "no step may run from a refused checkpoint"


def live(payload: bytes, marker: Path, loader) -> None:
    """The planted bytes really run code under an unrestricted load (so the test can fail)."""
    loader(payload)
    assert marker.exists()
    marker.unlink()


def test_a_planted_metadata_pickle_is_refused(trained: Path) -> None:
    job = resumable_copy(trained, "metadata")
    ckpt = job / "checkpoints" / "step-4"
    marker = job / "ran-metadata"
    metadata = SafeReader(str(ckpt)).read_metadata()
    metadata.planner_data = Planted(marker)
    payload = pickle.dumps(metadata)
    live(payload, marker, pickle.loads)
    (ckpt / ".metadata").write_bytes(payload)
    assert_refused(job, marker, "its .metadata is refused (posix.system is not part of a checkpoint's metadata)")


def test_a_planted_value_in_a_data_file_is_refused(trained: Path) -> None:
    job = resumable_copy(trained, "value")
    ckpt = job / "checkpoints" / "step-4"
    marker = job / "ran-value"
    buf = io.BytesIO()
    torch.save(Planted(marker), buf)
    blob = buf.getvalue()
    live(blob, marker, lambda b: torch.load(io.BytesIO(b), weights_only=False))
    # Point the checkpoint's `train.step` value at the planted bytes, appended to its data file.
    metadata = SafeReader(str(ckpt)).read_metadata()
    index = next(i for i in metadata.storage_data if i.fqn == "train.step")
    info = metadata.storage_data[index]
    data_file = ckpt / info.relative_path
    offset = data_file.stat().st_size
    with data_file.open("ab") as f:
        f.write(blob)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(blob))
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    assert_refused(job, marker, "train.step is not plain data")


def test_a_planted_complete_marker_is_refused(trained: Path) -> None:
    job = resumable_copy(trained, "marker")
    marker = job / "ran-complete"
    payload = pickle.dumps(Planted(marker))
    live(payload, marker, pickle.loads)
    (job / "checkpoints" / "step-4" / "COMPLETE").write_bytes(payload)
    assert_refused(job, marker, "its COMPLETE marker is not Rigpilot's JSON")


def test_an_untouched_checkpoint_still_resumes(trained: Path) -> None:
    job = resumable_copy(trained, "clean")
    run_job(job, 2)
    assert sorted(losses(job)) == [5, 6]
