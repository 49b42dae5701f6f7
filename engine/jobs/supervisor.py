"""The job state machine: requests change jobs, a watcher thread moves them along, a restart re-adopts them.

One reason to change: the lifecycle and its bookkeeping. Lifecycle: queued → starting → running (first
step reported) → completed | failed | cancelled, or interrupted when the service was gone while the job's
processes died. Each change is written to the store and announced (`on_job`) under one lock; secrets live
in memory only. The parts it drives change for reasons of their own: which queued job starts and how its
launcher starts (engine.jobs.launching), what the ranks write and what that says (engine.jobs.following),
finding and stopping a job's processes (engine.jobs.processes), how a run ended and whether it restarts
(engine.jobs.runs, engine.jobs.recovery), what clients see of a job (engine.jobs.job_view), the warm worker
(engine.jobs.warm_tending) and simulated GPUs' load (engine.jobs.simulated_load); SLURM jobs run through
engine.jobs.slurm.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from rigpilot.engine import paths, priority
from rigpilot.engine.diskspace import DiskFull, check_room, disk_full, folder_bytes, free_bytes, is_disk_full
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.health import gpu_faults
from rigpilot.engine.hardware.machine import Machine
from rigpilot.engine.hardware.simulated import SimulatedBackend
from rigpilot.engine.jobs import energy, following, launching, processes, recovery, slurm, submission, tensorboard
from rigpilot.engine.jobs.conditions import Conditions
from rigpilot.engine.jobs.job_view import job_view
from rigpilot.engine.jobs.limits import check_env
from rigpilot.engine.jobs.metrics import summarize
from rigpilot.engine.jobs.results import check_name, describe_output, job_settings
from rigpilot.engine.jobs.runs import Run, max_steps_of, newest_checkpoint, run_outcome
from rigpilot.engine.jobs.simulated_load import apply_load, clear_load
from rigpilot.engine.jobs.store import (
    ACTIVE_STATES,
    CANCELLED,
    FAILED,
    QUEUED,
    RESUMABLE_STATES,
    RUNNING,
    STARTING,
    TERMINAL_STATES,
    JobRecord,
    JobStore,
)
from rigpilot.engine.jobs.warm_tending import WarmTending
from rigpilot.engine.jobspec import secrets as job_secrets
from rigpilot.engine.jobspec.spec import JobSpec
from rigpilot.engine.launch.warm import WarmWorker
from rigpilot.engine.runtime import worker_python

log = logging.getLogger(__name__)

_ROOM_CHECK_S = 2.0  # how often jobs that failed on a full disk look for room, and unsaved job changes are written


class JobNotFound(UserError):
    """No job matches what the user typed."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="not_found")


@dataclass
class SupervisorOptions:
    grace_s: float = 30.0  # cancel: time between SIGTERM (workers checkpoint) and SIGKILL
    failure_grace_s: float = 5.0  # after a rank fails, time the others get before SIGKILL
    max_cpu_ranks: int = 4  # ranks per job on a simulated machine (also capped at the CPU count)
    tick_s: float = 0.1  # how often running jobs are checked: bounds metric push latency
    monitor_interval_s: float = 0.5  # torchrun's own check of its ranks
    # Keep a warm worker (engine.launch.warm) while idle so ranks start without importing torch;
    # RIGPILOT_WARM_WORKER=0 in the engine's environment turns it off too.
    warm_worker: bool = True
    job_niceness: int = priority.NICENESS  # how much jobs give way to the desktop (engine.priority)


class Supervisor:
    def __init__(
        self,
        store: JobStore,
        jobs_root: Path,
        machine: Machine,
        backend: Any = None,
        options: SupervisorOptions | None = None,
        *,
        on_job: Callable[[dict[str, Any]], None] = lambda job: None,
        on_metrics: Callable[[str], None] = lambda job_id: None,
        telemetry: Any = None,  # the TelemetryStore a job's energy is integrated from
    ):
        self.store = store
        self.jobs_root = jobs_root
        self.machine = machine
        self.options = options or SupervisorOptions()
        self._simulated_backend = backend if isinstance(backend, SimulatedBackend) else None
        self._backend = backend  # asked for the GPUs' health when a job may restart
        self._on_job = on_job
        self._on_metrics = on_metrics
        self._telemetry = telemetry
        self._lock = threading.RLock()
        self._runs: dict[str, Run] = {}
        # login node (None: here) -> (when, the SLURM states of its jobs): one squeue per poll for all of them
        self.slurm_states: dict[str | None, tuple[float, dict[str, Any]]] = {}
        self._queue_dirty = True
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # Secret env values by job id, never written to disk (engine.jobspec.secrets); gone when the engine stops.
        self._secrets: dict[str, dict[str, str]] = {}
        # engine.service.multinode: may rewrite how a job spanning several engines ended (naming the node).
        self.finish_hook: Callable[[JobRecord, dict[str, Any]], dict[str, Any]] = lambda rec, outcome: outcome
        # Whether a job whose launcher here has exited may be ended now, given the seconds since (a multi-node
        # head waits for its other nodes' last records: engine.service.multinode).
        self.finish_ready: Callable[[JobRecord, float], bool] = lambda rec, waited_s: True
        self.warm_tending = WarmTending(jobs_root.parent / "warm-worker.log")
        # The engine's stored machine check of a machine (its JSON, or None; doctor_store.latest): what it found
        # broken sets variables for the jobs submitted after it (engine.jobs.machine_check).
        self.stored_check: Callable[[Machine], dict[str, Any] | None] = lambda machine: None
        self._conditions = Conditions(log)
        self._room_check_at = 0.0

    @property
    def max_cpu_ranks(self) -> int:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(self.options.max_cpu_ranks, cpus))

    # -- service lifetime -----------------------------------------------------

    def start(self) -> None:
        with self._lock:
            self._recover()
        self._thread = threading.Thread(target=self._loop, name="job-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching. Jobs keep running; the next service re-adopts them."""
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(10)
        with self._lock:
            for run in self._runs.values():
                if run.launcher_log:
                    run.launcher_log.close()
            self.warm_tending.stop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
                self._conditions.cleared("tick", "the supervisor's ticks work again")
            except Exception as e:
                self._conditions.failing("tick", f"supervisor tick failed: {_first_line(e)}", e)
            self._wake.wait(self.options.tick_s)
            self._wake.clear()

    def tick(self) -> None:
        with self._lock:
            for run in list(self._runs.values()):
                # One job that cannot be followed (its folder unreadable, the disk full) must not stop the others'.
                key = f"job {run.rec.id}"
                try:
                    self._poll(run)
                    self._conditions.cleared(key, f"job {run.rec.id} is followed again")
                except Exception as e:
                    self._conditions.failing(key, f"job {run.rec.id}: following it failed: {_first_line(e)}", e)
            if time.monotonic() >= self._room_check_at:
                self._room_check_at = time.monotonic() + _ROOM_CHECK_S
                self._write_unsaved()
                self._restart_when_space_returns()
            if self._queue_dirty:
                self._schedule()
            self._tend_warm()

    def _write_unsaved(self) -> None:
        """Job changes the database refused for want of room: written once there is room, said once either way."""
        if not self.store.unsaved or self.store.flush_unsaved():
            self._conditions.cleared("store", f"the job database {self.store.path} is written again")
        else:
            self._conditions.failing("store", (
                f"{disk_full(self.store.path.parent).line()}: the job database cannot be written; "
                f"changes to {self.store.unsaved} job(s) are kept in memory until there is room"
            ), cause="disk full")  # fmt: skip

    def _restart_when_space_returns(self) -> None:
        for rec in self.store.list({FAILED}):
            if rec.slurm is not None or not recovery.waits_for_space(rec):
                continue
            job_dir = self.job_dir(rec.id)
            changes = recovery.restart_when_space_returns(
                rec, job_dir, lambda: gpu_faults(self._backend), simulated=rec.simulated,
                max_cpu_ranks=self.max_cpu_ranks,
                from_step=(newest_checkpoint(job_dir) or {}).get("step") if rec.kind == "train" else None,
            )  # fmt: skip
            if changes is None:
                continue
            log.info("job %s: its disk has room again; restarting it", rec.id)
            self.store.update(rec, **changes)
            self._queue_dirty = True
            self._on_job(self.view(rec))

    @property
    def warm(self) -> WarmWorker | None:
        """The warm worker, once one was made."""
        return self.warm_tending.worker

    def _tend_warm(self) -> None:
        """Start or stop the warm worker (engine.jobs.warm_tending); idle: no job running, starting or queued."""
        self.warm_tending.tend(self.options.warm_worker, lambda: bool(self._runs or self.store.list({QUEUED})),
                               self.options.job_niceness)

    def replace_machine(self, machine: Machine, backend: Any = None) -> None:
        """Run later jobs on `machine`; refused (UserError naming them) while any job is queued or running.

        A queued job was checked against the old machine's GPUs and a running one holds them, so
        neither may find itself on another machine halfway.
        """
        with self._lock:
            busy = self.store.list(ACTIVE_STATES | {QUEUED})
            if busy:
                names = ", ".join(f"{r.id} '{r.name}' ({r.state})" for r in reversed(busy))
                raise UserError(
                    f"the machine cannot change while jobs use it: {names}; let them finish or cancel them first",
                    reason="machine_busy", jobs=[r.id for r in reversed(busy)],
                )
            self.machine = machine
            self._simulated_backend = backend if isinstance(backend, SimulatedBackend) else None
            self._backend = backend
            self._queue_dirty = True

    # -- requests -------------------------------------------------------------

    def check(
        self, spec_data: dict[str, Any], plan: dict[str, Any] | None, cwd: str | None, nodes: int = 1,
        slurm_options: dict[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """What `submit` would run, through the same code, creating nothing; a refusal raises as submit's would.
        A SLURM job is also put to SLURM itself, which answers without queueing it."""
        worker_python()
        slurm_options = slurm.check_options(slurm_options) if slurm_options is not None else None
        sub = submission.prepare(
            spec_data, plan, cwd, job_id="check", machine=self.machine, max_cpu_ranks=self.max_cpu_ranks,
            nodes=nodes, slurm=slurm_options is not None, machine_check=self.stored_check(self.machine),
            jobs=(self.store.find, self.jobs_root),
        )
        self._check_room(sub, None)
        lines = submission.describe(sub, free_bytes(self.jobs_root))
        if slurm_options is not None:
            lines += slurm.check(sub, slurm_options)
        return {"ok": True, "lines": lines, "would_run": submission.would_run(sub)}

    def submit(
        self, spec_data: dict[str, Any], plan: dict[str, Any] | None, cwd: str | None,
        slurm_options: dict[str, Any] | None = None, *, job_id: str | None = None, nodes: dict[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Queue a job. `job_id` and `nodes`: one engine's part of a multi-node job (engine.service.multinode)."""
        worker_python()  # no PyTorch environment yet: say so now, not after the job has queued
        slurm_options = slurm.check_options(slurm_options) if slurm_options is not None else None
        if job_id is not None and self.store.get(job_id) is not None:
            raise UserError(f"this engine already has a job {job_id}")
        job_id = job_id or self._new_id()
        machine = self.machine
        sub = submission.prepare(
            spec_data, plan, cwd, job_id=job_id, machine=machine, max_cpu_ranks=self.max_cpu_ranks,
            nodes=int((nodes or {}).get("count", 1)), slurm=slurm_options is not None, machine_check=self.stored_check(machine),
            jobs=(self.store.find, self.jobs_root),
        )
        spec = sub.spec
        self._check_room(sub, nodes)
        if nodes and spec.max_restarts:
            raise UserError(
                "automatic restarts do not cover multi-node jobs yet: leave out --max-restarts and resume by hand "
                "('rigpilot resume JOB' reaches every node)"
            )
        if not spec.name:
            spec.name = _default_name(spec)
        spec.env, hidden = job_secrets.split(spec.env)
        hidden = job_secrets.find_secrets(job_secrets.masked_names(spec.env), hidden, "rigpilot run --env NAME=VALUE")
        job_dir = self.job_dir(job_id)
        rec = JobRecord(
            id=job_id, seq=self.store.next_seq(), kind=spec.kind, name=spec.name, state=QUEUED, gpus=spec.gpus,
            ranks=sub.ranks, simulated=spec.simulated, created=time.time(), cwd=sub.cwd, predicted=sub.predicted,
            slurm=slurm_options,
            # A multi-node job is restarted by nobody yet: one node's engine alone would relaunch its own
            # part into a rendezvous the others have left.
            max_restarts=0 if nodes else recovery.max_restarts_of(spec),
            nodes=nodes, machine_check=sub.machine_check,
        )
        try:
            job_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            for shared in ("checkpoints", "output"):
                if nodes and nodes.get(shared):
                    # A multi-node job's ranks read every rank's checkpoint shard on resume, and rank 0, on
                    # whichever node, writes the output: folders every node sees.
                    os.symlink(nodes[shared], job_dir / shared)
            for sub_dir in ("logs", "metrics", "checkpoints", "output", "ranks"):
                (job_dir / sub_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
            _write_spec(spec, job_dir)
            if plan is not None:
                _write_json_atomic(job_dir / "plan.json", plan)
            if slurm_options is not None:  # submitted now, so a refusal (no sbatch, a bad partition) is the reply
                for name, value in slurm.start(self, rec, spec, job_dir).items():
                    setattr(rec, name, value)
            with self._lock:
                if self.machine is not machine:  # replace_machine ran while this job was being checked
                    raise UserError("the engine switched machines while this job was being submitted; submit it again")
                self._secrets[job_id] = hidden
                self.store.insert(rec)
                if rec.slurm is not None:
                    self._runs[rec.id] = slurm.adopt(self, rec)
                self._queue_dirty = True
                view = self.view(rec)
        except BaseException as e:
            shutil.rmtree(job_dir, ignore_errors=True)  # no half-created job behind
            if (rec.slurm or {}).get("job_id"):
                with contextlib.suppress(UserError):
                    slurm.cancel(rec)  # nor a SLURM job nobody follows
            if is_disk_full(e) and not isinstance(e, DiskFull):
                raise disk_full(self.jobs_root, sub.disk_need, "for this job") from None
            raise
        self._wake.set()
        self._on_job(view)
        return view

    def _check_room(self, sub: submission.Submission, nodes: dict[str, Any] | None) -> None:
        """Refuse, in one line with both figures, a job whose folder has less room than it needs."""
        what = f"for this job ({sub.disk_need_what})" if sub.disk_need_what else "for this job"
        check_room((nodes or {}).get("checkpoints") or self.jobs_root, sub.disk_need, what)

    def cancel(self, ref: str) -> dict[str, Any]:
        with self._lock:
            rec = self.resolve(ref)
            if rec.state in TERMINAL_STATES:
                raise UserError(f"job {rec.id} has already ended ({rec.state})")
            run = self._runs.get(rec.id)
            if run is None:  # queued: nothing to stop
                self.store.update(
                    rec, state=CANCELLED, ended=time.time(), exit_reason="cancelled before it started", resumable=True
                )
                self._queue_dirty = True
            elif rec.slurm is not None:
                slurm.cancel(rec)  # SLURM signals the ranks; the next poll sees the job end
                self.store.update(rec, cancel_requested=True)
            elif not rec.cancel_requested:
                self.store.update(rec, cancel_requested=True)
                run.stop_reason = "cancel"
                if not following.trained_every_step(rec, run):
                    run.kill_at = time.monotonic() + self.options.grace_s
                    # torchrun passes SIGTERM on to every rank's process group and waits for them,
                    # so workers get their chance to checkpoint before the grace period ends.
                    processes.signal_launcher(run, signal.SIGTERM)
                # else every step is trained and checkpointed: the job only evaluates and saves its model now,
                # which no cancel may cut short; it ends completed.
            view = self.view(rec)
        self._on_job(view)
        self._wake.set()
        return view

    def resume(self, ref: str, env: dict[str, str] | None = None) -> dict[str, Any]:
        """Queue a job again; `env` gives secrets again (or changes plain values) for this and later runs."""
        with self._lock:
            rec = self.resolve(ref)
            if rec.state not in RESUMABLE_STATES:
                raise UserError(f"job {rec.id} is {rec.state}; only failed, cancelled or interrupted jobs resume")
            job_dir = self.job_dir(rec.id)
            try:
                spec = JobSpec.read(job_dir)
            except (OSError, ValueError) as e:
                raise UserError(f"cannot resume {rec.id}: its job.json is unreadable ({e})") from None
            missing = [g for g in spec.gpus if g not in {x.index for x in self.machine.gpus}]
            if missing:
                raise UserError(f"cannot resume {rec.id}: GPU {missing[0]} is no longer on this machine")
            recovery.refuse_faulty_gpus(rec, gpu_faults(self._backend))
            check_env(env or {})
            given_shown, given_hidden = job_secrets.split(dict(env or {}))
            spec.env = {**spec.env, **given_shown}
            known = {**self._secrets.get(rec.id, {}), **given_hidden}
            hidden = job_secrets.find_secrets(
                job_secrets.masked_names(spec.env), known, f"rigpilot resume {rec.id} --env NAME=VALUE"
            )
            if spec.kind == "train":
                self._check_resume_room(rec, job_dir)
            spec.resume = True
            try:
                _write_spec(spec, job_dir)
            except OSError as e:
                if is_disk_full(e):
                    raise disk_full(job_dir, None) from None
                raise
            self._secrets[rec.id] = hidden
            self.store.update(
                rec, state=QUEUED, seq=self.store.next_seq(), run=rec.run + 1, cancel_requested=False, started=None,
                ended=None, exit_reason=None, exit_code=None, failed_rank=None, last_log=[], error=None,
                resumable=False, launcher_pid=None, launcher_start=None,
            )
            self._queue_dirty = True
            view = self.view(rec)
        view["resumes_from"] = newest_checkpoint(job_dir) if spec.kind == "train" else None
        self._on_job(view)
        self._wake.set()
        return view

    def _check_resume_room(self, rec: JobRecord, job_dir: Path) -> None:
        """A training job resumes only where its next checkpoint fits: about the size of its newest one."""
        newest = newest_checkpoint(job_dir)
        error = rec.error if isinstance(rec.error, dict) else {}
        needed = folder_bytes(job_dir / "checkpoints" / newest["name"]) if newest else error.get("needed_bytes")
        if isinstance(needed, int) and needed > 0:
            check_room(job_dir / "checkpoints", needed, "for its next checkpoint")

    def delete(self, ref: str) -> dict[str, Any]:
        with self._lock:
            rec = self.resolve(ref)
            if rec.state in ACTIVE_STATES:
                raise UserError(f"job {rec.id} is {rec.state}; cancel it before deleting it")
            try:
                self.store.delete(rec.id)
            except DiskFull:
                # Deleting is how a user makes room: the folder goes first, and gives the database room to shrink.
                shutil.rmtree(self.job_dir(rec.id), ignore_errors=True)
                self.store.delete(rec.id)
            self._secrets.pop(rec.id, None)
            self._queue_dirty = True
        shutil.rmtree(self.job_dir(rec.id), ignore_errors=True)
        self._on_job({"id": rec.id, "state": "deleted"})
        return {"id": rec.id, "deleted": True}

    def rename(self, ref: str, name: str) -> dict[str, Any]:
        name = check_name(name)
        with self._lock:
            rec = self.resolve(ref)
            other = self.store.get(name)
            if other is not None and other.id != rec.id:
                # `job` references try ids before names: this name could never reach its job.
                raise UserError(f"{name!r} is the id of another job; choose another name")
            self.store.update(rec, name=name)
            view = self.view(rec)
        self._on_job(view)
        return view

    def tag_study(self, job_id: str, study_id: str) -> None:
        """Mark a job as one run of a scaling study (engine.jobs.scaling). Under the lock, so the live
        record a running job holds and its row agree; clients hear of it as of any change."""
        with self._lock:
            rec = self.resolve(job_id)
            self.store.update(rec, study=study_id)
            view = self.view(rec)
        self._on_job(view)

    def jobs(self, states: list[str] | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        with self._lock:
            recs = self.store.list(set(states) if states else None, limit)
            return [self.view(r, detail=False) for r in recs]

    def detail(self, ref: str) -> dict[str, Any]:
        with self._lock:
            d = self.view(self.resolve(ref))
        # Small files, read outside the lock: what the job was asked to do and what it left behind.
        job_dir = self.job_dir(d["id"])
        d["settings"] = job_settings(job_dir)
        d["output"] = describe_output(job_dir)
        return d

    def resolve(self, ref: str) -> JobRecord:
        matches = self.store.find(ref)
        if not matches:
            raise JobNotFound(f"no job {ref!r} (see 'rigpilot jobs')")
        if len(matches) > 1:
            ids = ", ".join(m.id for m in matches[:5])
            raise UserError(f"{ref!r} could mean several jobs ({ids}); give more of the id", reason="job_ambiguous",
                            ref=ref, jobs=[m.id for m in matches[:5]])  # fmt: skip
        run = self._runs.get(matches[0].id)
        return run.rec if run else matches[0]  # the live record carries fields not yet re-read

    def job_dir(self, job_id: str) -> Path:
        return self.jobs_root / job_id

    def view(self, rec: JobRecord, *, detail: bool = True) -> dict[str, Any]:
        """A job as clients see it: the record, progress, and predictions beside measurements."""
        return job_view(rec, self._runs, self.job_dir(rec.id), detail=detail)

    def _new_id(self) -> str:
        while True:
            job_id = secrets.token_hex(3)
            if not job_id.isdigit() and self.store.get(job_id) is None and not self.job_dir(job_id).exists():
                return job_id  # all-digit ids would read like GPU indices or counts

    # -- scheduling -----------------------------------------------------------

    def _schedule(self) -> None:
        self._queue_dirty = False
        for rec in launching.due(self.store.list({QUEUED}), self._runs):
            if rec.slurm is not None:
                self._launch_slurm(rec)
            else:
                self._launch(rec)

    def _launch(self, rec: JobRecord) -> None:
        job_dir = self.job_dir(rec.id)
        try:
            launcher_log = launching.open_launcher_log(job_dir)
        except OSError as e:
            if not is_disk_full(e):
                raise
            self._end_for_room(rec, job_dir)
            return
        try:
            self._start(rec, job_dir, launcher_log)
        except OSError as e:
            launcher_log.close()
            if not is_disk_full(e):
                raise
            self._end_for_room(rec, job_dir)

    def _start(self, rec: JobRecord, job_dir: Path, launcher_log: IO[bytes]) -> None:
        try:
            spec = JobSpec.read(job_dir)
        except (OSError, ValueError) as e:
            launcher_log.close()
            self._end_without_run(rec, f"job.json is unreadable: {e}")
            return
        try:
            python = worker_python()
            hidden = job_secrets.find_secrets(
                job_secrets.masked_names(spec.env), self._secrets.get(rec.id, {}),
                f"rigpilot resume {rec.id} --env NAME=VALUE",
            )  # fmt: skip
        except UserError as e:
            launcher_log.close()
            self._end_without_run(rec, str(e))
            return
        self.warm_tending.make_way()
        port = launching.free_port()
        cmd = launching.command(rec, spec, job_dir, port, python, self.options.monitor_interval_s)
        env = self._environment(rec, spec, job_dir, python)
        env.update(hidden)
        launcher_log.write(f"--- run {rec.run}: {' '.join(cmd)}\n".encode())
        launcher_log.flush()
        try:
            popen = launching.popen_launcher(rec, job_dir, cmd, env, launcher_log, self.options.job_niceness)
        except OSError as e:
            launcher_log.close()
            self._end_without_run(rec, f"cannot start torchrun: {e}")
            return
        self.store.update(
            rec, state=STARTING, started=time.time(), ended=None, launcher_pid=popen.pid,
            launcher_start=launching.started_at(popen), port=port,
        )  # fmt: skip
        run = Run(rec, job_dir, popen, launcher_log, energy=energy.new_meter(rec, self._telemetry),
                  tensorboard=tensorboard.for_run(spec, job_dir, rec.gpus))  # fmt: skip
        # A resumed job appends to its metric files; the summary carries on from the last run.
        run.summary, run.cursor = summarize(job_dir / "metrics", max_steps_of(spec))
        run.summary.phase = None  # the last run's final phase is not this run's
        self._runs[rec.id] = run
        apply_load(self._simulated_backend, run)
        self._on_job(self.view(rec))

    def _launch_slurm(self, rec: JobRecord) -> None:
        job_dir = self.job_dir(rec.id)
        launching.fresh_ranks_folder(job_dir)
        try:
            self.store.update(rec, **slurm.start(self, rec, JobSpec.read(job_dir), job_dir))
        except (OSError, ValueError, UserError) as e:
            self._end_without_run(rec, str(e))
            return
        self._runs[rec.id] = slurm.adopt(self, rec)
        self._on_job(self.view(rec))

    def _environment(self, rec: JobRecord, spec: JobSpec, job_dir: Path, python: str) -> dict[str, str]:
        """The environment of a run's launcher and ranks, less the job's secrets (engine.jobs.launching)."""
        return launching.environment(rec, spec, job_dir, python, self.warm_tending)

    def _end_without_run(self, rec: JobRecord, reason: str, error: dict[str, Any] | None = None) -> None:
        self.store.update(rec, state=FAILED, ended=time.time(), exit_reason=reason, resumable=True, error=error)
        self._on_job(self.view(rec))

    def _end_for_room(self, rec: JobRecord, job_dir: Path) -> None:
        """A queued job whose folder could not be written: failed on a full disk, to start again once there is room."""
        full = disk_full(job_dir)
        error = {"error": "disk_full", "message": full.line(), **full.fields}
        reason = full.line()
        if recovery.waits_for_space(JobRecord(**{**rec.to_dict(), "state": FAILED, "error": error, "resumable": True})):
            reason += "; it starts by itself once there is room, or resume it"
        self._end_without_run(rec, reason, error)

    # -- watching -------------------------------------------------------------

    def _poll(self, run: Run) -> None:
        rec = run.rec
        if rec.slurm is not None:
            slurm.poll(self, run)
            return
        self._read_metrics(run)
        self._read_ranks(run)
        if rec.state == STARTING and following.has_started(run):
            self.store.update(rec, state=RUNNING)
            run.dirty = True
            run.last_publish = 0.0  # a state change goes out now; progress alone at most once a second
        apply_load(self._simulated_backend, run)
        if run.energy is not None:
            energy.catch_up(run.energy, self._telemetry, now=time.monotonic())
        if run.tensorboard is not None:
            run.tensorboard.catch_up_telemetry(self._telemetry, time.monotonic())
        if not processes.launcher_alive(run):
            if run.launcher_ended is None:
                run.launcher_ended = time.monotonic()
            if self.finish_ready(rec, time.monotonic() - run.launcher_ended):
                self._finish(run)
            return
        if run.kill_at is not None and time.monotonic() >= run.kill_at and not run.killed:
            log.warning("job %s: still running after the grace period; killing it", rec.id)
            run.killed = True
            processes.kill(run)
        now = time.monotonic()
        if run.dirty and now - run.last_publish >= 1.0:
            run.dirty = False
            run.last_publish = now
            self._on_job(self.view(rec, detail=False))

    def _read_metrics(self, run: Run) -> None:
        if following.read_metrics(run):
            self._on_metrics(run.rec.id)

    def _read_ranks(self, run: Run) -> None:
        following.read_ranks(run, self.options.failure_grace_s)

    # -- stopping -------------------------------------------------------------

    def stop_run(self, job_id: str) -> bool:
        """Stop a running job because another node of it failed (the finish hook gives the reason)."""
        with self._lock:
            run = self._runs.get(job_id)
            if run is None or run.stop_reason is not None:
                return False
            run.stop_reason = "node_failed"
            run.kill_at = time.monotonic() + self.options.failure_grace_s
            processes.signal_launcher(run, signal.SIGTERM)
        self._wake.set()
        return True

    def _finish(self, run: Run) -> None:
        rec = run.rec
        rc = run.popen.returncode if run.popen is not None else None
        if run.launcher_log:
            run.launcher_log.close()
        self._read_metrics(run)
        self._read_ranks(run)
        left = processes.sweep(run)
        outcome = self.finish_hook(rec, run_outcome(run, rc))
        if left:
            outcome["exit_reason"] = f"{outcome['exit_reason'] or 'ended'}; {len(left)} leftover process(es) had to be killed"
        clear_load(self._simulated_backend, rec)
        measured = run.summary.to_dict(time.time())
        outcome = recovery.after_failure(
            rec, outcome, run.summary.errors, run.job_dir, lambda: gpu_faults(self._backend),
            simulated=rec.simulated, max_cpu_ranks=self.max_cpu_ranks,
            from_step=(newest_checkpoint(run.job_dir) or {}).get("step") if rec.kind == "train" else None,
        )  # fmt: skip
        ended = time.time()
        spent = energy.finish(rec, run.energy, self._telemetry, ended)
        tensorboard.finish(run.tensorboard, self._telemetry)
        self.store.update(rec, **{"ended": ended, "measured": measured, "energy": spent, **outcome})
        del self._runs[rec.id]
        self._queue_dirty = True
        self._on_metrics(rec.id)
        self._on_job(self.view(rec))

    # -- restart --------------------------------------------------------------

    def _recover(self) -> None:
        """After a restart: re-adopt jobs whose launcher still runs; settle the others."""
        for rec in self.store.list(ACTIVE_STATES):
            if rec.slurm is not None:  # runs on without this service: follow it again
                self._runs[rec.id] = slurm.adopt(self, rec)
                continue
            job_dir = self.job_dir(rec.id)
            try:
                spec: JobSpec | None = JobSpec.read(job_dir)
            except (OSError, ValueError):
                spec = None
            max_steps = max_steps_of(spec) if spec is not None else None
            run = Run(rec, job_dir, None, energy=energy.new_meter(rec, self._telemetry),
                      tensorboard=tensorboard.for_run(spec, job_dir, rec.gpus))  # fmt: skip
            if run.tensorboard is not None:
                run.tensorboard.catch_up()
            run.summary, run.cursor = summarize(job_dir / "metrics", max_steps)
            if rec.cancel_requested:
                run.stop_reason = "cancel"
                run.kill_at = time.monotonic() + self.options.grace_s
            if processes.alive(rec.launcher_pid, rec.launcher_start):
                log.info("re-adopting job %s (launcher pid %s)", rec.id, rec.launcher_pid)
                self._runs[rec.id] = run
                continue
            self._read_ranks(run)
            processes.sweep(run)
            outcome = self.finish_hook(rec, run_outcome(run, None, service_was_down=True))
            clear_load(self._simulated_backend, rec)
            ended = time.time()
            spent = energy.finish(rec, run.energy, self._telemetry, ended)
            tensorboard.finish(run.tensorboard, self._telemetry)
            self.store.update(rec, ended=ended, measured=run.summary.to_dict(), energy=spent, **outcome)
        self._queue_dirty = True


# -- small helpers ------------------------------------------------------------


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _default_name(spec: JobSpec) -> str:
    if spec.kind == "script" and spec.script:
        return Path(spec.script[0]).name
    if spec.model:
        model = Path(spec.model)
        if spec.model.startswith("/"):  # a folder, or a config.json named after its folder
            model = model.parent if model.suffix == ".json" else model
        name = model.name if spec.model.startswith("/") else spec.model
        # A served model's job name is its name in requests (engine.workers.serve.served_name): "tiny", not
        # "serve tiny", which a client would have to quote with its space.
        return name if spec.kind == "serve" else f"{spec.kind} {name}"
    return spec.kind


def _write_json_atomic(path: Path, data: Any) -> None:
    import json

    paths.write_private(path, json.dumps(data, indent=2))


def _write_spec(spec: JobSpec, job_dir: Path) -> None:
    spec.write(job_dir)
    with contextlib.suppress(OSError):
        os.chmod(job_dir / "job.json", 0o600)  # spec.write follows the umask; the engine's own is 077 anyway
