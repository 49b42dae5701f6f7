"""A full disk, on real small filesystems: a tmpfs mounted for each test (root only; CI runs as root).

Unit-level tests fill a small tmpfs and check each part that writes (the job store, a rank's exit
record, how a run's end is judged, the restart policy) against the real ENOSPC. The end-to-end test
puts a real engine's state folder on a tmpfs, fills it while a training job runs, and follows the
job from its failed checkpoint to a resume that trains as an uninterrupted run does. The seconds from
the failed write to the failed job are benchmarks/disk_full.py's.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rigpilot.engine.api.client import EngineError
from rigpilot.engine.diskspace import DiskFull, free_bytes, is_disk_full, no_room
from rigpilot.engine.jobs import recovery
from rigpilot.engine.jobs.conditions import Conditions
from rigpilot.engine.jobs.runs import run_outcome
from rigpilot.engine.jobs.store import FAILED, QUEUED, RUNNING, JobRecord, JobStore
from rigpilot.engine.jobs.submission import JOB_ROOM_BYTES, disk_need
from rigpilot.engine.jobspec.spec import JobSpec, TrainSettings
from rigpilot.engine.launch.rankexec import _record_state

from support.engine import leftover_job_processes
from support.job_records import ended_run, job_record
from support.paths import REPO
from support.waiting import wait_for

TINY_LLAMA_CONFIG = REPO / "examples" / "models" / "tiny-llama" / "config.json"
MIB = 1 << 20


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs of this test's own."""
    with mounted_tmpfs(tmp_path / "disk", "8m") as folder:
        yield folder


class mounted_tmpfs:
    """`mount -t tmpfs` at `folder` for the block's length; skips the test, saying why, where mounting is refused."""

    def __init__(self, folder: Path, size: str) -> None:
        self.folder, self.size = folder, size

    def __enter__(self) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size},mode=0700", "tmpfs", str(self.folder)],
            capture_output=True, text=True,
        )  # fmt: skip
        if r.returncode != 0:
            pytest.skip(f"a full disk is tested on a tmpfs of its own, and mounting one needs root: {r.stderr.strip()}")
        return self.folder

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["umount", "-l", str(self.folder)], check=False)


def fill(folder: Path, leave: int = 0) -> Path:
    """A file taking all of `folder`'s free space but `leave` bytes; delete it to give the room back."""
    filler = folder / f"filler-{time.monotonic_ns()}"
    with open(filler, "wb") as f:
        for _ in range(20):
            size = (free_bytes(folder) or 0) - leave
            if size <= 0:
                break
            try:
                os.posix_fallocate(f.fileno(), 0, size)
                break
            except OSError as e:  # a running job wrote between the measure and the fill: measure again
                if e.errno != errno.ENOSPC:
                    raise
                f.truncate(0)
    return filler


# -- recognising a full disk ----------------------------------------------------------------


def test_a_full_disk_is_said_in_one_line_with_the_folder_the_need_and_what_is_free():
    e = DiskFull("/s/jobs/ab12cd/checkpoints", 80 * MIB, int(1.2 * 1024 * MIB), "for step-600")
    assert str(e) == "disk full: /s/jobs/ab12cd/checkpoints needs about 1.2 GiB for step-600, 80.0 MiB free"
    assert e.fields["needed_bytes"] == int(1.2 * 1024 * MIB) and e.fields["free_bytes"] == 80 * MIB
    assert str(DiskFull("/s/jobs", 0)) == "disk full: /s/jobs has 0 B free"


def test_enospc_sqlites_full_database_and_a_wrapped_write_error_are_all_a_full_disk(small_disk):
    fill(small_disk)
    assert free_bytes(small_disk) == 0 and no_room(small_disk)
    with pytest.raises(OSError) as caught, open(small_disk / "more", "wb") as f:
        f.write(b"x" * 65536)
        f.flush()
    assert caught.value.errno == errno.ENOSPC and is_disk_full(caught.value)
    try:
        raise RuntimeError("file write failed") from caught.value  # how torch.save reports it
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped)
    assert is_disk_full(sqlite3.OperationalError("database or disk is full"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied")) and not is_disk_full(RuntimeError("boom"))


# -- the engine's own writes ----------------------------------------------------------------


def test_the_job_store_keeps_what_a_full_disk_refuses_and_writes_it_once_there_is_room(small_disk):
    store = JobStore(small_disk / "engine.db")
    rec = job_record()
    store.insert(rec)
    filler = fill(small_disk)
    store.update(rec, state=FAILED, exit_reason="disk full: …", resumable=True)  # refused by SQLite, kept
    assert store.unsaved == 1
    assert JobStore(small_disk / "engine.db").get(rec.id).state == RUNNING, "the disk was meant to refuse the row"
    assert store.get(rec.id).state == FAILED and store.find("ab")[0].exit_reason == "disk full: …"
    assert [r.id for r in store.list({FAILED})] == [rec.id] and store.list({RUNNING}) == []
    with pytest.raises(DiskFull, match=r"^disk full: .* has \d+(\.\d)? [KMG]?i?B free$"):
        store.insert(job_record("ef34ab"))  # a new job is refused, not kept in memory only
    assert not store.flush_unsaved() and store.unsaved == 1
    filler.unlink()
    assert store.flush_unsaved() and store.unsaved == 0
    again = JobStore(small_disk / "engine.db").get(rec.id)
    assert (again.state, again.exit_reason, again.resumable) == (FAILED, "disk full: …", True)


def test_the_job_folders_copy_catches_up_when_the_held_changes_are_written(small_disk):
    # The folder's record.json missed the change for the same want of room; it is the copy a damaged
    # database is rebuilt from, so it must not stay behind once there is room.
    from rigpilot.engine.jobs import job_folders
    from rigpilot.engine.jobs.resilient_store import ResilientJobStore

    jobs = small_disk / "jobs"
    store = ResilientJobStore(small_disk / "engine.db", jobs)
    rec = job_record()
    (jobs / rec.id).mkdir(parents=True)
    store.insert(rec)
    filler = fill(small_disk)
    store.update(rec, state=FAILED, exit_reason="disk full: …")
    assert store.unsaved == 1 and job_folders.read_record(jobs / rec.id)[0].state == RUNNING
    filler.unlink()
    assert store.flush_unsaved() and store.unsaved == 0
    assert job_folders.read_record(jobs / rec.id)[0].state == FAILED


def test_a_failed_write_for_another_reason_loses_none_of_the_changes_the_disk_held_back(small_disk):
    store = JobStore(small_disk / "engine.db")
    rec = job_record()
    store.insert(rec)
    filler = fill(small_disk)
    store.update(rec, state=FAILED)  # held back
    filler.unlink()
    real_write = store._write
    calls = []

    def damaged_once(job_id, changes):
        calls.append(dict(changes))
        if len(calls) == 1:
            raise sqlite3.DatabaseError("database disk image is malformed")
        real_write(job_id, changes)

    store._write = damaged_once
    with pytest.raises(sqlite3.DatabaseError):
        store.update(rec, exit_reason="disk full: …")
    store.update(rec, exit_reason="disk full: …")  # as the resilient store tries again after recovering
    assert calls[-1] == {"state": FAILED, "exit_reason": "disk full: …"} and store.unsaved == 0
    again = JobStore(small_disk / "engine.db").get(rec.id)
    assert (again.state, again.exit_reason) == (FAILED, "disk full: …")


def test_a_rank_record_is_written_in_place_when_the_disk_has_no_room_for_a_new_file(small_disk):
    state = small_disk / "rank0.json"
    _record_state(state, {"rank": 0, "pid": 123})
    filler = fill(small_disk)
    _record_state(state, {"rank": 0, "pid": 123, "exit": {"code": 4, "signal": None, "time": 1.0}})
    assert json.loads(state.read_text())["exit"]["code"] == 4
    assert not (small_disk / "rank0.tmp").exists()
    filler.unlink()


def test_a_lasting_condition_is_logged_once_and_once_more_when_it_clears(caplog):
    conditions = Conditions(logging.getLogger("test-conditions"))
    with caplog.at_level(logging.INFO, "test-conditions"):
        for free in ("0 B", "4.0 KiB", "0 B"):
            conditions.failing("store", f"disk full: /s has {free} free", cause="disk full")
        conditions.cleared("store", "written again")
        conditions.cleared("store", "written again")
        conditions.failing("tick", "tick failed: RuntimeError: boom", RuntimeError("boom"))
        conditions.failing("tick", "tick failed: RuntimeError: boom", RuntimeError("boom"))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["disk full: /s has 0 B free", "written again", "tick failed: RuntimeError: boom"]
    assert caplog.records[-1].exc_info is not None  # a bug keeps its traceback, once


# -- how a run that met a full disk ended, and what happens next ------------------------------


def test_a_run_that_met_a_full_disk_fails_with_the_ranks_line_or_the_folders_free_space(small_disk, tmp_path):
    job_dir = small_disk / "jobs" / "ab12cd"
    job_dir.mkdir(parents=True)
    said = {"rank": 0, "error": "disk_full", "message": "disk full: /j/checkpoints needs about 2.8 MiB for step-8, "
            "1.4 MiB free", "folder": "/j/checkpoints", "needed_bytes": 2_900_000, "free_bytes": 1_400_000}  # fmt: skip
    out = run_outcome(ended_run(job_dir, {0: {"code": 4}, 1: {"code": 4}}, [said]), 1)
    assert (out["state"], out["exit_reason"], out["failed_rank"]) == (FAILED, said["message"], 0)
    assert out["error"]["needed_bytes"] == 2_900_000
    # Too full even for that line: the exit code says so, and the folder's free space is measured here.
    filler = fill(small_disk)
    out = run_outcome(ended_run(job_dir, {0: {"code": 1}, 1: {"code": 4}}), 1)
    assert out["exit_reason"] == f"disk full: {job_dir} has 0 B free" and out["error"]["error"] == "disk_full"
    # Nothing recorded but a crash, on a disk with no room: the crash is named beside it.
    out = run_outcome(ended_run(job_dir, {1: {"code": 1}}), 1)
    assert out["exit_reason"] == f"disk full: {job_dir} has 0 B free (rank 1 exited with code 1)"
    filler.unlink()
    elsewhere = tmp_path / "roomy"
    elsewhere.mkdir()
    assert run_outcome(ended_run(elsewhere, {1: {"code": 1}}), 1)["exit_reason"] == "rank 1 exited with code 1"


def disk_full_job(job_dir: Path, needed: int, **fields) -> JobRecord:
    spec = JobSpec(id=job_dir.name, kind="train", model="m", gpus=[0, 1], train=TrainSettings(max_steps=40,
                   checkpoint_every=4))  # fmt: skip
    spec.write(job_dir)
    error = {"error": "disk_full", "message": f"disk full: {job_dir}/checkpoints needs about …",
             "folder": str(job_dir / "checkpoints"), "needed_bytes": needed, "free_bytes": 0}  # fmt: skip
    failed = {"state": FAILED, "error": error, "exit_reason": error["message"], "resumable": True, "max_restarts": 3}
    return job_record(job_dir.name, **{**failed, **fields})


def test_a_disk_full_failure_is_not_restarted_until_there_is_room_then_restarts_from_its_checkpoint(small_disk):
    job_dir = small_disk / "jobs" / "ab12cd"
    (job_dir / "checkpoints").mkdir(parents=True)
    rec = disk_full_job(job_dir, 2 * MIB)
    outcome = {"state": FAILED, "exit_reason": rec.exit_reason, "error": rec.error, "resumable": True}
    kept = recovery.after_failure(rec, outcome, [rec.error], job_dir, dict, simulated=True, max_cpu_ranks=4,
                                  from_step=8)  # fmt: skip
    assert kept["state"] == FAILED and kept["exit_reason"] == (
        f"{rec.exit_reason}; not restarted while the disk is full: it restarts by itself once 2.0 MiB is free there, "
        "or resume it"
    )
    assert recovery.waits_for_space(rec)
    filler = fill(small_disk, leave=MIB)
    assert recovery.restart_when_space_returns(rec, job_dir, dict, simulated=True, max_cpu_ranks=4, from_step=8) is None
    assert not JobSpec.read(job_dir).resume
    filler.unlink()
    changes = recovery.restart_when_space_returns(rec, job_dir, dict, simulated=True, max_cpu_ranks=4, from_step=8)
    assert changes is not None and changes["state"] == QUEUED and changes["run"] == 2
    assert changes["restarts"][-1]["from_step"] == 8 and changes["restarts"][-1]["cause"] == rec.exit_reason
    assert JobSpec.read(job_dir).resume  # never from step 0 while a checkpoint exists
    spent = disk_full_job(job_dir, 2 * MIB, run=2, restarts=[{"run": 1}], max_restarts=1)
    assert not recovery.waits_for_space(spent)  # its restarts in a row are used up: it waits for the user


def test_a_training_job_needs_room_for_a_checkpoint_and_its_model_before_it_is_accepted():
    config = json.loads(TINY_LLAMA_CONFIG.read_text())
    full = JobSpec(id="a", kind="train", model="m", train=TrainSettings(method="scratch", checkpoint_every=4))
    need, words = disk_need(full, config)
    params = (need - JOB_ROOM_BYTES) // 16  # fp32 weights and AdamW's two moments, and the fp32 model
    assert 200_000 < params < 230_000
    assert words.startswith("a 2.") and "checkpoint of the weights and optimizer state, and the " in words
    lora = JobSpec(id="a", kind="train", model="m", train=TrainSettings(method="lora", lora_rank=4, checkpoint_every=4))
    lora_need, lora_words = disk_need(lora, config)
    assert lora_need - JOB_ROOM_BYTES < (need - JOB_ROOM_BYTES) / 4 and "adapters" in lora_words
    no_checkpoints = JobSpec(id="a", kind="train", model="m", train=TrainSettings(method="scratch", checkpoint_every=0))
    model_only, model_words = disk_need(no_checkpoints, config)
    assert model_words.endswith("final model") and model_only - JOB_ROOM_BYTES == params * 4
    assert disk_need(JobSpec(id="s", kind="script", script=["x.py"]), {}) == (JOB_ROOM_BYTES, "")
    half = JobSpec(id="a", kind="train", model="m",
                   train=TrainSettings(method="scratch", checkpoint_every=4, precision="bf16", master_weights="bf16"))  # fmt: skip
    assert disk_need(half, config)[0] - JOB_ROOM_BYTES == params * 8  # bf16 weights, moments and model


# -- end to end: a real engine whose state folder fills up under a training job ---------------

TRAIN = {
    "dataset": [str(REPO / "examples" / "data" / "shakespeare.txt")], "method": "scratch", "precision": "fp32",
    "seq_len": 32, "micro_batch": 2, "grad_accum": 2, "max_steps": 40, "learning_rate": 1e-2, "warmup_steps": 2,
    "eval_every": 0, "checkpoint_every": 4, "seed": 1234,
}  # fmt: skip


def complete_steps(job_dir: Path) -> list[int]:
    return sorted(int(d.name.removeprefix("step-")) for d in (job_dir / "checkpoints").glob("step-*")
                  if d.name.removeprefix("step-").isdigit() and (d / "COMPLETE").is_file())  # fmt: skip


def losses_by_step(c, job_id: str) -> dict[int, float]:
    """Rank 0's loss per step, the latest run's where a resumed run trained a step again."""
    out: dict[int, float] = {}
    for r in c.all_metrics(job_id)[0]:
        if r.get("rank") == 0 and r.get("kind") is None and r.get("loss") is not None:
            out[r["step"]] = r["loss"]
    return out


@pytest.mark.slow
def test_a_job_that_fills_its_disk_fails_in_one_line_and_resumes_from_its_last_checkpoint(engine, tmp_path):

    with mounted_tmpfs(tmp_path / "state", "64m") as state:  # the engine's whole state folder: jobs, database, logs
        engine.start()
        spec = {"kind": "train", "model": str(TINY_LLAMA_CONFIG), "env": {"HF_HUB_OFFLINE": "1"}, "train": TRAIN}
        with engine.client() as c:
            reference = c.request("submit", spec={**spec, "gpus": [2, 3], "name": "uninterrupted"})["job"]
            ref = engine.wait_state(c, reference["id"], "completed", "failed", timeout=240)
            assert ref["state"] == "completed", (ref["exit_reason"], ref["last_log"])

            job = c.request("submit", spec={**spec, "gpus": [0, 1], "name": "full", "max_restarts": 0})["job"]
            job_dir = Path(job["job_dir"])
            first = job_dir / "checkpoints" / "step-4"
            wait_for((first / "COMPLETE").exists, 240, 0.01, "the first checkpoint")
            checkpoint = sum(f.stat().st_size for f in first.iterdir())
            filler = fill(state, leave=checkpoint // 2)  # the next checkpoint finds half the room it needs

            done = engine.wait_state(c, job["id"], "failed", "completed", timeout=120)
            reason = done["exit_reason"]
            assert done["state"] == "failed" and done["resumable"], reason
            kept = complete_steps(job_dir)[-1]
            assert reason.startswith(f"disk full: {job_dir / 'checkpoints'} needs about ") and "\n" not in reason
            assert f" for step-{kept + 4}, " in reason and reason.endswith(" free")
            assert done["error"]["error"] == "disk_full" and done["error"]["needed_bytes"] >= checkpoint * 0.9
            assert not leftover_job_processes(tmp_path)
            assert not list((job_dir / "checkpoints").glob("*.tmp"))  # the partial one gave its room back
            marker = json.loads((job_dir / "checkpoints" / f"step-{kept}" / "COMPLETE").read_text())
            assert marker["step"] == kept

            # Now not a byte left: the engine's own writes (telemetry, the job table) meet the full disk too.
            rest = fill(state)
            time.sleep(3)  # three telemetry samples, thirty supervisor ticks
            for ask in (lambda: c.request("submit", spec={**spec, "gpus": [2]}), lambda: c.request("resume", job=job["id"])):
                with pytest.raises(EngineError) as refused:
                    ask()
                said = refused.value
                assert said.code == "disk_full" and str(said).startswith("disk full: ") and "\n" not in str(said)
                assert said.fields["free_bytes"] < said.fields["needed_bytes"]
            assert engine.job(c, job["id"])["state"] == "failed"  # and the refused resume changed nothing
            assert [j["id"] for j in c.request("jobs")["jobs"]] == [job["id"], reference["id"]]

            filler.unlink()
            rest.unlink()
            again = c.request("resume", job=job["id"])["job"]
            assert again["resumes_from"] == {"step": kept, "name": f"step-{kept}"}
            done = engine.wait_state(c, job["id"], "completed", "failed", timeout=240)
            assert done["state"] == "completed", (done["exit_reason"], done["last_log"])
            mine, theirs = losses_by_step(c, job["id"]), losses_by_step(c, reference["id"])
        assert mine == theirs  # every step, those after the resume included, as the uninterrupted run's
        log = (job_dir / "logs" / "rank0.log").read_text()
        assert f"resumed from step-{kept} at step {kept}" in log
        engine_log = (tmp_path / "engine.log").read_text(errors="replace")
        assert "Traceback" not in engine_log
        assert sum("disk full" in line for line in engine_log.splitlines()) <= 4
        engine.stop()


def test_an_engine_whose_state_folder_is_full_does_not_start_and_says_why_in_one_line(tmp_path, monkeypatch, capsys):
    from rigpilot.engine.cli.entry import main as cli_main

    from support.engine import engine_home

    engine_home(tmp_path, monkeypatch)
    with mounted_tmpfs(tmp_path / "state", "4m") as state:
        fill(state)
        assert cli_main(["jobs"]) == 2
        err = capsys.readouterr().err
        assert err == f"rigpilot: error: the engine service did not start: disk full: {state / 'rigpilot'} has 0 B free\n"
