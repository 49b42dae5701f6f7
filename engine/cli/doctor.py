"""`rigpilot doctor`: check this machine's GPUs and links through the engine, then say what it found and did.

The check runs as a job of kind "doctor" in the engine's queue (it waits for busy GPUs like any job), its
progress printed as it goes; the engine stores the report per machine and driver and acts on it (NCCL's
peer-to-peer transport off for a broken pair, the planner's link figures). `--show` prints the stored one.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.doctor import DoctorReport, describe
from rigpilot.engine.hardware.doctor_table import (
    GPU_COLUMNS,
    PAIR_COLUMNS,
    Cell,
    action_line,
    gpu_rows,
    group_lines,
    pair_rows,
)
from rigpilot.engine.jobspec.spec import gpu_indices

KEEP_WAIT_S = 60.0  # nvidia-smi and the store, after the job itself has ended
WHY_NONE = {
    "never": "this machine has not been checked yet: run 'rigpilot doctor'",
    "driver_changed": "the last check was on another driver: run 'rigpilot doctor' again",
    "unreadable": "the stored check cannot be read: run 'rigpilot doctor' again",
}
MARK = {"fail": "✗", "warn": "!", "info": "·"}


def register(sub: Any, js: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "doctor", parents=[js], help="check the GPUs and their links, and act on what is found",
        description="Per GPU: matmul at each precision and memory bandwidth against the spec sheet, NVML against "
        "nvidia-smi, ECC, XIDs and throttling. Per pair: peer-to-peer copies checked word for word, their speed "
        "against the host path, and an all-reduce with a deadline that names a pair that hangs; then one over all "
        "GPUs. Where peer-to-peer is broken or slow, jobs on those GPUs get NCCL_P2P_DISABLE=1 and the planner "
        "counts their traffic through host memory. Runs as a job; a simulated machine's check runs on CPU ranks "
        "and says so.",
    )  # fmt: skip
    p.add_argument("--gpus", type=gpu_indices, metavar="0,1", help="only these GPUs (default: all)")
    p.add_argument(
        "--deadline", type=float, metavar="S", help="seconds an all-reduce may take before it counts as hung"
    )
    p.add_argument("--show", action="store_true", help="print the stored check instead of running one")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from rigpilot.engine.api.client import EngineClient
    from rigpilot.engine.cli.commands import follow, print_notice

    if args.deadline is not None and not 1 <= args.deadline <= 600:
        raise UserError("--deadline takes seconds from 1 to 600")
    with EngineClient(on_notice=print_notice) as c:
        if not args.show:
            req: dict[str, Any] = {"gpus": args.gpus or None}
            if args.deadline is not None:
                req["deadline_s"] = args.deadline
            job = c.request("doctor_start", **req)["job"]
            if not args.json:
                print(f"machine check started: job {job['id']} on GPUs {', '.join(map(str, job['gpus']))}", flush=True)
                follow(c, job["id"])
            else:
                _wait_job(c, job["id"])
        answer = _wait_kept(c)
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0 if answer["report"] else 1
    if answer["report"] is None:
        raise UserError(WHY_NONE.get(answer.get("why") or "never", "no machine check is stored"))
    report = DoctorReport.from_dict(answer["report"], "the engine's machine check")
    print("\n".join(text_lines(report)))
    return 1 if report.worst == "fail" else 0


def _wait_job(client: Any, job_id: str) -> None:
    from rigpilot.engine.schema import TERMINAL_STATES

    while client.request("job", job=job_id)["job"]["state"] not in TERMINAL_STATES:
        time.sleep(0.5)


def _wait_kept(client: Any) -> dict[str, Any]:
    """The stored report, once the engine has completed and kept the check that just ended."""
    end = time.monotonic() + KEEP_WAIT_S
    while True:
        answer = client.request("doctor_report")
        if answer.get("running") is None or time.monotonic() > end:
            return answer
        time.sleep(0.3)


def text_lines(r: DoctorReport) -> list[str]:
    when = r.measured_at.replace("T", " ").replace("Z", " UTC")
    where = r.machine.get("label") or "this machine"
    lines = [f"Machine check of {where}: {when} (the checks took {r.duration_s:.0f} s)"]
    if r.simulated:
        lines.append(f"  simulated: CPU ranks over {r.backend or 'gloo'}; every figure below is the CPU's, not a GPU's")
    if not r.complete and r.stopped:
        check = (r.stopped.fields or {}).get("check") or r.stopped.code
        on = ",".join(map(str, r.stopped.gpus))
        lines.append(f"  stopped early: {check} on GPUs {on} did not finish; the checks after it were not run")
    lines.append("")
    if r.findings:
        lines.append("Found:")
        lines += [f"  {MARK[f.severity]} {describe(f)}" for f in r.findings]
    else:
        lines.append("Found nothing wrong.")
    lines += ["", *_table(GPU_COLUMNS, gpu_rows(r))]
    if r.pairs:
        lines += ["", *_table(PAIR_COLUMNS, pair_rows(r))]
    lines += [text for _, text in group_lines(r)]
    action = action_line(r)
    if action:
        lines += ["", action]
    return lines


def _table(columns: list[str], rows: list[list[Cell]]) -> list[str]:
    """The app's table as plain columns (the same cells, so the same words)."""
    texts = [[c.text for c in row] for row in rows]
    widths = [max(len(x) for x in col) for col in zip(columns, *texts, strict=True)]
    return ["  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip() for line in [columns, *texts]]
