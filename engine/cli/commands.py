"""The job commands: `rigpilot engine | run | jobs | logs | metrics | cancel | resume | delete`.

All but `engine` are clients of the engine service and start it when none
runs. `run` submits and then follows the job; Ctrl-C only stops following.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from rigpilot.engine.argtypes import positive_int, read_json_object
from rigpilot.engine.capability import backend_words
from rigpilot.engine.cli.serve_wait import gpu_list, waiting
from rigpilot.engine.errors import UserError
from rigpilot.engine.given_path import EITHER, FOLDER, check_given_path, open_given_file, shown
from rigpilot.engine.jobs import scaling, scaling_table
from rigpilot.engine.jobs.machine_check import lines as machine_check_lines
from rigpilot.engine.jobs.metrics import held_out, mark_superseded
from rigpilot.engine.jobs.results import STOP_WORDS
from rigpilot.engine.jobspec.secrets import shown_text
from rigpilot.engine.jobspec.spec import INFER_SETTINGS, JOB_SETTINGS, TRAIN_SETTINGS
from rigpilot.engine.layout import LAYOUT_SETTINGS, Layout
from rigpilot.engine.schema import ACTIVE_STATES, TERMINAL_STATES, add_option, add_options, given
from rigpilot.engine.service.command_line import add_service_arguments, service_options
from rigpilot.engine.terminal import printable

TERMINAL = TERMINAL_STATES
ACTIVE = ACTIVE_STATES
# What a training run trains on: options of both `run train` and `scaling`.
WORKLOAD = ("dataset", "method", "seq_len", "precision")


def register(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    js = parents[-1]  # the --json option parser

    p = sub.add_parser("engine", help="run the engine service in the foreground (clients start it on demand)")
    add_service_arguments(p)
    p.add_argument("--install-systemd", action="store_true", help="write a systemd user unit and say how to enable it")
    p.add_argument("--stop", action="store_true", help="stop the running service (its jobs keep running)")
    p.add_argument("--fingerprint", action="store_true",
                   help="print the fingerprint of this engine's TLS certificate (made now if there is none yet), "
                        "to compare with what clients and nodes pinned")  # fmt: skip
    p.set_defaults(func=cmd_engine)

    p = sub.add_parser("run", help="submit a job and follow it (Ctrl-C stops following, not the job)")
    kinds = p.add_subparsers(dest="kind", metavar="KIND", required=True, parser_class=type(p))
    common = _common_run_options()
    model = _model_options()
    degrees = _degree_options()

    slurm = _slurm_options()
    workload = _workload_options()
    k = kinds.add_parser("train", parents=[common, model, degrees, slurm, workload], help="train or fine-tune a model")
    add_options(k, {n: s for n, s in TRAIN_SETTINGS.items() if n not in WORKLOAD})  # engine.jobspec.spec declares them
    add_option(k, LAYOUT_SETTINGS["cpu_offload"])
    k.set_defaults(func=cmd_run)

    k = kinds.add_parser("infer", parents=[common, model, degrees, slurm], help="generate text with a model")
    add_options(k, INFER_SETTINGS)
    k.set_defaults(func=cmd_run)

    k = kinds.add_parser("calibrate", parents=[common, model, degrees], help="measure this machine for the planner")
    k.set_defaults(func=cmd_run)

    k = kinds.add_parser(
        "script", parents=[common, slurm], help="run your own script under torchrun, one rank per GPU",
        description="rigpilot run script [--gpus 0,1] -- train.py --my-flag 1  "
        "(report metrics with: from rigpilot import report)",
    )  # fmt: skip
    k.add_argument("command", nargs=argparse.REMAINDER, metavar="-- SCRIPT [ARGS]", help="the script and its arguments")
    k.set_defaults(func=cmd_run)

    register_nodes(sub, js)
    p = sub.add_parser(
        "scaling", parents=[_scaling_model_options(), workload, js],
        help="run the same training on 1, 2, 4 … GPUs: measured speed-up against linear and against the plan",
        description="rigpilot scaling --model MODEL --data FILE --gpus 1,2,4 [--steps N]: one training job per GPU "
        "count (GPUs 0 … n-1), each under the planner's plan for that count, one after another; then a table of "
        "measured tokens/s and steps/s, speed-up, efficiency against linear and the plan's prediction. "
        "rigpilot scaling --job JOB repeats a training job's settings. --csv FILE writes the table; the app "
        "(the job's Summary tab) also draws it and saves the chart as PNG.",
    )  # fmt: skip
    p.add_argument("--gpus", type=_gpu_counts, metavar="1,2,4", help="GPU counts to measure (default: 1, 2, 4 … up to all)")
    p.add_argument("--job", metavar="JOB", help="repeat this training job's model, data and global batch")
    p.add_argument("--steps", type=positive_int, metavar="N", help=f"optimizer steps per job (default {scaling.DEFAULT_STEPS})")
    p.add_argument("--warmup", type=_whole_number, metavar="N",
                   help=f"steps left out of the measurement at the start of each job (default {scaling.DEFAULT_WARMUP})")
    p.add_argument("--global-batch", type=positive_int, metavar="N",
                   help=f"sequences per optimizer step, the same for every GPU count (default {scaling.DEFAULT_GLOBAL_BATCH})")
    add_option(p, TRAIN_SETTINGS["micro_batch"],
               help="sequences per rank per micro-step, the same for every GPU count (default: the largest "
               "count's plan's)")  # fmt: skip
    p.add_argument("--csv", type=Path, metavar="FILE", help="also write the table as CSV")
    p.add_argument("--detach", action="store_true", help="start the study and return at once")
    p.add_argument("--show", metavar="STUDY", help="show a study (started earlier) instead of starting one")
    p.add_argument("--list", action="store_true", help="list the studies, newest first")
    p.add_argument("--cancel", metavar="STUDY", help="cancel a study's jobs that have not ended (measured points stay)")
    p.set_defaults(func=cmd_scaling)

    p = sub.add_parser("jobs", parents=[js], help="the jobs, newest first")
    p.add_argument("--state", action="append", metavar="STATE", help="only jobs in this state; repeatable")
    p.add_argument("--limit", type=positive_int, default=50, metavar="N", help="at most N jobs (default 50)")
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("logs", help="a job's log, one rank at a time")
    p.add_argument("job", metavar="JOB", help="job id (or a unique prefix, or its name)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends")
    p.add_argument("--rank", type=int, metavar="N", help="which rank (default: the failed rank, else 0; -1: torchrun)")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser(
        "metrics", aliases=["job"], parents=[js],
        help="a job's progress, measurements and restarts (--json: every record)",
    )  # fmt: skip
    p.add_argument("job", metavar="JOB")
    p.set_defaults(func=cmd_metrics)

    p = sub.add_parser("cancel", help="stop a job (workers get a grace period to checkpoint)")
    p.add_argument("job", metavar="JOB")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("resume", help="run a failed, cancelled or interrupted job again from its last checkpoint")
    p.add_argument("job", metavar="JOB")
    p.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE",
        help="environment for the ranks, e.g. a secret the engine no longer holds; repeatable",
    )  # fmt: skip
    p.add_argument("--detach", action="store_true", help="queue it and return at once")
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser("delete", help="remove a job that is not running, with its folder (logs, checkpoints, output)")
    p.add_argument("job", metavar="JOB")
    p.set_defaults(func=cmd_delete)

    p = sub.add_parser("rename", help="give a job a new name (shown in the app and in 'rigpilot jobs')")
    p.add_argument("job", metavar="JOB")
    p.add_argument("name", metavar="NAME")
    p.set_defaults(func=cmd_rename)

    p = sub.add_parser("results", parents=[js], help="an inference job's prompts and completions")
    p.add_argument("job", metavar="JOB")
    p.set_defaults(func=cmd_results)


# -- option groups ---------------------------------------------------------------


def _common_run_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    add_option(p, JOB_SETTINGS["gpus"])
    add_option(p, JOB_SETTINGS["name"])
    p.add_argument("--detach", action="store_true", help="submit and return at once")
    p.add_argument("--json", action="store_true", help="print the submitted job as JSON (implies --detach)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="environment for the ranks; repeatable")
    add_option(p, JOB_SETTINGS["max_restarts"])
    add_option(p, JOB_SETTINGS["tensorboard"])
    p.add_argument("--nodes", type=_node_list, metavar="local,NODE",
                   help="run across these engines ('local' is this one; others from 'rigpilot nodes add')")
    p.add_argument("--shared-dir", metavar="DIR",
                   help="with --nodes on other computers: a folder every node mounts at this path (checkpoints)")
    return p


def _slurm_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("SLURM (the job folder must be on a filesystem the cluster's nodes share)")
    g.add_argument("--slurm", action="store_true", help="submit the job to SLURM with sbatch and follow it there")
    g.add_argument("--partition", metavar="P", help="SLURM partition (default: the cluster's default)")
    g.add_argument("--account", metavar="A", help="SLURM account to charge")
    g.add_argument("--time", metavar="T", help="SLURM time limit: MINUTES, HH:MM:SS or DAYS-HH:MM:SS")
    g.add_argument("--login", metavar="HOST", help="run sbatch/squeue/scancel on this login node through ssh")
    return p


def _slurm_request(args: argparse.Namespace) -> dict[str, Any] | None:
    """The submit request's `slurm` options, or None; SLURM's flags without --slurm are a mistake worth naming."""
    given = {k: getattr(args, k, None) for k in ("partition", "account", "time", "login")}
    if not getattr(args, "slurm", False):
        named = [k for k, v in given.items() if v is not None]
        if named:
            raise UserError(f"--{named[0]} is a SLURM option: add --slurm to submit the job to SLURM")
        return None
    return {k: v for k, v in given.items() if v is not None}


def _workload_options() -> argparse.ArgumentParser:
    """What a training run trains on, shared by `run train` and `scaling`."""
    p = argparse.ArgumentParser(add_help=False)
    for name in WORKLOAD:
        add_option(p, TRAIN_SETTINGS[name])
    return p


def _scaling_model_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", help="preset, local folder, hub id, or a config.json (train from scratch)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own Python code to run")
    return p


def _gpu_counts(text: str) -> list[int]:
    try:
        return scaling_table.parse_counts(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def _node_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected node names like local,box2 not {text!r}")
    return names


def _model_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", help="preset, local folder, hub id, or a config.json (train from scratch)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own Python code to run")
    p.add_argument("--plan", type=Path, metavar="FILE", help="a plan from 'rigpilot plan --json' to run under")
    return p


def _degree_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("parallelism (the product must equal the number of GPUs)")
    for name in ("dp_replicate", "dp_shard", "tp", "pp", "pp_microbatches", "pp_schedule", "sequence_parallel"):
        add_option(g, LAYOUT_SETTINGS[name])  # engine.layout declares them
    p.add_argument("--check", action="store_true",
                   help="check the job through the whole submission path and print what would run; start nothing")  # fmt: skip
    return p


# -- engine --------------------------------------------------------------------


def cmd_engine(args: argparse.Namespace) -> int:
    if args.fingerprint:
        from rigpilot.engine.api import tls

        # Its files are made 0600 in a 0700 folder whatever the umask (tls._create).
        print(tls.load_or_create_identity().fingerprint)  # alone on its line: scripts compare it as it is
        return 0
    if args.install_systemd:
        from rigpilot.engine.launch.systemd import enable_hint, install_unit, packaged_unit

        shipped = packaged_unit()
        if shipped is not None:
            print(f"the package installed the unit already ({shipped})\nenable it with:\n  {enable_hint()}")
            return 0
        path = install_unit()
        print(f"wrote {path}\nenable it with:\n  {enable_hint()}")
        return 0
    if args.stop:
        from rigpilot.engine.api.client import EngineClient, EngineUnavailable

        try:
            with EngineClient(autostart=False, on_notice=print_notice) as c:
                c.request("shutdown")
        except EngineUnavailable:
            print("the engine service is not running")
            return 0
        print("engine service stopping; running jobs keep running")
        return 0
    from rigpilot.engine.service.server import run_service

    return run_service(service_options(args))


# -- run -------------------------------------------------------------------------


def build_spec(args: argparse.Namespace) -> dict[str, Any]:
    """JobSpec fields from `rigpilot run KIND` flags; paths stay as typed (the service resolves them)."""
    spec: dict[str, Any] = {"kind": args.kind, **given(args, JOB_SETTINGS)}
    env = _env_flags(args.env)
    if env:
        spec["env"] = env
    if args.kind == "script":
        command = list(args.command)
        if command and command[0] == "--":
            command = command[1:]
        if not command:
            raise UserError("which script? rigpilot run script [--gpus 0,1] -- script.py [args]")
        spec["script"] = command
        return spec
    if args.model is not None and not args.model.strip():
        raise UserError("--model is empty: name a preset, a model folder, a config.json or a Hugging Face repo id")
    if args.model:
        spec["model"] = args.model
    if args.trust_remote_code:
        spec["trust_remote_code"] = True
    degrees = given(args, LAYOUT_SETTINGS)  # only the given flags: pipeline micro-batches default to the stages
    Layout.from_settings(**degrees)  # a layout the degrees cannot make is refused here, in the engine's words
    if degrees:
        spec["parallelism"] = degrees
    if args.kind == "train":
        spec["train"] = given(args, TRAIN_SETTINGS)
    elif args.kind == "infer":
        spec["infer"] = given(args, INFER_SETTINGS)
    return spec


def _env_flags(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UserError(f"--env expects NAME=VALUE, not {printable(shown_text(item))!r}")
        env[name] = value
    return env


def _read_plan(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    return read_json_object(path, "plan")  # a plan or a whole search result; the service takes the best plan from the latter


def cmd_run(args: argparse.Namespace) -> int:
    from rigpilot.engine.api.client import EngineClient

    spec = build_spec(args)
    plan = _read_plan(getattr(args, "plan", None))
    slurm = _slurm_request(args)
    across: dict[str, Any] = {}
    if getattr(args, "nodes", None):
        across["nodes"] = args.nodes
        if args.shared_dir:
            across["shared_dir"] = os.path.abspath(args.shared_dir)
    elif getattr(args, "shared_dir", None):
        raise UserError("--shared-dir goes with --nodes: it is where a multi-node job keeps its checkpoints")
    if slurm is not None and across:
        raise UserError("--slurm and --nodes do not go together: SLURM chooses the nodes of a SLURM job itself")
    # --slurm with none of its options is still a SLURM job: the options are only ever added to.
    extra = {"slurm": slurm} if slurm is not None else across
    with EngineClient(on_notice=print_notice) as client:
        if getattr(args, "check", False):
            for line in client.request("check", spec=spec, plan=plan, cwd=os.getcwd(), **extra)["lines"]:
                print(line)
            return 0
        job = client.request("submit", spec=spec, plan=plan, cwd=os.getcwd(), **extra)["job"]
        if args.json:
            print(json.dumps({"schema": "rigpilot.job/1", "job": job}, indent=2))
            return 0
        n = job["ranks"]
        ranks = f"{n} CPU rank{'s' * (n != 1)}" if job["simulated"] else f"{n} rank{'s' * (n != 1)}"
        if job.get("slurm"):
            where = f" through {job['slurm']['login']}" if job["slurm"].get("login") else ""
            print(f"job {job['id']} submitted to SLURM{where} as job {job['slurm']['job_id']}: {job['kind']} "
                  f"'{printable(job['name'])}' ({ranks}); script {job['slurm']['script']}")  # fmt: skip
        else:
            print(f"job {job['id']} submitted: {job['kind']} '{printable(job['name'])}' on GPUs {gpu_list(job['gpus'])} ({ranks})")
        if job.get("nodes"):
            n = job["nodes"]
            print(f"  across {n['count']} nodes ({', '.join(n['names'])}), {ranks} on each; rendezvous {n['endpoint']}")
        for note in (job.get("predicted") or {}).get("plan_notes") or []:
            print(f"  note: {note}")
        for line in machine_check_lines(job.get("machine_check")):
            print(f"  note: {line}")
        if args.detach:
            _print_hints(job["id"])
            return 0
        return follow(client, job["id"])


def follow(client: Any, job_id: str) -> int:
    """Print a job's progress until it ends; Ctrl-C detaches. Survives a service restart."""
    from rigpilot.engine.api.client import EngineUnavailable

    cursor: dict[str, int] = {}
    state: tuple[str, str | None] | None = None
    printer = _ProgressPrinter()
    shown_restarts: int | None = None  # restarts before following began are history, not news
    reconnect = False
    try:
        while True:
            try:
                if reconnect:
                    client.connect()  # starts a new service if needed, which re-adopts the job
                    reconnect = False
                client.request("subscribe", topics=[f"metrics:{job_id}"], metrics_cursors={job_id: cursor})
                job = client.request("job", job=job_id)["job"]
                if shown_restarts is None:
                    shown_restarts = len(job.get("restarts") or [])
                while True:
                    restarts = job.get("restarts") or []
                    if len(restarts) > shown_restarts:
                        for line in restart_lines({**job, "restarts": restarts[shown_restarts:]})[1:]:
                            print(line[2:], flush=True)
                        shown_restarts = len(restarts)
                    # A SLURM job waits in SLURM's queue, then runs, while Rigpilot's state stays "starting".
                    now = (job["state"], (job.get("slurm") or {}).get("state"))
                    if now != state:
                        state = now
                        state_name = job["state"]
                        if state_name in TERMINAL:
                            # Metric events always precede the "ended" event; drain what is queued.
                            while (ev := client.next_event(0.2)) is not None:
                                if ev.get("event") == "metrics":
                                    cursor = ev["cursor"]
                                    printer.records(ev["records"])
                            return _report_end(job)
                        print(f"state: {state_name}" + waiting(job), flush=True)
                    ev = client.next_event(1.0)
                    if ev is None:
                        continue
                    if ev.get("event") == "metrics" and ev.get("job") == job_id:
                        cursor = ev["cursor"]
                        printer.records(ev["records"])
                    elif ev.get("event") == "job" and ev["job"].get("id") == job_id:
                        job = ev["job"]
            except (ConnectionError, EngineUnavailable):
                print("(lost the engine service; reconnecting)", file=sys.stderr, flush=True)
                time.sleep(1.0)
                reconnect = True
    except KeyboardInterrupt:
        print(f"\ndetached; job {job_id} keeps running.")
        _print_hints(job_id)
        return 0


def _report_end(job: dict[str, Any]) -> int:
    took = _duration(job.get("wall_s") or 0)
    if job["state"] == "completed":
        print(f"job {job['id']} completed in {took}")
        if job.get("kind") == "calibrate" and job.get("job_dir"):
            # The engine keeps it for its own planner; `rigpilot plan` reads it when named.
            where = Path(job["job_dir"]) / "output" / "calibration.json"
            print(f"calibration written to {where}")
            print("the engine's planner and `rigpilot plan` use it from now on")
        return 0
    print(f"job {job['id']} {job['state']}: {printable(job.get('exit_reason') or 'no reason recorded')}")
    if job.get("last_log"):
        where = f"rank {job['failed_rank']}" if job.get("failed_rank") is not None else "torchrun"
        print(f"last lines of the {where} log:")
        for line in job["last_log"]:
            print(f"  | {line}")
    if job.get("resumable") and job.get("kind") != "doctor":  # a machine check is run again, not resumed
        print(f"resume with: rigpilot resume {job['id']}")
    return 1


class _ProgressPrinter:
    """One line per step record at most twice a second; status, eval and error records always."""

    def __init__(self) -> None:
        self._last = 0.0

    def records(self, records: list[dict[str, Any]]) -> None:
        for r in records:
            kind = r.get("kind")
            if kind == "partial":  # a completion as it grows: the completion itself is printed at the end
                continue
            now = time.monotonic()
            if kind is None and now - self._last < 0.5 and r is not records[-1]:
                continue
            self._last = now
            print(format_record(r), flush=True)


def format_record(r: dict[str, Any]) -> str:
    kind = r.get("kind")
    if kind == "status":
        what = f" {r['module']}" if isinstance(r.get("module"), str) else ""  # "importing torch"
        if isinstance(r.get("check"), str):  # the machine check: "checking all_reduce on GPUs 0,1"
            on = r.get("gpus") if r.get("gpus") is not None else r.get("gpu")
            what = f" {r['check']}" + (f" on GPU{'s' * isinstance(on, str)} {on}" if on is not None else "")
        return f"[rank {r.get('rank')}] {r.get('phase') or r.get('status') or 'status'}{what}"
    if kind == "error":
        detail = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("time", "rank", "step", "kind"))
        return f"[rank {r.get('rank')}] error: {detail}"
    parts = [f"step {r['step']}" if r.get("step") is not None else "-"]
    if kind:
        parts.insert(0, kind)  # "eval", "checkpoint", "infer", ...
    for k, v in r.items():
        if k in ("time", "rank", "step", "kind", "nonfinite", "backend_reason") or v is None or (k == "run" and v == 1):
            continue  # a run number matters only once a job was resumed
        parts.append(f"{k} {_gib(v) if 'memory' in k and isinstance(v, int) else _num(v)}")
    return "  ".join(parts) + f"  [rank {r.get('rank')}]"


def _num(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _print_hints(job_id: str) -> None:
    print(f"  follow:  rigpilot logs {job_id} -f     progress: rigpilot metrics {job_id}     stop: rigpilot cancel {job_id}")


# -- jobs, logs, metrics, cancel, resume ---------------------------------------


def _client():
    from rigpilot.engine.api.client import EngineClient

    return EngineClient(on_notice=print_notice)


def print_notice(notice: dict[str, Any]) -> None:
    """What the engine did by itself (a damaged database it rebuilt), once: a line on stderr, so stdout stays
    what the command prints."""
    print(f"rigpilot: {printable(str(notice['message']))}", file=sys.stderr)


def cmd_jobs(args: argparse.Namespace) -> int:
    with _client() as c:
        query: dict[str, Any] = {"limit": args.limit}
        if args.state:
            query["states"] = args.state
        jobs = c.request("jobs", **query)["jobs"]
    if args.json:
        print(json.dumps({"schema": "rigpilot.jobs/1", "jobs": jobs}, indent=2))
        return 0
    if not jobs:
        print("no jobs yet; start one with 'rigpilot run'")
        return 0
    rows = [("ID", "NAME", "KIND", "STATE", "GPUS", "PROGRESS", "TIME", "ENERGY", "NOTE")]
    for j in jobs:
        rows.append(
            (j["id"], _clip(printable(j["name"]), 24), j["kind"], j["state"], gpu_list(j["gpus"]),
             _progress(j.get("progress")), _job_time(j), _energy_cell(j), _clip(printable(_note(j)), 60))
        )  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


def _energy_cell(j: dict[str, Any]) -> str:
    from rigpilot.engine.jobs.energy import format_kwh

    e = j.get("energy") or {}
    if "kwh" not in e:
        return "-"
    return format_kwh(e["kwh"]) + (" (sim)" if e.get("simulated") else "")


def _note(j: dict[str, Any]) -> str:
    if j.get("slurm") and j["state"] not in TERMINAL:
        from rigpilot.engine.jobs.slurm_state import describe

        return f"{describe(j['slurm'])}, job {j['slurm'].get('job_id')}"
    restarted = len(j.get("restarts") or [])
    note = _end_note(j)
    if j.get("study"):
        note = f"scaling study {j['study']}" + (f"; {note}" if note else "")
    if restarted:
        return f"restarted {restarted}×" + (f"; {note}" if note else "")
    return note


def _end_note(j: dict[str, Any]) -> str:
    if j["state"] == "queued":
        return waiting(j).strip(" ()")
    if j["state"] == "failed" and j.get("failed_rank") is not None:
        return f"rank {j['failed_rank']}: {j.get('exit_reason') or ''}"
    return j.get("exit_reason") or ""


def _progress(p: dict[str, Any] | None) -> str:
    if not p or p.get("step") is None:
        return "-"
    if p.get("max_steps"):
        return f"{p['step']}/{p['max_steps']} ({100 * (p.get('fraction') or 0):.0f}%)"
    return f"step {p['step']}"


def _job_time(j: dict[str, Any]) -> str:
    if j.get("wall_s") is None:
        return _duration(time.time() - j["created"]) + " ago"
    return _duration(j["wall_s"])


def cmd_logs(args: argparse.Namespace) -> int:
    with _client() as c:
        offset = 0
        while True:
            r = c.request("logs", job=args.job, rank=args.rank, since_offset=offset)
            if r["text"]:
                sys.stdout.write(r["text"])
                sys.stdout.flush()
            offset = r["next_offset"]
            if r["more"]:
                continue
            if not args.follow or r["state"] in TERMINAL:
                return 0
            try:
                time.sleep(0.5)
            except KeyboardInterrupt:
                return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    with _client() as c:
        job = c.request("job", job=args.job)["job"]
        if args.json:
            records, cursor = c.all_metrics(job["id"])
            mark_superseded(records)  # a resumed run's repeat of a step replaces the earlier run's
            print(json.dumps({"schema": "rigpilot.metrics/1", "job": job, "records": records, "cursor": cursor}))
            return 0
    print(f"job {job['id']} ({job['kind']} '{printable(job['name'])}'): {job['state']}")
    p = job.get("progress") or {}
    if p.get("step") is not None:
        line = f"  progress: {_progress(p)}"
        if p.get("eta_s") is not None and job["state"] in ("running", "starting"):
            line += f", about {_duration(p['eta_s'])} left"
        print(line)
    for label, key in (("loss", "loss"), ("tokens/s", "tokens_per_s"), ("phase", "phase")):
        if p.get(key) is not None:
            print(f"  {label}: {_num(p[key])}")
    figures = held_out(p)
    if figures is not None:
        from rigpilot.engine.cli.comparison import held_out_line

        print(f"  {held_out_line(figures)}")
    backend = backend_line(job)
    if backend:
        print(f"  backend: {backend}")
    peaks = p.get("peak_memory_by_rank") or {}
    if peaks:
        print("  peak memory: " + ", ".join(f"rank {r} {_gib(v)}" for r, v in peaks.items()))
    from rigpilot.engine.jobs.energy import energy_line

    print(f"  {energy_line(job.get('energy'), job.get('energy_cost'))}")
    if (job.get("energy_cost") or {}).get("hint"):
        print(f"  ({job['energy_cost']['hint']})")
    for name, pair in (job.get("comparison") or {}).items():
        if pair["predicted"] is not None:
            fmt = _gib if "memory" in name else _num
            measured = fmt(pair["measured"]) if pair["measured"] is not None else "not yet"
            print(f"  {name.replace('_', ' ')}: predicted {fmt(pair['predicted'])}, measured {measured}")
    if job.get("exit_reason"):
        print(f"  {job['exit_reason']}")
    for line in restart_lines(job):
        print(f"  {line}")
    for line in machine_check_lines(job.get("machine_check")):
        print(f"  {line}")
    if job.get("tensorboard_dir"):
        print(f"  TensorBoard: tensorboard --logdir {shlex.quote(job['tensorboard_dir'])}")
    return 0


def backend_line(job: dict[str, Any]) -> str | None:
    """Which generator an inference job runs and why, as the submission recorded it in job.json."""
    infer = (job.get("settings") or {}).get("infer")
    if job.get("kind") != "infer" or not isinstance(infer, dict):
        return None
    # A job submitted before backends were chosen ("auto" in its job.json) ran Rigpilot's own generator.
    name = "vllm" if infer.get("backend") == "vllm" else "transformers"
    reason = infer.get("backend_reason")
    return printable(backend_words(name, reason if isinstance(reason, str) else ""))


def restart_lines(job: dict[str, Any]) -> list[str]:
    """The job's automatic restarts, one line each (and the notes of how it was re-fitted), oldest first."""
    restarts = job.get("restarts") or []
    limit = job.get("max_restarts") or 0
    if not restarts:
        return [f"automatic restarts: up to {limit} in a row"] if limit else []
    lines = [f"restarted {len(restarts)}× (up to {limit} in a row):"]
    for r in restarts:
        where = f"from step {r['from_step']}" if r.get("from_step") is not None else "from the start"
        when = time.strftime("%H:%M:%S", time.localtime(r.get("time") or 0))
        lines.append(f"  {when}  run {r.get('run')} → {r.get('run', 0) + 1} {where}: {printable(r.get('cause') or '')}")
        lines += [f"      {printable(n)}" for n in r.get("notes") or []]
    return lines


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client() as c:
        job = c.request("cancel", job=args.job)["job"]
    if job["state"] == "cancelled":
        print(f"job {job['id']} cancelled")
    else:
        print(f"job {job['id']} is stopping (workers may checkpoint first); 'rigpilot jobs' shows when it has")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    with _client() as c:
        env = _env_flags(args.env)
        job = c.request("resume", job=args.job, **({"env": env} if env else {}))["job"]
        print(f"job {job['id']} queued again (run {job['run']}, {_resumes_from(job)})")
        if args.detach:
            return 0
        return follow(c, job["id"])


def _resumes_from(job: dict[str, Any]) -> str:
    where = job.get("resumes_from")
    if job.get("kind") == "script":
        return "the script starts again from its beginning"
    if where:
        return f"from its checkpoint at step {where['step']}"
    return "no checkpoint was saved, so it starts from step 0"


def cmd_delete(args: argparse.Namespace) -> int:
    with _client() as c:
        job = c.request("job", job=args.job)["job"]
        if job["state"] in ACTIVE:
            # The service refuses too; this says what to do about it.
            raise UserError(f"job {job['id']} is {job['state']}; stop it first with 'rigpilot cancel {job['id']}'")
        c.request("delete", job=job["id"])
    print(f"job {job['id']} ({job['kind']} '{printable(job['name'])}') deleted with its folder {job['job_dir']}")
    return 0


def cmd_rename(args: argparse.Namespace) -> int:
    with _client() as c:
        job = c.request("rename", job=args.job, name=args.name)["job"]
    print(f"job {job['id']} is now named '{printable(job['name'])}'")
    return 0


def cmd_results(args: argparse.Namespace) -> int:
    results: list[dict[str, Any]] = []
    with _client() as c:
        while True:
            reply = c.request("results", job=args.job, start=len(results))
            results += reply["results"]
            if not reply["more"] or not reply["results"]:
                break
    if args.json:
        print(json.dumps({"schema": "rigpilot.results/1", "job": reply["job"], "results": results,
                          "path": reply["path"]}, indent=2))  # fmt: skip
        return 0
    for r in results:
        print(f"--- prompt {r['index'] + 1}: {printable(r['prompt'])}")
        # Generated text keeps its lines; anything else that could drive the terminal is escaped.
        print("\n".join(printable(line) for line in r["completion"].split("\n")))
        if r.get("stop_reason") in STOP_WORDS:
            print(f"--- ({r['new_tokens']} new tokens; stopped: {STOP_WORDS[r['stop_reason']]})")
    print(f"{len(results)} completion(s) of job {reply['job']}; all of it in {reply['path']}")
    return 0


# -- formatting ------------------------------------------------------------------


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _gib(v: float) -> str:
    return f"{v / 2**30:.2f} GiB"


def _duration(seconds: float) -> str:
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


# -- nodes -------------------------------------------------------------------------


def register_nodes(sub: Any, js: argparse.ArgumentParser) -> None:
    from rigpilot.engine.service.nodes import REMOTE_HINT

    p = sub.add_parser(
        "nodes", parents=[js], help="other machines' engines a job may span (rigpilot run … --nodes local,NAME)",
        description="rigpilot nodes add NAME HOST:PORT [--token-file FILE] [--fingerprint SHA256:…]: register another "
        f"machine's engine (without --token-file the token is read from standard input); {REMOTE_HINT}. Its TLS "
        "certificate is pinned: the fingerprint given, else the one it presents when it first proves it holds the "
        "token (compare it with 'rigpilot engine --fingerprint' there). "
        "rigpilot nodes list: each node, whether it answers, its GPUs and its pinned certificate. "
        "rigpilot nodes remove NAME.",
    )  # fmt: skip
    p.add_argument("action", nargs="?", choices=["list", "add", "remove"], default="list")
    p.add_argument("name", nargs="?", metavar="NAME")
    p.add_argument("address", nargs="?", metavar="HOST:PORT")
    p.add_argument("--token-file", type=Path, metavar="FILE", help="a file holding that engine's token")
    p.add_argument("--fingerprint", metavar="SHA256:…",
                   help="the certificate that engine must present, as 'rigpilot engine --fingerprint' prints it there")  # fmt: skip
    p.set_defaults(func=cmd_nodes)


def cmd_nodes(args: argparse.Namespace) -> int:
    from rigpilot.engine.service import nodes

    if args.action == "add":
        if not args.name or not args.address:
            raise UserError("add what? rigpilot nodes add NAME HOST:PORT [--token-file FILE]")
        token = _read_token(args.token_file)
        checked = nodes.check_node(args.name, args.address, token, args.fingerprint)  # one line before anything is sent
        with _client() as c:
            node = c.request(
                "node_add", name=args.name, address=args.address, token=token, fingerprint=checked.fingerprint
            )["node"]
        if args.json:
            print(json.dumps({"schema": "rigpilot.node/1", "node": node}, indent=2))
            return 0
        print(f"node {node['name']} added ({node['address']}): {_node_line(node)}")
        if node.get("fingerprint"):
            how = "as given" if checked.fingerprint else "compare it with 'rigpilot engine --fingerprint' on that machine"
            print(f"  certificate {node['fingerprint']} pinned ({how})")
        if not node["reachable"]:
            print(f"  {nodes.REMOTE_HINT}")
        return 0
    if args.action == "remove":
        if not args.name:
            raise UserError("remove which node? rigpilot nodes remove NAME")
        with _client() as c:
            c.request("node_remove", name=args.name)
        print(f"node {args.name} removed")
        return 0
    with _client() as c:
        reply = c.request("nodes")
    if args.json:
        print(json.dumps({"schema": "rigpilot.nodes/1", **reply}, indent=2))
        return 0
    if not reply["nodes"]:
        print(f"no nodes yet: rigpilot nodes add NAME HOST:PORT; {nodes.REMOTE_HINT}")
        return 0
    for n in reply["nodes"]:
        print(f"{n['name']:<16} {n['address']:<24} {_node_line(n)}")
        print(f"{'':<16} certificate {n.get('fingerprint') or 'not pinned yet (pinned on its first login)'}")
    return 0


def _node_line(n: dict[str, Any]) -> str:
    if not n.get("reachable"):
        return f"not reachable: {printable(n.get('error') or '?')}"
    kind = "simulated" if n.get("simulated") else "real GPUs"
    return f"reachable, {printable(n.get('label') or '?')} ({n.get('gpus')} GPUs, {kind}), Rigpilot {n.get('version')}"


def _read_token(path: Path | None) -> str:
    try:
        if path is not None:
            with open_given_file(path, "token file") as f:
                text = f.read(4096).decode("utf-8", errors="replace")
        elif sys.stdin.isatty():
            import getpass

            text = getpass.getpass("the node engine's token (not shown): ")
        else:
            text = sys.stdin.read(4096)
    except OSError as e:
        raise UserError(f"cannot read the token file {shown(path or '')}: {e.strerror}") from None
    return text.strip()


# -- scaling ---------------------------------------------------------------------


def cmd_scaling(args: argparse.Namespace) -> int:
    from rigpilot.engine.api.client import EngineClient

    if args.csv is not None:  # before the study, not after: a FIFO would block the write forever
        check_given_path(args.csv, "--csv file", missing_ok=True)
        check_given_path(args.csv.expanduser().absolute().parent, "--csv folder", expect=FOLDER)
    with EngineClient(on_notice=print_notice) as c:
        if args.list:
            studies = c.request("scaling_studies")["studies"]
            if args.json:
                print(json.dumps({"schema": "rigpilot.scaling-list/1", "studies": studies}, indent=2))
            elif not studies:
                print("no scaling studies yet; start one with 'rigpilot scaling --model MODEL --data FILE'")
            for s in [] if args.json else studies:
                counts = ",".join(str(p["gpus"]) for p in s["points"])
                print(f"{s['id']}  {s['state']:<9}  {time.strftime('%Y-%m-%d %H:%M', time.localtime(s['created']))}  "
                      f"{printable(s['model'])}  GPUs {counts}")  # fmt: skip
            return 0
        if args.cancel:
            study = c.request("scaling_cancel", study=args.cancel)["study"]
            if not args.detach:  # a running point checkpoints before it stops
                study = _follow_study(c, study, quiet=args.json)
        elif args.show:
            study = c.request("scaling_study", study=args.show)["study"]
        else:
            study = c.request("scaling_start", cwd=os.getcwd(), **_scaling_request(args, c))["study"]
            if not args.json:
                counts = ", ".join(str(n) for n in study.get("counts") or [])
                print(f"scaling study {study['id']} started: planning GPU counts {counts}", flush=True)
            if not args.detach:
                study = _follow_study(c, study, quiet=args.json)
                if study["state"] == "failed" and study.get("error") and not study["points"]:
                    raise UserError(study["error"]["message"])  # refused while planned: one line, as before
    if args.csv is not None:
        try:
            args.csv.write_text(scaling_table.to_csv(study))
        except OSError as e:
            raise UserError(f"cannot write {args.csv}: {e.strerror or e}") from None
    if args.json:
        print(json.dumps(study, indent=2))
    else:
        print("\n".join(scaling_table.text_lines(study)))
        if args.csv is not None:
            print(f"table written to {args.csv}")
    return 0 if study["state"] != "failed" else 1


def _scaling_request(args: argparse.Namespace, client: Any) -> dict[str, Any]:
    if args.gpus is None:  # 1, 2, 4 … up to every GPU the engine's machine has
        have = len(client.request("machine")["machine"]["gpus"])
        counts = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= have] or [1]
    else:
        counts = args.gpus
    req: dict[str, Any] = {"gpus": counts}
    if args.job:
        named = ["--model"] if args.model else []
        named += [TRAIN_SETTINGS[n].flags[0] for n in WORKLOAD if getattr(args, n)]
        if named:
            raise UserError(f"{named[0]} does not go with --job: the study repeats that job's settings")
        req["job"] = args.job
    else:
        if not args.model:
            raise UserError("which model? rigpilot scaling --model MODEL --data FILE [--gpus 1,2,4]")
        # A folder or file here, not a hub id: the engine's planner needs its full path.
        model = str(_local(args.model, "model").resolve()) if _local(args.model, "model").exists() else args.model
        data = [str(_local(d, "data file").resolve()) if _local(d, "data file").exists() else d for d in args.dataset]
        req.update(model=model, dataset=data, method=args.method, seq_len=args.seq_len, precision=args.precision)
        if args.trust_remote_code:
            req["trust_remote_code"] = True
    req.update(steps=args.steps, warmup=args.warmup, global_batch=args.global_batch, micro_batch=args.micro_batch)
    return {k: v for k, v in req.items() if v not in (None, [])}


def _local(path: str, what: str) -> Path:
    """`path` as a local path, checked (a FIFO or a name past NAME_MAX is refused); it may not exist."""
    return check_given_path(path, what, expect=EITHER, missing_ok=True)


def _planning_line(study: dict[str, Any]) -> str:
    counts = study.get("counts") or []
    return f"planning: {study.get('planned') or 0} of {len(counts)} GPU counts planned"


def _follow_study(client: Any, study: dict[str, Any], *, quiet: bool) -> dict[str, Any]:
    """Poll the study until every point has ended, one line per change; Ctrl-C stops following, not the study."""
    shown: dict[int, str] = {}
    try:
        while True:
            if study["state"] == "planning" and shown.get(0) != (line := _planning_line(study)):
                shown[0] = line
                if not quiet:
                    print(line, flush=True)
            for p in study["points"]:
                m = p.get("measured") or {}
                line = f"{p['gpus']} GPU{'s' * (p['gpus'] != 1)} (job {p['job']}): {p['state']}"
                if p["state"] == "completed" and m:
                    line += f", {m['tokens_per_s']:,.0f} tokens/s over {m['steps']} steps"
                if shown.get(p["gpus"]) != line:
                    shown[p["gpus"]] = line
                    if not quiet:
                        print(line, flush=True)
            if study["state"] not in scaling_table.ACTIVE:
                return study
            time.sleep(1.0)
            study = client.request("scaling_study", study=study["id"])["study"]
    except KeyboardInterrupt:
        print(f"\nstopped following; the study goes on. see it with: rigpilot scaling --show {study['id']}")
        raise SystemExit(0) from None
