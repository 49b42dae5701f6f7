"""The machine check as the GUI shows it: plain Python from the engine's `doctor_report` answer, no Qt.

One `CheckState` says what there is to show (a report, why there is none, a check running, or an answer that
cannot be read); the functions below turn it into the lines, rows and link marks the view, the Dashboard card
and the Topology page draw. Findings are worded by `describe` (engine/hardware/doctor.py), as the CLI words them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.doctor import DoctorReport, Finding, describe
from rigpilot.engine.hardware.doctor_table import reduce_cell

# A status in the app's words (widgets/style.py): what colour a line or a cell takes.
SEVERITY_STATUS = {"fail": "bad", "warn": "warn", "info": "info"}
WORST_STATUS = {"fail": "bad", "warn": "warn", "ok": "good"}
# Findings that make a link broken on the Topology page (the others concern a GPU, or are slow, not broken).
BROKEN_LINK = ("p2p_corrupt", "all_reduce_hung")
# Why the engine has no report for this machine, in words; the button to check it is beside them.
WHY_NONE = {
    "never": "Not checked yet",
    "driver_changed": "The driver changed since the last check: check again",
    "machine_changed": "This machine changed since the last check: check again",
    "unreadable": "The stored check cannot be read: check again",
}
CHECK_WORDS = {
    "matmul": "matrix multiplication",
    "memory_bandwidth": "memory bandwidth",
    "p2p_copy": "peer-to-peer copies",
    "all_reduce": "all-reduce",
    "nvml_vs_smi": "NVML against nvidia-smi",
    "health": "health",
    "software": "driver and CUDA",
}


@dataclass
class CheckState:
    report: DoctorReport | None = None
    why: str | None = None  # no report: "never", "driver_changed", ...
    running: str | None = None  # the doctor job's id while one runs
    error: str | None = None  # the answer could not be read: one line


@dataclass
class LinkMark:
    """What the Topology page shows on a GPU pair's link from the last check."""

    text: str  # the measured all-reduce ("12.3 GB/s") or "hung after 10 s"
    broken: bool
    tooltip: str
    findings: list[str] = field(default_factory=list)


def state_of(reply: Any) -> CheckState:
    """The engine's `doctor_report` answer as a CheckState; anything malformed is one line in `error`."""
    if not isinstance(reply, dict):
        return CheckState(error="The engine's machine check answer is not an object: check the machine again")
    running = reply.get("running")
    running = str(running) if running else None
    raw = reply.get("report")
    if raw is None:
        why = reply.get("why")
        return CheckState(why=why if isinstance(why, str) else "never", running=running)
    try:
        return CheckState(report=DoctorReport.from_dict(raw, "the engine's machine check"), running=running)
    except UserError as e:
        return CheckState(running=running, error=f"{str(e)[:1].upper()}{str(e)[1:]}")


def problems(report: DoctorReport) -> list[Finding]:
    """Findings that call for attention (fail and warn); `info` ones only explain."""
    return [f for f in report.findings if f.severity in ("fail", "warn")]


def headline(state: CheckState) -> tuple[str, str]:
    """(status, one line): the Dashboard card's text and the view's header, coloured by the worst finding."""
    if state.error:
        return "bad", state.error
    report = state.report
    if report is None:
        if state.running:
            return "info", "Machine check running…"
        return ("info" if state.why in (None, "never") else "warn"), WHY_NONE.get(
            state.why or "never", WHY_NONE["never"]
        )
    found = problems(report)
    status = WORST_STATUS[report.worst]
    if not found:
        return status, "Machine check: nothing wrong found"
    count = f"{len(found)} problem{'s' * (len(found) != 1)}"
    return status, f"Machine check: {count} — {describe(found[0])}"


def measured_line(report: DoctorReport) -> str:
    when = report.measured_at.replace("T", " ").replace("Z", " UTC")
    where = report.machine.get("label") or "this machine"
    line = f"Measured {when} on {where} (the checks took {report.duration_s:.0f} s)"
    if not report.complete and report.stopped is not None:
        line += "; stopped early, the checks after it were not run"
    return line


def simulated_line(report: DoctorReport) -> str:
    """Empty for a real machine; for a simulated one, that every figure is the CPU's."""
    if not report.simulated:
        return ""
    return f"Simulated: CPU ranks over {report.backend or 'gloo'}; every figure is the CPU's, not a GPU's"


def finding_lines(report: DoctorReport) -> list[tuple[str, str]]:
    """(status, words) per finding, worst first; the stopping finding too when it is not among them."""
    found = list(report.findings)
    if report.stopped is not None and not any(_same(report.stopped, f) for f in found):
        found.insert(0, report.stopped)
    return [(SEVERITY_STATUS[f.severity], describe(f)) for f in found]


def _same(a: Finding, b: Finding) -> bool:
    return a.code == b.code and sorted(a.gpus) == sorted(b.gpus)


def link_marks(report: DoctorReport | None) -> dict[tuple[int, int], LinkMark]:
    """Per GPU pair (a < b) the check measured: its all-reduce figure, and whether the link is broken."""
    if report is None:
        return {}
    when = report.measured_at.replace("T", " ").replace("Z", " UTC")
    sim = " (simulated: the CPU's figure)" if report.simulated else ""
    marks = {}
    for p in report.pairs:
        a, b = p.gpus
        words = [describe(f) for f in report.findings if f.code in BROKEN_LINK and sorted(f.gpus) == [a, b]]
        ar = p.check("all_reduce")
        cell = reduce_cell(ar)
        if ar is None and not words:
            continue
        text = cell.text if ar is not None else "broken"
        measured = f"Machine check of {when}: all-reduce {cell.text}{sim}" if ar is not None else ""
        tooltip = "\n".join([*words, measured] if words else [measured])
        marks[(a, b)] = LinkMark(text, bool(words), tooltip.strip(), words)
    return marks


def progress_line(job: dict[str, Any] | None, status: dict[str, Any] | None = None) -> str:
    """What a running check is doing: its job's state, and the latest check its ranks reported."""
    if job is None:
        return "Starting the machine check…"
    state = str(job.get("state") or "queued")
    line = f"Machine check {state} (job {job.get('id')})"
    if state == "queued" and job.get("waiting_for"):
        line += f": waiting for GPU {', '.join(map(str, job['waiting_for']))}"
    elif state == "starting" and job.get("startup_phase"):
        line += f": {job['startup_phase']}"
    if status and status.get("check"):
        what = CHECK_WORDS.get(str(status["check"]), str(status["check"]))
        on = status.get("gpus") if status.get("gpus") is not None else status.get("gpu")
        target = ""
        if isinstance(on, str) and "," in on:
            target = f" between GPUs {on.replace(',', ' and ')}" if on.count(",") == 1 else f" over GPUs {on}"
        elif on is not None:
            target = f" on GPU {on}"
        line += f": checking {what}{target}"
    return line
