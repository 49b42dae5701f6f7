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
from rigpilot.engine.hardware.machine import short_gpu_name
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
    lines += [
        "",
        f"{'GPU':<4} {'name':<16} {'matmul TFLOP/s (share of peak)':<50} {'memory GB/s (peak)':<20} {'nvidia-smi':<11} health",
    ]
    for g in r.gpus:
        mm = g.check("matmul")
        flops = ""
        if mm:
            peaks = mm.figures.get("peak_tflops") or {}
            # "bf16 150 (91%)": the share of the spec sheet's peak is what says whether a GPU is well
            flops = "  ".join(
                f"{d} {_n(v)}" + (f" ({v / peaks[d]:.0%})" if peaks.get(d) else "")
                for d, v in (mm.figures.get("tflops") or {}).items()
            )
        mem = g.check("memory_bandwidth")
        membw = ""
        if mem:
            membw = _n(mem.figures.get("gbs")) + (
                f" ({_n(mem.figures['peak_gbs'])})" if mem.figures.get("peak_gbs") else ""
            )
        smi, health = g.check("nvml_vs_smi"), g.check("health")
        lines.append(
            f"{g.gpu:<4} {short_gpu_name(g.name)[:16]:<16} {flops:<50} {membw:<20} {_state(smi):<11} {_state(health)}"
        )
    if r.pairs:
        lines += [
            "",
            f"{'GPUs':<6} {'link':<5} {'P2P (driver)':<13} {'copy':<6} {'peer GB/s (host)':<18} all-reduce GB/s",
        ]
        for p in r.pairs:
            copy, ar = p.check("p2p_copy"), p.check("all_reduce")
            if copy is None or copy.status == "timeout":
                correct, speed = ("-" if copy is None else "hung"), "-"
            else:
                correct = "ok" if copy.figures.get("correct") else "WRONG"
                speed = f"{_n(copy.figures.get('gbs'))} ({_n(copy.figures.get('host_gbs'))})"
            if ar is None:
                reduce = "not run"
            elif ar.status == "timeout":
                reduce = f"hung (> {_n(ar.figures.get('deadline_s'))} s)"
            else:
                reduce = _n(ar.figures.get("busbw_gbs"))
            lines.append(
                f"{p.gpus[0]}-{p.gpus[1]:<4} {p.link or '?':<5} {p.p2p_reported:<13} {correct:<6} {speed:<18} {reduce}"
            )
    for grp in r.groups:
        ar = grp.check("all_reduce")
        if ar is not None:
            figure = "hung" if ar.status == "timeout" else f"{_n(ar.figures.get('busbw_gbs'))} GB/s"
            lines.append(f"all-reduce over GPUs {','.join(map(str, grp.gpus))}: {figure}")
    env = (r.actions or {}).get("nccl_env")
    if env:
        pairs = ", ".join(f"{a}-{b}" for a, b in r.actions.get("pairs") or [])
        setting = " ".join(f"{k}={v}" for k, v in env.items())
        lines += ["", f"Jobs on GPU pairs {pairs} run with {setting} (a job's own setting of it wins)."]
    return lines


def _state(c: Any) -> str:
    if c is None:
        return "-"
    return {"ok": "ok", "warn": "differs" if c.check == "nvml_vs_smi" else "warn", "fail": "FAIL",
            "skipped": "skipped", "timeout": "timeout"}[c.status]  # fmt: skip


def _n(v: Any) -> str:
    if not isinstance(v, (int, float)):
        return "?"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
