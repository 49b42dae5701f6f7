"""Running jobs: the queue, launching through torchrun, watching, tearing down, re-adopting.

Each job runs as `python -m torch.distributed.run ... -m rigpilot.engine.launch.rankexec
JOB_DIR -- COMMAND` in a session of its own, one rank per GPU (CPU ranks on
simulated machines). torchrun starts every rank in a session of its own too,
so the service finds a job's processes through what the ranks record
(`ranks/rank<N>.json`) and an environment marker every process of the job
inherits (`RIGPILOT_RUN_TOKEN`), not through one process group.

Lifecycle: queued → starting → running (first step reported) → completed |
failed | cancelled, or interrupted when the service was gone while the job's
processes died. A queued job starts once none of its GPUs is used by a running
job or wanted by a job queued before it, so a big job is never starved by a
stream of small ones.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from rigpilot.engine import paths
from rigpilot.engine.diskspace import DiskFull, check_room, disk_full, folder_bytes, free_bytes, is_disk_full
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.health import gpu_faults
from rigpilot.engine.hardware.machine import Machine
from rigpilot.engine.hardware.simulated import Load, SimulatedBackend
from rigpilot.engine.jobs import energy, recovery, slurm, submission
from rigpilot.engine.jobs import secrets as job_secrets
from rigpilot.engine.jobs.conditions import Conditions
from rigpilot.engine.jobs.limits import check_env
from rigpilot.engine.jobs.metrics import read_records, summarize
from rigpilot.engine.jobs.results import check_name, describe_output, job_settings
from rigpilot.engine.jobs.runs import (
    Run,
    clean_exit,
    max_steps_of,
    newest_checkpoint,
    run_outcome,
    run_token,
)
from rigpilot.engine.jobs.spec import JobSpec
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
from rigpilot.engine.launch import warm
from rigpilot.engine.launch.torchrun import rank_environment, rank_target, torchrun_command
from rigpilot.engine.runtime import worker_python

log = logging.getLogger(__name__)

RUN_TOKEN_ENV = "RIGPILOT_RUN_TOKEN"
_TRAINING_UTILIZATION = 90.0
_STARTING_UTILIZATION = 15.0  # loading a model keeps a GPU mostly idle
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


def on_vllm(spec: JobSpec) -> bool:
    """An inference job the submission gave to vLLM: one process, which starts a worker per GPU itself."""
    return spec.kind == "infer" and spec.infer is not None and spec.infer.backend == "vllm"


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
        # Secret env values by job id, never written to disk (engine.jobs.secrets); gone when the engine stops.
        self._secrets: dict[str, dict[str, str]] = {}
        # engine.service.multinode: may rewrite how a job spanning several engines ended (naming the node).
        self.finish_hook: Callable[[JobRecord, dict[str, Any]], dict[str, Any]] = lambda rec, outcome: outcome
        # Whether a job whose launcher here has exited may be ended now, given the seconds since (a multi-node
        # head waits for its other nodes' last records: engine.service.multinode).
        self.finish_ready: Callable[[JobRecord, float], bool] = lambda rec, waited_s: True
        self.warm: warm.WarmWorker | None = None  # made when first started
        # Not in the engine's first seconds, while the app that started it may still be drawing its first frames.
        self._warm_check_at = time.monotonic() + 2.0
        self._warm_retry_at = 0.0
        self._warm_failures = 0
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
            if self.warm is not None:
                self.warm.stop()

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

    def _tend_warm(self) -> None:
        """Start the warm worker when the engine is idle and memory allows; stop it when memory runs short.

        Idle: no job running, starting or queued, so its imports (seconds of CPU) never compete with a
        job. Memory allows: at least warm.MIN_AVAILABLE_BYTES available (it holds about 0.5-1 GiB).
        """
        now = time.monotonic()
        if not (self.options.warm_worker and warm.enabled()) or now < self._warm_check_at:
            return
        self._warm_check_at = now + 1.0
        if self.warm is None:
            self.warm = warm.WarmWorker(paths.runtime_dir(), self.jobs_root.parent / "warm-worker.log")
        w = self.warm
        if w.running():
            if not warm.memory_allows(int(psutil.virtual_memory().available * 2)):
                log.info("warm worker stopped: memory is short")
                w.stop()
            elif w.ready():
                self._warm_failures = 0
            return
        if w.popen is not None and w.popen.returncode == 0:
            w.popen = None  # it retired (the engine environment changed): a fresh one when idle
        elif w.popen is not None:  # it failed or was killed: try again later, less and less often
            self._warm_failures += 1
            self._warm_retry_at = now + min(30.0 * 2**self._warm_failures, 3600.0)
            log.warning("warm worker exited with %s; see %s", w.popen.returncode, w.log_path)
            w.popen = None
        if now < self._warm_retry_at or self._runs or self.store.list({QUEUED}) or not warm.memory_allows():
            return
        try:
            python = worker_python()
        except UserError:
            return
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        w.start(python, env)

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
                    f"the machine cannot change while jobs use it: {names}; let them finish or cancel them first"
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
            nodes=nodes, slurm=slurm_options is not None,
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
            nodes=int((nodes or {}).get("count", 1)), slurm=slurm_options is not None,
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
        hidden = self._find_secrets(job_secrets.masked_names(spec.env), hidden, "rigpilot run --env NAME=VALUE")
        job_dir = self.job_dir(job_id)
        rec = JobRecord(
            id=job_id, seq=self.store.next_seq(), kind=spec.kind, name=spec.name, state=QUEUED, gpus=spec.gpus,
            ranks=sub.ranks, simulated=spec.simulated, created=time.time(), cwd=sub.cwd, predicted=sub.predicted,
            slurm=slurm_options,
            # A multi-node job is restarted by nobody yet: one node's engine alone would relaunch its own
            # part into a rendezvous the others have left.
            max_restarts=0 if nodes else recovery.max_restarts_of(spec),
            nodes=nodes,
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
                if not _trained_every_step(rec, run):
                    run.kill_at = time.monotonic() + self.options.grace_s
                    # torchrun passes SIGTERM on to every rank's process group and waits for them,
                    # so workers get their chance to checkpoint before the grace period ends.
                    self._signal_launcher(run, signal.SIGTERM)
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
            hidden = self._find_secrets(
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
            raise UserError(f"{ref!r} could mean several jobs ({ids}); give more of the id")
        run = self._runs.get(matches[0].id)
        return run.rec if run else matches[0]  # the live record carries fields not yet re-read

    def job_dir(self, job_id: str) -> Path:
        return self.jobs_root / job_id

    def view(self, rec: JobRecord, *, detail: bool = True) -> dict[str, Any]:
        """A job as clients see it: the record, progress, and predictions beside measurements."""
        run = self._runs.get(rec.id)
        d = rec.to_dict()
        d["job_dir"] = str(self.job_dir(rec.id))
        progress = run.summary.to_dict(time.time()) if run else (rec.measured or None)
        d["progress"] = progress
        d["energy"] = energy.job_energy(rec, run.energy if run else None, time.time())
        d["energy_cost"] = energy.cost(d["energy"], progress, energy.electricity_price())
        d["wall_s"] = _wall_s(rec, d["energy"], time.time())
        if rec.state == QUEUED:
            d["waiting_for"] = self._waiting_for(rec)
        if rec.state == STARTING and rec.slurm is None:
            d["startup_phase"] = startup_phase(run.summary.phase if run else None)
        if detail:
            d["comparison"] = _compare(rec.predicted, progress)
        return d

    def _waiting_for(self, rec: JobRecord) -> list[int]:
        busy = {g for r in self._runs.values() if r.rec.slurm is None for g in r.rec.gpus}
        return sorted(busy & set(rec.gpus))

    def _new_id(self) -> str:
        while True:
            job_id = secrets.token_hex(3)
            if not job_id.isdigit() and self.store.get(job_id) is None and not self.job_dir(job_id).exists():
                return job_id  # all-digit ids would read like GPU indices or counts

    # -- scheduling -----------------------------------------------------------

    def _schedule(self) -> None:
        self._queue_dirty = False
        busy = {g for r in self._runs.values() if r.rec.slurm is None for g in r.rec.gpus}
        reserved: set[int] = set()
        for rec in sorted(self.store.list({QUEUED}), key=lambda r: r.seq):
            if rec.slurm is not None:  # SLURM's queue decides where and when it runs, not this machine's GPUs
                self._launch_slurm(rec)
                continue
            want = set(rec.gpus)
            if want & (busy | reserved):
                reserved |= want  # later jobs may not take GPUs an earlier job waits for
                continue
            self._launch(rec)
            busy |= want

    def _launch(self, rec: JobRecord) -> None:
        job_dir = self.job_dir(rec.id)
        try:
            shutil.rmtree(job_dir / "ranks", ignore_errors=True)
            (job_dir / "ranks").mkdir(parents=True, exist_ok=True)
            (job_dir / "logs").mkdir(parents=True, exist_ok=True)
            launcher_log = paths.open_private(job_dir / "logs" / "launcher.log", "ab")
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

    def _start(self, rec: JobRecord, job_dir: Path, launcher_log: Any) -> None:
        try:
            spec = JobSpec.read(job_dir)
        except (OSError, ValueError) as e:
            launcher_log.close()
            self._end_without_run(rec, f"job.json is unreadable: {e}")
            return
        try:
            python = worker_python()
        except UserError as e:
            launcher_log.close()
            self._end_without_run(rec, str(e))
            return
        try:
            hidden = self._find_secrets(
                job_secrets.masked_names(spec.env), self._secrets.get(rec.id, {}),
                f"rigpilot resume {rec.id} --env NAME=VALUE",
            )  # fmt: skip
        except UserError as e:
            launcher_log.close()
            self._end_without_run(rec, str(e))
            return
        if self.warm is not None and self.warm.running() and not self.warm.ready():
            self.warm.stop()  # still importing: it would take the CPU this job's ranks need to start
        port = _free_port()
        cmd = self._command(rec, spec, job_dir, port, python)
        env = self._environment(rec, spec, job_dir, python)
        env.update(hidden)
        launcher_log.write(f"--- run {rec.run}: {' '.join(cmd)}\n".encode())
        launcher_log.flush()
        cwd = rec.cwd if rec.kind == "script" and rec.cwd and Path(rec.cwd).is_dir() else str(job_dir)
        try:
            popen = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=launcher_log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as e:
            launcher_log.close()
            self._end_without_run(rec, f"cannot start torchrun: {e}")
            return
        try:
            started_at = psutil.Process(popen.pid).create_time()
        except psutil.Error:
            started_at = None
        self.store.update(
            rec, state=STARTING, started=time.time(), ended=None, launcher_pid=popen.pid, launcher_start=started_at,
            port=port,
        )
        run = Run(rec, job_dir, popen, launcher_log, energy=energy.new_meter(rec, self._telemetry))
        # A resumed job appends to its metric files; the summary carries on from the last run.
        run.summary, run.cursor = summarize(job_dir / "metrics", max_steps_of(spec))
        run.summary.phase = None  # the last run's final phase is not this run's
        self._runs[rec.id] = run
        self._apply_load(run)
        self._on_job(self.view(rec))

    def _launch_slurm(self, rec: JobRecord) -> None:
        job_dir = self.job_dir(rec.id)
        shutil.rmtree(job_dir / "ranks", ignore_errors=True)
        (job_dir / "ranks").mkdir(parents=True, exist_ok=True)
        try:
            self.store.update(rec, **slurm.start(self, rec, JobSpec.read(job_dir), job_dir))
        except (OSError, ValueError, UserError) as e:
            self._end_without_run(rec, str(e))
            return
        self._runs[rec.id] = slurm.adopt(self, rec)
        self._on_job(self.view(rec))

    def _command(self, rec: JobRecord, spec: JobSpec, job_dir: Path, port: int, python: str) -> list[str]:
        return torchrun_command(
            python=python, job_id=rec.id, run=rec.run, ranks_per_node=1 if on_vllm(spec) else rec.ranks,
            nodes=rec.nodes or {}, port=port, monitor_interval_s=self.options.monitor_interval_s, job_dir=job_dir,
            target=rank_target(python, job_dir, spec.script if rec.kind == "script" else None),
        )

    def _environment(self, rec: JobRecord, spec: JobSpec, job_dir: Path, python: str) -> dict[str, str]:
        base = {**os.environ, **job_secrets.plain(spec.env)}  # the caller adds the secrets
        env = rank_environment(base, job_id=rec.id, job_dir=job_dir, run=rec.run, gpus=rec.gpus, ranks=rec.ranks,
                               simulated=rec.simulated)
        env[RUN_TOKEN_ENV] = run_token(rec)
        env.pop(warm.SOCKET_ENV, None)
        # vLLM starts its own workers and imports far more than a warm worker holds: a fresh interpreter.
        warm_fits = rec.kind != "script" and not on_vllm(spec)
        if warm_fits and self.warm is not None and self.warm.ready() and self.warm.python == python:
            env[warm.SOCKET_ENV] = str(self.warm.socket_path)
        return env

    def _find_secrets(self, names: list[str], known: dict[str, str], how: str) -> dict[str, str]:
        """The values of the masked `names`: from `known` (memory, or given now), else the user's secrets file."""
        found = {n: known[n] for n in names if n in known}
        lacking = [n for n in names if n not in found]
        if lacking:
            try:
                from_file = job_secrets.read_secrets_file()
            except ValueError as e:
                raise UserError(f"secrets file refused: {e}") from None
            found.update({n: from_file[n] for n in lacking if n in from_file})
            lacking = [n for n in lacking if n not in found]
        if lacking:
            names_text = ", ".join(lacking)
            raise UserError(
                f"the job needs {names_text} again (secrets are kept in the engine's memory only, not on disk): "
                f"{how}, or keep them in {job_secrets.secrets_file()} (chmod 600)"
            )
        return found

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
        if rec.state == STARTING and self._has_started(run):
            self.store.update(rec, state=RUNNING)
            run.dirty = True
            run.last_publish = 0.0  # a state change goes out now; progress alone at most once a second
        self._apply_load(run)
        if run.energy is not None:
            energy.catch_up(run.energy, self._telemetry, now=time.monotonic())
        if not self._launcher_alive(run):
            if run.launcher_ended is None:
                run.launcher_ended = time.monotonic()
            if self.finish_ready(rec, time.monotonic() - run.launcher_ended):
                self._finish(run)
            return
        if run.kill_at is not None and time.monotonic() >= run.kill_at and not run.killed:
            log.warning("job %s: still running after the grace period; killing it", rec.id)
            run.killed = True
            self._kill(run)
        now = time.monotonic()
        if run.dirty and now - run.last_publish >= 1.0:
            run.dirty = False
            run.last_publish = now
            self._on_job(self.view(rec, detail=False))

    def _read_metrics(self, run: Run) -> None:
        got = False
        while True:
            records, run.cursor, more = read_records(run.job_dir / "metrics", run.cursor)
            for r in records:
                run.summary.add(r)
                run.stepped = run.stepped or (r.get("kind") is None and r.get("step") is not None)
            got = got or bool(records)
            if not more:
                break
        if got:
            run.dirty = True
            self._on_metrics(run.rec.id)

    def _read_ranks(self, run: Run) -> None:
        for f in (run.job_dir / "ranks").glob("rank*.json"):
            try:
                state = _read_json(f)
                rank = int(state["rank"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # written atomically, so this is a foreign file; ignore it
            run.ranks[rank] = state
            ex = state.get("exit")
            if ex and run.stop_reason is None and not clean_exit(ex):
                run.stop_reason = "rank_failed"
                # torchrun notices within its monitor interval and stops the other ranks itself;
                # this bounds how long that may take when a rank hangs in a collective.
                run.kill_at = time.monotonic() + self.options.failure_grace_s

    def _has_started(self, run: Run) -> bool:
        if run.stepped:
            return True
        # A script need not report steps; it runs once every rank has started it.
        if run.rec.kind == "script":
            if run.summary.records:
                return True
            started = [r for r in run.ranks.values() if "child_pid" in r or "exit" in r]
            return len(started) >= run.rec.ranks
        return False

    def _apply_load(self, run: Run) -> None:
        """Make the simulated GPUs show the job: busy while it runs, holding its memory."""
        backend = self._simulated_backend
        if backend is None or not run.rec.simulated:
            return
        rec = run.rec
        util = _TRAINING_UTILIZATION if rec.state == RUNNING else _STARTING_UTILIZATION
        predicted = (rec.predicted or {}).get("peak_memory_bytes")
        for i, gpu in enumerate(rec.gpus):
            rank = i % max(rec.ranks, 1)
            memory = run.summary.peak_memory.get(rank) or predicted or 0
            pid = run.ranks.get(rank, {}).get("child_pid") or rec.launcher_pid
            load = Load(
                utilization=util, memory_bytes=int(memory), comm_fraction=0.15 if len(rec.gpus) > 1 else 0.0,
                pid=pid, command=f"rigpilot {rec.kind} {rec.name} (rank {rank})",
            )
            with contextlib.suppress(KeyError):
                backend.set_load(gpu, rec.id, load)

    def _clear_load(self, rec: JobRecord) -> None:
        if self._simulated_backend is None:
            return
        for gpu in rec.gpus:
            with contextlib.suppress(KeyError):
                self._simulated_backend.set_load(gpu, rec.id, None)

    def _launcher_alive(self, run: Run) -> bool:
        if run.popen is not None:
            return run.popen.poll() is None
        return _alive(run.rec.launcher_pid, run.rec.launcher_start)

    # -- stopping -------------------------------------------------------------

    def stop_run(self, job_id: str) -> bool:
        """Stop a running job because another node of it failed (the finish hook gives the reason)."""
        with self._lock:
            run = self._runs.get(job_id)
            if run is None or run.stop_reason is not None:
                return False
            run.stop_reason = "node_failed"
            run.kill_at = time.monotonic() + self.options.failure_grace_s
            self._signal_launcher(run, signal.SIGTERM)
        self._wake.set()
        return True

    def _signal_launcher(self, run: Run, sig: signal.Signals) -> None:
        rec = run.rec
        if run.popen is not None and run.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(run.popen.pid, sig)  # torchrun leads its own session
        elif run.popen is None and _alive(rec.launcher_pid, rec.launcher_start):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(rec.launcher_pid, sig)  # type: ignore[arg-type]

    def _kill(self, run: Run) -> None:
        """SIGKILL every process of the job: the launcher, each rank's group, and stragglers."""
        self._signal_launcher(run, signal.SIGKILL)
        for state in run.ranks.values():
            pgid = state.get("pgid")
            if isinstance(pgid, int) and _alive(state.get("pid"), state.get("create_time")):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
        for p in job_processes(run.token):
            with contextlib.suppress(psutil.Error):
                p.kill()

    def _finish(self, run: Run) -> None:
        rec = run.rec
        rc = run.popen.returncode if run.popen is not None else None
        if run.launcher_log:
            run.launcher_log.close()
        self._read_metrics(run)
        self._read_ranks(run)
        left = self._sweep(run)
        outcome = self.finish_hook(rec, run_outcome(run, rc))
        if left:
            outcome["exit_reason"] = f"{outcome['exit_reason'] or 'ended'}; {len(left)} leftover process(es) had to be killed"
        self._clear_load(rec)
        measured = run.summary.to_dict(time.time())
        outcome = recovery.after_failure(
            rec, outcome, run.summary.errors, run.job_dir, lambda: gpu_faults(self._backend),
            simulated=rec.simulated, max_cpu_ranks=self.max_cpu_ranks,
            from_step=(newest_checkpoint(run.job_dir) or {}).get("step") if rec.kind == "train" else None,
        )  # fmt: skip
        ended = time.time()
        spent = energy.finish(rec, run.energy, self._telemetry, ended)
        self.store.update(rec, **{"ended": ended, "measured": measured, "energy": spent, **outcome})
        del self._runs[rec.id]
        self._queue_dirty = True
        self._on_metrics(rec.id)
        self._on_job(self.view(rec))

    def _sweep(self, run: Run, timeout: float = 5.0) -> list[int]:
        """Kill whatever of the job outlived its launcher; return their pids, after they are gone."""
        procs = job_processes(run.token)
        for state in run.ranks.values():
            for key in ("pid", "child_pid"):
                pid = state.get(key)
                if isinstance(pid, int) and pid not in {p.pid for p in procs} and _alive(pid, None, run.token):
                    with contextlib.suppress(psutil.Error):
                        procs.append(psutil.Process(pid))
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        _, alive = psutil.wait_procs(procs, timeout=timeout)
        if alive:
            log.error("job %s: processes %s survived SIGKILL", run.rec.id, [p.pid for p in alive])
        return [p.pid for p in procs]

    # -- restart --------------------------------------------------------------

    def _recover(self) -> None:
        """After a restart: re-adopt jobs whose launcher still runs; settle the others."""
        for rec in self.store.list(ACTIVE_STATES):
            if rec.slurm is not None:  # runs on without this service: follow it again
                self._runs[rec.id] = slurm.adopt(self, rec)
                continue
            job_dir = self.job_dir(rec.id)
            try:
                max_steps = max_steps_of(JobSpec.read(job_dir))
            except (OSError, ValueError):
                max_steps = None
            run = Run(rec, job_dir, None, energy=energy.new_meter(rec, self._telemetry))
            run.summary, run.cursor = summarize(job_dir / "metrics", max_steps)
            if rec.cancel_requested:
                run.stop_reason = "cancel"
                run.kill_at = time.monotonic() + self.options.grace_s
            if _alive(rec.launcher_pid, rec.launcher_start):
                log.info("re-adopting job %s (launcher pid %s)", rec.id, rec.launcher_pid)
                self._runs[rec.id] = run
                continue
            self._read_ranks(run)
            self._sweep(run)
            outcome = self.finish_hook(rec, run_outcome(run, None, service_was_down=True))
            self._clear_load(rec)
            ended = time.time()
            spent = energy.finish(rec, run.energy, self._telemetry, ended)
            self.store.update(rec, ended=ended, measured=run.summary.to_dict(), energy=spent, **outcome)
        self._queue_dirty = True


# -- outcome ------------------------------------------------------------------


def _compare(predicted: dict[str, Any] | None, progress: dict[str, Any] | None) -> dict[str, Any] | None:
    if not predicted:
        return None
    progress = progress or {}
    peaks = (progress.get("peak_memory_by_rank") or {}).values()
    measured = {
        "peak_memory_bytes": max(peaks) if peaks else None,
        "tokens_per_s": progress.get("tokens_per_s"),
        "step_time_s": 1 / progress["steps_per_s"] if progress.get("steps_per_s") else None,
    }
    return {k: {"predicted": predicted.get(k), "measured": v} for k, v in measured.items()}


def startup_phase(phase: str | None) -> str:
    """What a starting job is doing, from the latest status its ranks reported (engine.workers)."""
    if phase is None:
        return "launching"  # torchrun starting, ranks meeting, interpreters starting
    if phase == "importing":
        return "importing"
    if phase == "loading model":
        return "loading weights"
    return "first step"


# -- processes ----------------------------------------------------------------


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


def _alive(pid: Any, create_time: Any, token: str | None = None) -> bool:
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


# -- small helpers ------------------------------------------------------------


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _trained_every_step(rec: JobRecord, run: Run) -> bool:
    """A training job whose ranks reported its last step: what is left (the final checkpoint, the evaluation,
    the model) finishes the job, and a cancel now would only cut that short."""
    max_steps = run.summary.max_steps
    return rec.kind == "train" and run.stepped and max_steps is not None and max_steps > 0 and (run.summary.step or 0) >= max_steps


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wall_s(rec: JobRecord, spent: dict[str, Any] | None, now: float) -> float | None:
    """Seconds the job has run, over all its runs. `started` is the last run's start; the energy record
    times every run from its start to its end (the one running now included)."""
    runs = (spent or {}).get("runs") or []
    if rec.run > 1 and len(runs) == rec.run and all(isinstance(r.get("seconds"), int | float) for r in runs):
        return float(sum(r["seconds"] for r in runs))
    if rec.started is None:
        return None
    return max((rec.ended or now) - rec.started, 0.0)


def _default_name(spec: JobSpec) -> str:
    if spec.kind == "script" and spec.script:
        return Path(spec.script[0]).name
    if spec.model:
        model = Path(spec.model)
        if spec.model.startswith("/"):  # a folder, or a config.json named after its folder
            model = model.parent if model.suffix == ".json" else model
        return f"{spec.kind} {model.name if spec.model.startswith('/') else spec.model}"
    return spec.kind


def _read_json(path: Path) -> Any:
    import json

    return json.loads(path.read_text())


def _write_json_atomic(path: Path, data: Any) -> None:
    import json

    paths.write_private(path, json.dumps(data, indent=2))


def _write_spec(spec: JobSpec, job_dir: Path) -> None:
    spec.write(job_dir)
    with contextlib.suppress(OSError):
        os.chmod(job_dir / "job.json", 0o600)  # spec.write follows the umask; the engine's own is 077 anyway
