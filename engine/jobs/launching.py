"""How a queued job's turn comes and how one run's launcher starts.

One reason to change: the queue's order and the launcher process of one run. A queued job starts once none
of its GPUs is used by a running job or wanted by a job queued before it, so a big job is never starved by a
stream of small ones; a SLURM job is handed to SLURM, whose queue decides. A run is
`python -m torch.distributed.run ... -m rigpilot.engine.launch.rankexec JOB_DIR -- COMMAND` in a session of
its own, with a fresh ranks/ folder, a free rendezvous port, its command line at the head of its part of
logs/launcher.log, and the ranks' environment for this job (engine.launch.torchrun builds both lines).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import IO

import psutil

from rigpilot.engine import paths, priority
from rigpilot.engine.jobs import machine_check
from rigpilot.engine.jobs.processes import RUN_TOKEN_ENV
from rigpilot.engine.jobs.runs import Run, local_gpus_in_use, run_token
from rigpilot.engine.jobs.store import JobRecord
from rigpilot.engine.jobs.warm_tending import WarmTending
from rigpilot.engine.jobspec import secrets as job_secrets
from rigpilot.engine.jobspec.spec import JobSpec
from rigpilot.engine.launch import warm
from rigpilot.engine.launch.torchrun import rank_environment, rank_target, torchrun_command


def on_vllm(spec: JobSpec) -> bool:
    """An inference job the submission gave to vLLM: one process, which starts a worker per GPU itself."""
    return spec.kind == "infer" and spec.infer is not None and spec.infer.backend == "vllm"


def due(queued: list[JobRecord], runs: Mapping[str, Run]) -> list[JobRecord]:
    """The queued jobs to start now, in queue order: every SLURM job (SLURM's queue decides where and when it
    runs, not this machine's GPUs) and each local one whose GPUs no run holds and no earlier job waits for."""
    busy = local_gpus_in_use(runs)
    reserved: set[int] = set()
    starting = []
    for rec in sorted(queued, key=lambda r: r.seq):
        if rec.slurm is not None:
            starting.append(rec)
            continue
        want = set(rec.gpus)
        if want & (busy | reserved):
            reserved |= want  # later jobs may not take GPUs an earlier job waits for
            continue
        starting.append(rec)
        busy |= want
    return starting


def fresh_ranks_folder(job_dir: Path) -> None:
    """An empty ranks/ for the run: the last run's rank records would read as this one's."""
    shutil.rmtree(job_dir / "ranks", ignore_errors=True)
    (job_dir / "ranks").mkdir(parents=True, exist_ok=True)


def open_launcher_log(job_dir: Path) -> IO[bytes]:
    """A fresh ranks/ folder and the launcher's log, opened to append; raises OSError (a full disk among them)."""
    fresh_ranks_folder(job_dir)
    (job_dir / "logs").mkdir(parents=True, exist_ok=True)
    return paths.open_private(job_dir / "logs" / "launcher.log", "ab")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(rec: JobRecord, spec: JobSpec, job_dir: Path, port: int, python: str, monitor_interval_s: float) -> list[str]:
    return torchrun_command(
        python=python, job_id=rec.id, run=rec.run, ranks_per_node=1 if on_vllm(spec) else rec.ranks,
        nodes=rec.nodes or {}, port=port, monitor_interval_s=monitor_interval_s, job_dir=job_dir,
        target=rank_target(python, job_dir, spec.script if rec.kind == "script" else None),
    )


def environment(rec: JobRecord, spec: JobSpec, job_dir: Path, python: str, warm_tending: WarmTending) -> dict[str, str]:
    """The run's environment, less the job's secrets (the caller adds them): the engine's own, the job's
    plain values, the ranks' settings, the run's marker, and a ready warm worker's socket where one fits."""
    # What the machine check sets goes under the job's own values: a user's --env of the same name wins.
    base = {**os.environ, **machine_check.job_env(rec.machine_check), **job_secrets.plain(spec.env)}
    env = rank_environment(base, job_id=rec.id, job_dir=job_dir, run=rec.run, gpus=rec.gpus, ranks=rec.ranks,
                           simulated=rec.simulated)
    env[RUN_TOKEN_ENV] = run_token(rec)
    env.pop(warm.SOCKET_ENV, None)
    # vLLM starts its own workers and imports far more than a warm worker holds: a fresh interpreter.
    warm_fits = rec.kind != "script" and not on_vllm(spec)
    socket_path = warm_tending.socket_for(python) if warm_fits else None
    if socket_path is not None:
        env[warm.SOCKET_ENV] = socket_path
    return env


def popen_launcher(
    rec: JobRecord, job_dir: Path, cmd: list[str], env: dict[str, str], launcher_log: IO[bytes],
    niceness: int = priority.NICENESS,
) -> subprocess.Popen:
    """Start torchrun in a session of its own, giving way to the desktop (engine.priority), in the
    script's folder for a script; raises OSError."""
    cwd = rec.cwd if rec.kind == "script" and rec.cwd and Path(rec.cwd).is_dir() else str(job_dir)
    return subprocess.Popen(
        priority.yielding(cmd, niceness), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=launcher_log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def started_at(popen: subprocess.Popen) -> float | None:
    """The launcher's start time, by which a later engine knows its pid was not reused."""
    try:
        return psutil.Process(popen.pid).create_time()
    except psutil.Error:
        return None
