"""A job's processes give way to the desktop: its ranks, whether torchrun starts them or the warm worker forks
them, run at engine.priority.NICENESS more than the engine (benchmarks/gui_job_open.py --as-job)."""

from __future__ import annotations

import json
import os
import shutil
import sys

import psutil

from rigpilot.engine import priority
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.jobs.store import TERMINAL_STATES, JobStore
from rigpilot.engine.jobs.supervisor import Supervisor, SupervisorOptions
from rigpilot.engine.launch import warm
from rigpilot.engine.settings import Settings

from support.engine import engine_home
from support.waiting import wait_for

PRINT_NICENESS = "import os\nprint('niceness', os.environ['RANK'], os.nice(0))\n"


def expected(niceness: int = priority.NICENESS) -> int:
    return min(os.nice(0) + niceness, priority.MAX_NICENESS)


def test_a_jobs_ranks_run_at_the_jobs_niceness_and_the_setting_changes_it(tmp_path, monkeypatch):
    engine_home(tmp_path, monkeypatch)
    script = tmp_path / "nice.py"
    script.write_text(PRINT_NICENESS)
    store = JobStore(tmp_path / "engine.db")
    jobs = {}
    for niceness in (priority.NICENESS, 0):
        sup = Supervisor(store, tmp_path / "jobs", load_profile("4x-rtx4090"), options=SupervisorOptions(
            warm_worker=False, job_niceness=niceness))  # fmt: skip
        sup.start()
        try:
            job = jobs[niceness] = sup.submit({"kind": "script", "script": [str(script)], "gpus": [0, 1]}, None,
                                              str(tmp_path))  # fmt: skip
            wait_for(lambda j=job: store.get(j["id"]).state in TERMINAL_STATES, 240, 0.2, f"job {job['id']} to end")
        finally:
            sup.stop()
    for niceness, job in jobs.items():
        assert store.get(job["id"]).state == "completed", store.get(job["id"]).last_log
        logs = tmp_path / "jobs" / job["id"] / "logs"
        printed = {int((logs / f"rank{r}.log").read_text().split("niceness", 1)[1].split()[1]) for r in (0, 1)}
        assert printed == {expected(niceness)}


def test_the_setting_is_a_niceness_or_the_default_with_a_warning(tmp_path, monkeypatch):
    engine_home(tmp_path, monkeypatch)
    Settings.path().parent.mkdir(parents=True, exist_ok=True)
    for value, read in ((0, 0), (19, 19), (20, 5), (-1, 5), (True, 5), ("3", 5), (2.5, 5)):
        Settings.path().write_text(json.dumps({"job_niceness": value}))
        settings = Settings.load()
        assert settings.job_niceness == read
        assert (settings.warnings == []) == (value == read), settings.warnings
    assert settings.warnings == ["job_niceness ignored: 2.5 is not a whole number from 0 to 19"]


def test_the_warm_worker_that_forks_ranks_runs_at_the_jobs_niceness(tmp_path):
    worker = warm.WarmWorker(tmp_path, tmp_path / "warm.log")
    worker.start(sys.executable, dict(os.environ))
    try:
        # `nice` sets it, then execs the worker: the same pid, a moment after the start
        wait_for(lambda: psutil.Process(worker.popen.pid).cmdline()[0] != shutil.which("nice"), 10, 0.01, "the exec")
        assert psutil.Process(worker.popen.pid).nice() == expected()
    finally:
        worker.stop()


def test_without_nice_the_command_runs_as_it_is(monkeypatch):
    monkeypatch.setattr(priority.shutil, "which", lambda name: None)
    assert priority.yielding(["python", "-V"]) == ["python", "-V"]
    monkeypatch.undo()
    assert priority.yielding(["python", "-V"], 0) == ["python", "-V"]
