"""Jobs run by SLURM: `rigpilot run … --slurm` submits with sbatch and the supervisor follows the SLURM job.

The script submitted is the planner's export (engine.planner.export.slurm_script) with the job's own
command: one SLURM task per rank, each started through rankexec, so the ranks write their metrics,
logs and exit records into the job folder exactly as under torchrun. That folder must be on a
filesystem the SLURM nodes share with this machine (on one machine it is simply the job folder).

The SLURM commands run here where they are installed, or on a login node through `ssh LOGIN`
(BatchMode: a key or agent, never a password prompt the engine cannot answer). The queue state comes
from `squeue -t all` while slurmctld remembers the job (MinJobAge), then from SLURM's accounting:
`sacct`, or `sacct --completion` where the cluster keeps only job completion records
(JobCompType=jobcomp/filetxt, no slurmdbd).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rigpilot.engine import paths
from rigpilot.engine.errors import UserError
from rigpilot.engine.jobs import following, recovery, tensorboard
from rigpilot.engine.jobs.metrics import summarize
from rigpilot.engine.jobs.runs import Run, log_tail, max_steps_of, newest_checkpoint, run_outcome
from rigpilot.engine.jobs.store import (
    CANCELLED,
    COMPLETED,
    FAILED,
    INTERRUPTED,
    RUNNING,
    STARTING,
    TERMINAL_STATES,
    JobRecord,
    JobStore,
)
from rigpilot.engine.jobspec import secrets as job_secrets
from rigpilot.engine.jobspec.spec import JobSpec
from rigpilot.engine.launch.torchrun import rank_target, rankexec_command
from rigpilot.engine.planner.export import check_slurm_options, slurm_script
from rigpilot.engine.planner.plan import Plan
from rigpilot.engine.runtime import worker_python

if TYPE_CHECKING:
    from rigpilot.engine.jobs.submission import Submission

log = logging.getLogger(__name__)

POLL_S = 2.0  # squeue/sacct at most this often per job: slurmctld serves every user of the cluster
COMMAND_TIMEOUT_S = 30.0
LOGIN = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9_.-]*@)?[A-Za-z0-9_][A-Za-z0-9_.:-]*$")
OPTION_KEYS = ("partition", "account", "time", "login")

# SLURM's job states (squeue/sacct) and what Rigpilot calls them: None while the job waits or runs.
_WAITING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED", "STOPPED"}
_RUNNING = {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESV_DEL_HOLD"}
_ENDED = {
    "COMPLETED": COMPLETED,
    "CANCELLED": CANCELLED,
    "FAILED": FAILED,
    "OUT_OF_MEMORY": FAILED,
    "BOOT_FAIL": FAILED,
    "DEADLINE": FAILED,
    "NODE_FAIL": FAILED,
    "TIMEOUT": FAILED,
    "PREEMPTED": INTERRUPTED,
    "REVOKED": CANCELLED,
    "SPECIAL_EXIT": FAILED,
}


def rigpilot_state(slurm_state: str) -> str:
    """The Rigpilot state of a job SLURM reports in `slurm_state` (before its first step: starting)."""
    state = slurm_state.split()[0].rstrip("+").upper() if slurm_state.strip() else ""
    if state in _WAITING or state in _RUNNING:
        return STARTING
    if state in _ENDED:
        return _ENDED[state]
    raise ValueError(f"unknown SLURM job state {slurm_state!r}")


def check_options(options: dict[str, Any]) -> dict[str, str | None]:
    """The `--slurm` options of a submission, checked: partition, account, time, login (each may be None)."""
    if not isinstance(options, dict):
        raise UserError("slurm options must be an object")
    unknown = sorted(set(options) - set(OPTION_KEYS))
    if unknown:
        raise UserError(f"unknown SLURM option {unknown[0]!r}; known: {', '.join(OPTION_KEYS)}")
    out: dict[str, str | None] = {}
    for key in OPTION_KEYS:
        value = options.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise UserError(f"SLURM option {key} must be a non-empty string")
        out[key] = value
    check_slurm_options(out["partition"], out["account"], out["time"])
    login = out["login"]
    if login is not None and (login.startswith("-") or not LOGIN.match(login)):
        raise UserError(f"--login {login!r} is not a host name for ssh ([USER@]HOST)")
    return out


# -- the SLURM commands ---------------------------------------------------------------


@dataclass
class SlurmStatus:
    state: str  # SLURM's, e.g. PENDING, RUNNING, COMPLETED, CANCELLED
    reason: str | None = None  # why it waits (Resources, Priority, ...)
    partition: str | None = None
    exit_code: str | None = None  # sacct's "code:signal"
    nodes: str | None = None


Runner = Callable[..., subprocess.CompletedProcess]


class SlurmCommands:
    """sbatch, squeue, sacct and scancel, run here or on `login` through ssh."""

    def __init__(self, login: str | None = None, runner: Runner = subprocess.run, ssh: str = "ssh"):
        self.login = login
        self._runner = runner
        self._ssh = ssh

    def argv(self, args: list[str]) -> list[str]:
        """The command line that runs `args`: as is, or through ssh to the login node."""
        if self.login is None:
            return list(args)
        # BatchMode: fail rather than ask for a password nobody can type into the engine.
        return [self._ssh, "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", self.login, "--", shlex.join(args)]

    def run(self, args: list[str], *, what: str) -> str:
        return self._call(args, what=what).stdout

    def _call(self, args: list[str], *, what: str, script: str | None = None) -> subprocess.CompletedProcess[str]:
        argv = self.argv(args)
        # A script goes on stdin, which ssh carries to the login node: no file needs to be shared first.
        feed: dict[str, Any] = {"input": script} if script is not None else {"stdin": subprocess.DEVNULL}
        try:
            r = self._runner(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, **feed)
        except FileNotFoundError:
            if self.login is None:
                raise UserError(
                    f"{args[0]} is not installed here: install SLURM's client commands (Debian: slurm-client), "
                    "or give --login HOST to submit on a login node through ssh"
                ) from None
            raise UserError(f"{self._ssh} is not installed here: it is needed to reach {self.login}") from None
        except subprocess.TimeoutExpired:
            where = f" on {self.login}" if self.login else ""
            raise UserError(f"{args[0]}{where} did not answer within {COMMAND_TIMEOUT_S:.0f} s") from None
        if r.returncode != 0:
            raise UserError(f"{what}: {_first_error(r.stderr or r.stdout, r.returncode, self.login)}")
        return r

    def test_only(self, script: str) -> str:
        """SLURM's answer to `script` without queueing it (sbatch --test-only): when and where it would start."""
        r = self._call(["sbatch", "--test-only"], what="SLURM would refuse the job", script=script)
        lines = [ln.strip() for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
        answer = next((ln for ln in lines if " to start at " in ln), lines[-1] if lines else "no answer")
        return re.sub(r"^sbatch: ", "", answer)[:300]

    def submit(self, script: Path) -> str:
        out = self.run(["sbatch", "--parsable", str(script)], what="SLURM refused the job")
        job_id = out.strip().splitlines()[-1].split(";")[0] if out.strip() else ""
        if not job_id.isdigit():
            raise UserError(f"sbatch answered {out.strip()[:200]!r}, not a job id")
        return job_id

    def cancel(self, job_id: str) -> None:
        self.run(["scancel", job_id], what=f"scancel refused to cancel SLURM job {job_id}")

    def status(self, job_id: str) -> SlurmStatus | None:
        """The job's state from slurmctld while it remembers the job, else from SLURM's accounting; None if neither knows it."""
        return self.statuses([job_id])[job_id]

    def statuses(self, job_ids: list[str]) -> dict[str, SlurmStatus | None]:
        """`status` of several jobs with one squeue: slurmctld answers every user of the cluster, so a
        user's ten jobs ask it once per poll, not ten times. Jobs it has forgotten are looked up in
        the accounting one by one (once each, as they end)."""
        found: dict[str, SlurmStatus] = {}
        try:
            out = self.run(["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-o", "%i|%T|%r|%P|%N"],
                           what="squeue failed")  # fmt: skip
        except UserError as e:
            if "invalid job id" not in str(e).lower():
                raise
            out = ""  # every one of them forgotten (SLURM refuses a list it knows nothing of)
        for line in out.splitlines():
            parts = (line.split("|") + [""] * 5)[:5]
            if parts[0] in job_ids and parts[1]:
                reason = parts[2] if parts[2] not in ("", "None") else None  # squeue's word for no reason
                found[parts[0]] = SlurmStatus(parts[1], reason, parts[3] or None, None, parts[4] or None)
        return {j: found[j] if j in found else self._accounting(j) for j in job_ids}

    def _accounting(self, job_id: str) -> SlurmStatus | None:
        fields = ["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State,ExitCode,Partition,NodeList"]
        try:
            out = self.run(fields, what="sacct failed")
        except UserError as e:
            if "accounting storage is disabled" not in str(e).lower():
                raise
            # No slurmdbd: the completion log (JobCompType) is SLURM's record of ended jobs.
            out = self.run([*fields[:1], "--completion", *fields[1:]], what="sacct --completion failed")
        for line in out.splitlines():
            parts = (line.split("|") + [""] * 5)[:5]
            if parts[0].split(".")[0] == job_id and parts[1]:
                return SlurmStatus(parts[1].split()[0], None, parts[3] or None, parts[2] or None, parts[4] or None)
        return None


def _first_error(text: str, rc: int, login: str | None) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    if rc == 255 and login is not None:
        return f"ssh could not reach {login}: {lines[-1] if lines else 'no reason given'}"
    if not lines:
        return f"exit status {rc}"
    if any("could not establish a configuration source" in ln.lower() for ln in lines):
        where = f"on {login}" if login else "here"
        return (f"no SLURM configuration {where} (no slurm.conf, no DNS SRV record): is this a SLURM "
                "client? Submit from a login node with --login HOST")  # fmt: skip
    # A fatal line says what stopped the command; the errors before it are often its symptoms.
    line = next((ln for ln in lines if ": fatal: " in ln), None) or next(
        (ln for ln in lines if "error" in ln.lower()), lines[0]
    )
    return re.sub(r"^(sbatch|squeue|sacct|scancel): (error|fatal): ", "", line)[:300]


# -- the supervisor's side ------------------------------------------------------------


class Supervisor(Protocol):
    """The supervisor as its SLURM half uses it (engine.jobs.supervisor.Supervisor, which imports this
    module: naming that class here would make the two import each other)."""

    store: JobStore
    slurm_states: dict[str | None, tuple[float, dict[str, Any]]]
    _runs: dict[str, Run]
    _queue_dirty: bool
    _on_job: Callable[[dict[str, Any]], None]
    _on_metrics: Callable[[str], None]

    @property
    def max_cpu_ranks(self) -> int: ...  # read-only: the supervisor's is a property

    def job_dir(self, job_id: str) -> Path: ...
    def view(self, rec: JobRecord, *, detail: bool = True) -> dict[str, Any]: ...
    def _environment(self, rec: JobRecord, spec: JobSpec, job_dir: Path, python: str) -> dict[str, str]: ...
    def _read_metrics(self, run: Run) -> None: ...
    def _read_ranks(self, run: Run) -> None: ...


def start(sup: Supervisor, rec: JobRecord, spec: JobSpec, job_dir: Path, commands: SlurmCommands | None = None) -> dict[str, Any]:
    """Write the job's SLURM script and submit it; returns the record's new fields. Raises UserError when refused."""
    options = rec.slurm or {}
    _refuse_secrets(spec)
    python = worker_python()
    script = job_script(sup, rec, spec, job_dir, python)
    path = job_dir / "slurm.sh"
    paths.write_private(path, script)
    commands = commands or SlurmCommands(options.get("login"))
    with paths.open_private(job_dir / "logs" / "launcher.log", "ab") as f:
        f.write(f"--- run {rec.run}: {' '.join(commands.argv(['sbatch', '--parsable', str(path)]))}\n".encode())
    job_id = commands.submit(path)
    slurm = {**options, "job_id": job_id, "state": "PENDING", "reason": None, "script": str(path), "exit_code": None}
    return {"state": STARTING, "started": time.time(), "ended": None, "slurm": slurm}


def check(sub: Submission, options: dict[str, Any], commands: SlurmCommands | None = None) -> list[str]:
    """What `--check` says of a SLURM job: what would be submitted, and SLURM's own answer to its request
    (sbatch --test-only: the nodes, tasks, GPUs, partition, account and time limit are checked by
    slurmctld itself). Raises UserError where submitting would be refused."""
    _refuse_secrets(sub.spec)
    commands = commands or SlurmCommands(options.get("login"))
    script = slurm_script(
        _plan_from(sub.plan), command=["true"], env={}, ranks_per_node=sub.ranks,
        gpus_per_node=0 if sub.spec.simulated else len(sub.spec.gpus), job_name="rigpilot-check",
        output="/dev/null", partition=options.get("partition"), account=options.get("account"),
        time_limit=options.get("time"),
    )  # fmt: skip
    where = f" through {commands.login}" if commands.login else ""
    settings = ", ".join(f"{k} {options[k]}" for k in ("partition", "account", "time") if options.get(k))
    return [
        f"SLURM: would be submitted with sbatch{where}" + (f" ({settings})" if settings else ""),
        f"SLURM: {commands.test_only(script)}",
    ]


def _refuse_secrets(spec: JobSpec) -> None:
    _, hidden = job_secrets.split(spec.env)
    if hidden or job_secrets.masked_names(spec.env):
        raise UserError(
            "secret environment values are not sent to SLURM (slurmctld keeps a job's environment on disk); "
            "give the job its secrets on the cluster instead"
        )


def job_script(sup: Supervisor, rec: JobRecord, spec: JobSpec, job_dir: Path, python: str) -> str:
    """The planner's SLURM script for this job: its plan where it has one, the engine's command and environment."""
    options = rec.slurm or {}
    target = rank_target(python, job_dir, spec.script if rec.kind == "script" else None)
    command = rankexec_command(python, job_dir, target)
    env = job_environment(sup, rec, spec, job_dir, python)
    return slurm_script(
        _plan(job_dir), command=command, env=env, ranks_per_node=rec.ranks,
        gpus_per_node=0 if rec.simulated else len(rec.gpus), job_name=f"rigpilot-{rec.id}",
        output=str(job_dir / "logs" / "launcher.log"), partition=options.get("partition"),
        account=options.get("account"), time_limit=options.get("time"),
    )  # fmt: skip


_RANK_SETTINGS = ("PYTHONUNBUFFERED", "TOKENIZERS_PARALLELISM", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS")


def job_environment(sup: Supervisor, rec: JobRecord, spec: JobSpec, job_dir: Path, python: str) -> dict[str, str]:
    """What the engine sets for the job's ranks, written into the script.

    Not the engine's whole environment: a local sbatch passes that on by itself, and through ssh it
    would be this machine's, not the login node's. The engine's own settings and the job's --env go
    in even where they equal the engine's, since over ssh nothing else carries them.
    """
    full = sup._environment(rec, spec, job_dir, python)
    keep = set(spec.env) | set(_RANK_SETTINGS)
    return {k: v for k, v in full.items() if k in keep or k.startswith("RIGPILOT_") or os.environ.get(k) != v}


def _plan(job_dir: Path) -> Plan | None:
    import json

    try:
        data = json.loads((job_dir / "plan.json").read_text())
    except (OSError, ValueError):
        return None
    return _plan_from(data)


def _plan_from(data: Any) -> Plan | None:
    from rigpilot.engine.jobs.submission import plan_of

    try:
        return Plan.from_dict(plan_of(data) or {})
    except (ValueError, UserError, TypeError, AttributeError):
        return None  # no plan, or not one the planner wrote: the job's own layout says it all


def poll(sup: Supervisor, run: Run, commands: SlurmCommands | None = None) -> None:
    """One supervisor tick for a SLURM job: its metrics every time, its SLURM state every POLL_S."""
    rec = run.rec
    sup._read_metrics(run)
    sup._read_ranks(run)
    if rec.state == STARTING and following.has_started(run):
        sup.store.update(rec, state=RUNNING)
        run.dirty, run.last_publish = True, 0.0
    now = time.monotonic()
    if now - getattr(run, "slurm_polled", 0.0) >= POLL_S:
        run.slurm_polled = now  # type: ignore[attr-defined]
        slurm = dict(rec.slurm or {})
        try:
            status = _queue_states(sup, slurm.get("login"), str(slurm["job_id"]), commands, now)
        except UserError as e:
            log.warning("job %s: cannot ask SLURM about job %s: %s", rec.id, slurm.get("job_id"), e)
            status = None
        if status is not None:
            changed = (status.state, status.reason) != (slurm.get("state"), slurm.get("reason"))
            slurm.update(state=status.state, reason=status.reason, exit_code=status.exit_code or slurm.get("exit_code"))
            slurm.update({k: v for k, v in (("partition", status.partition), ("nodes", status.nodes)) if v})
            sup.store.update(rec, slurm=slurm)
            if changed:
                run.dirty, run.last_publish = True, 0.0
            try:
                ended = rigpilot_state(status.state)
            except ValueError:
                ended = STARTING
            if ended in TERMINAL_STATES:
                finish(sup, run, status)
                return
    if run.dirty and now - run.last_publish >= 1.0:
        run.dirty, run.last_publish = False, now
        sup._on_job(sup.view(rec, detail=False))


def _queue_states(
    sup: Supervisor, login: str | None, job_id: str, commands: SlurmCommands | None, now: float
) -> SlurmStatus | None:
    """The job's SLURM state, from one query for every SLURM job the supervisor follows through `login`:
    the first of them due in a tick asks for all, and the others due then use that answer."""
    at, states = sup.slurm_states.get(login, (float("-inf"), {}))
    if now - at >= POLL_S / 2 or job_id not in states:
        runs = [r.rec.slurm for r in sup._runs.values() if r.rec.slurm and r.rec.slurm.get("login") == login]
        ids = list(dict.fromkeys([job_id, *(str(slurm["job_id"]) for slurm in runs)]))
        states = (commands or SlurmCommands(login)).statuses(ids)
        sup.slurm_states[login] = (now, states)
    return states[job_id]


def finish(sup: Supervisor, run: Run, status: SlurmStatus) -> None:
    rec = run.rec
    sup._read_metrics(run)
    sup._read_ranks(run)
    state = rigpilot_state(status.state)
    slurm_id = (rec.slurm or {}).get("job_id")
    code = _exit_code(status.exit_code)
    launcher = log_tail(run.job_dir / "logs" / "launcher.log")
    if state == CANCELLED or rec.cancel_requested:
        by = "by the user (scancel)" if rec.cancel_requested else "in SLURM, not through Rigpilot"
        outcome: dict[str, Any] = {"state": CANCELLED, "exit_reason": f"cancelled {by}", "resumable": True,
                                   "failed_rank": None, "last_log": []}  # fmt: skip
    elif state == COMPLETED:
        outcome = run_outcome(run, 0)
    elif state == INTERRUPTED:
        outcome = {"state": INTERRUPTED, "exit_reason": f"SLURM preempted job {slurm_id}; resume continues from the "
                   "newest checkpoint", "resumable": True, "failed_rank": None, "last_log": launcher}  # fmt: skip
    else:
        outcome = run_outcome(run, code if code is not None else 1)
        why = {
            "TIMEOUT": f"SLURM stopped job {slurm_id} at its time limit ({(rec.slurm or {}).get('time') or 'the partition’s'})",
            "NODE_FAIL": f"a node of SLURM job {slurm_id} failed",
            "OUT_OF_MEMORY": f"SLURM job {slurm_id} ran out of host memory",
            "BOOT_FAIL": f"SLURM could not boot the nodes of job {slurm_id}",
        }.get(status.state)
        if why:
            outcome["exit_reason"] = why + (f"; {outcome['exit_reason']}" if outcome.get("failed_rank") is not None else "")
        elif outcome.get("failed_rank") is None:
            outcome["exit_reason"] = f"SLURM job {slurm_id} {status.state.lower()} (exit code {status.exit_code or '?'})"
        if not outcome.get("last_log"):
            outcome["last_log"] = launcher
    outcome.setdefault("exit_code", code)
    outcome["cancel_requested"] = rec.cancel_requested
    # A failed SLURM job restarts as a local one does: queued again, and resubmitted to resume from its
    # newest checkpoint. Which of the cluster's GPUs are healthy is SLURM's to know (it drains bad
    # nodes), so no local fault is asked about.
    outcome = recovery.after_failure(
        rec, outcome, run.summary.errors, run.job_dir, dict, simulated=rec.simulated,
        max_cpu_ranks=sup.max_cpu_ranks,
        from_step=(newest_checkpoint(run.job_dir) or {}).get("step") if rec.kind == "train" else None,
    )  # fmt: skip
    measured = run.summary.to_dict(time.time())
    tensorboard.finish(run.tensorboard, None)
    sup.store.update(rec, ended=time.time(), measured=measured, **outcome)
    del sup._runs[rec.id]
    sup._queue_dirty = True
    sup._on_metrics(rec.id)
    sup._on_job(sup.view(rec))


def _exit_code(text: str | None) -> int | None:
    head = (text or "").split(":")[0]
    return int(head) if head.isdigit() else None


def cancel(rec: JobRecord, commands: SlurmCommands | None = None) -> None:
    """scancel the job; SLURM signals every task (SIGTERM, then SIGKILL after its KillWait) and the next poll sees it end."""
    slurm = rec.slurm or {}
    (commands or SlurmCommands(slurm.get("login"))).cancel(str(slurm["job_id"]))


def adopt(sup: Supervisor, rec: JobRecord) -> Run:
    """A SLURM job the engine followed before it restarted: it runs on without the engine, so follow it again."""
    job_dir = sup.job_dir(rec.id)
    try:
        spec: JobSpec | None = JobSpec.read(job_dir)
    except (OSError, ValueError):
        spec = None
    # The training figures only: the job's GPUs are the cluster's, whose telemetry this engine does not sample.
    run = Run(rec, job_dir, None, tensorboard=tensorboard.for_run(spec, job_dir, []))
    run.summary, run.cursor = summarize(job_dir / "metrics", max_steps_of(spec) if spec is not None else None)
    if run.tensorboard is not None:
        run.tensorboard.catch_up()
    return run
