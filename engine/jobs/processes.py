"""Finding and ending a job's processes.

One reason to change: how the engine recognises the processes of one run of a job and stops them. torchrun
and every rank lead sessions of their own, so a job is not one process group: its processes are found by the
environment marker each inherits (`RIGPILOT_RUN_TOKEN`) and by what the ranks record (`ranks/rank<N>.json`:
pid, process group, start time), and a pid is trusted only while it is still the process that was started
(same start time or marker), never a recycled one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from typing import Any

import psutil

from rigpilot.engine.jobs.runs import Run

log = logging.getLogger(__name__)

RUN_TOKEN_ENV = "RIGPILOT_RUN_TOKEN"


def job_processes(token: str) -> list[psutil.Process]:
    """Every live process of this user that carries the job run's environment marker."""
    me = os.getuid()
    found = []
    for p in psutil.process_iter(["uids", "status"]):
        try:
            if p.info["uids"] is None or p.info["uids"].real != me or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get(RUN_TOKEN_ENV) == token:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def alive(pid: Any, create_time: Any, token: str | None = None) -> bool:
    """Whether `pid` is still the process we started (same start time or marker), not a recycled pid."""
    if not isinstance(pid, int):
        return False
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        if isinstance(create_time, int | float):
            return abs(p.create_time() - create_time) < 0.5
        if token is not None:
            return p.environ().get(RUN_TOKEN_ENV) == token
        return True
    except (psutil.Error, OSError):
        return False


def launcher_alive(run: Run) -> bool:
    if run.popen is not None:
        return run.popen.poll() is None
    return alive(run.rec.launcher_pid, run.rec.launcher_start)


def signal_launcher(run: Run, sig: signal.Signals) -> None:
    rec = run.rec
    if run.popen is not None and run.popen.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(run.popen.pid, sig)  # torchrun leads its own session
    elif run.popen is None and alive(rec.launcher_pid, rec.launcher_start):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(rec.launcher_pid, sig)  # type: ignore[arg-type]


def kill(run: Run) -> None:
    """SIGKILL every process of the job: the launcher, each rank's group, and stragglers."""
    signal_launcher(run, signal.SIGKILL)
    for state in run.ranks.values():
        pgid = state.get("pgid")
        if isinstance(pgid, int) and alive(state.get("pid"), state.get("create_time")):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
    for p in job_processes(run.token):
        with contextlib.suppress(psutil.Error):
            p.kill()


def sweep(run: Run, timeout: float = 5.0) -> list[int]:
    """Kill whatever of the job outlived its launcher; return their pids, after they are gone."""
    procs = job_processes(run.token)
    for state in run.ranks.values():
        for key in ("pid", "child_pid"):
            pid = state.get(key)
            if isinstance(pid, int) and pid not in {p.pid for p in procs} and alive(pid, None, run.token):
                with contextlib.suppress(psutil.Error):
                    procs.append(psutil.Process(pid))
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    _, left = psutil.wait_procs(procs, timeout=timeout)
    if left:
        log.error("job %s: processes %s survived SIGKILL", run.rec.id, [p.pid for p in left])
    return [p.pid for p in procs]
