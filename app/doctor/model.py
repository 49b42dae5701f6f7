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
from rigpilot.engine.hardware.machine import short_gpu_name

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
GPU_COLUMNS = ["GPU", "Name", "Matmul TFLOP/s (share of peak)", "Memory GB/s (peak)", "NVML vs nvidia-smi", "Health"]
PAIR_COLUMNS = ["GPUs", "Link", "P2P (driver)", "Copy correct?", "Peer GB/s (host)", "All-reduce GB/s"]


@dataclass
class CheckState:
    report: DoctorReport | None = None
    why: str | None = None  # no report: "never", "driver_changed", ...
    running: str | None = None  # the doctor job's id while one runs
    error: str | None = None  # the answer could not be read: one line


@dataclass
class Cell:
    text: str
    status: str | None = None  # "good" | "warn" | "bad" | "info" | None
    tooltip: str = ""


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


def gpu_rows(report: DoctorReport) -> list[list[Cell]]:
    rows = []
    for g in report.gpus:
        mm, mem = g.check("matmul"), g.check("memory_bandwidth")
        flops = ""
        if mm is not None:
            peaks = mm.figures.get("peak_tflops") or {}
            parts = []
            for dtype, value in (mm.figures.get("tflops") or {}).items():
                peak = peaks.get(dtype)
                share = f" ({value / peak:.0%})" if _number(value) and _number(peak) else ""
                parts.append(f"{dtype} {number(value)}{share}")
            flops = "  ".join(parts) or _not_run(mm.status)
        membw = ""
        if mem is not None:
            peak = mem.figures.get("peak_gbs")
            membw = number(mem.figures.get("gbs")) + (f" ({number(peak)})" if _number(peak) else "")
        rows.append([
            Cell(str(g.gpu)),
            Cell(short_gpu_name(g.name) or g.name, tooltip=g.name),
            Cell(flops or "—", _status(mm)),
            Cell(membw or "—", _status(mem)),
            _smi_cell(g.check("nvml_vs_smi")),
            _health_cell(g.check("health")),
        ])  # fmt: skip
    return rows


def pair_rows(report: DoctorReport) -> list[list[Cell]]:
    rows = []
    for p in report.pairs:
        a, b = p.gpus
        copy, ar = p.check("p2p_copy"), p.check("all_reduce")
        if copy is None:
            correct, speed = Cell("not run"), Cell("—")
        else:
            ok = copy.figures.get("correct")
            mismatched = copy.figures.get("mismatched")
            correct = (Cell("yes", "good") if ok else
                       Cell("WRONG DATA", "bad", f"{mismatched} words differed" if mismatched else "")
                       if ok is False else Cell(_not_run(copy.status), _status(copy)))  # fmt: skip
            gbs, host = copy.figures.get("gbs"), copy.figures.get("host_gbs")
            peer, through_host = _positive(gbs), _positive(host)
            slower = peer is not None and through_host is not None and peer < through_host
            speed = Cell(f"{number(gbs)} ({number(host)})", "warn" if slower and not report.simulated else None,
                         "peer copies are slower than through host memory" if slower else "")  # fmt: skip
        reported = p.p2p_reported
        rows.append([
            Cell(f"{a}–{b}"),
            Cell(p.link or "?"),
            Cell(reported, "info" if reported == "unsupported" else None),
            correct,
            speed,
            _reduce_cell(ar),
        ])  # fmt: skip
    return rows


def group_lines(report: DoctorReport) -> list[tuple[str | None, str]]:
    out: list[tuple[str | None, str]] = []
    for grp in report.groups:
        ar = grp.check("all_reduce")
        if ar is None:
            continue
        cell = _reduce_cell(ar)
        out.append((cell.status, f"All-reduce over GPUs {', '.join(map(str, grp.gpus))}: {cell.text}"))
    return out


def action_line(report: DoctorReport) -> str:
    env = (report.actions or {}).get("nccl_env")
    if not env:
        return ""
    pairs = ", ".join(f"{a}–{b}" for a, b in report.actions.get("pairs") or [])
    setting = " ".join(f"{k}={v}" for k, v in env.items())
    return f"Jobs on GPU pairs {pairs} run with {setting} (a job's own setting of it wins)."


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
        cell = _reduce_cell(ar)
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


# -- cells --------------------------------------------------------------------------------------------
def number(v: Any) -> str:
    if not _number(v):
        return "?"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _positive(v: Any) -> float | None:
    """A figure that means something (a positive number), else None."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v > 0 else None


def _number(v: Any) -> bool:
    return _positive(v) is not None


def _status(check: Any) -> str | None:
    if check is None:
        return None
    return {"ok": None, "warn": "warn", "fail": "bad", "timeout": "bad", "skipped": None}[check.status]


def _not_run(status: str) -> str:
    return {"skipped": "skipped", "timeout": "timed out", "fail": "failed"}.get(status, "—")


def _reduce_cell(ar: Any) -> Cell:
    if ar is None:
        return Cell("not run")
    if ar.status == "timeout":
        return Cell(f"hung after {number(ar.figures.get('deadline_s'))} s", "bad")
    if ar.status == "skipped":
        return Cell("skipped", tooltip=ar.why or "")
    return Cell(f"{number(ar.figures.get('busbw_gbs'))} GB/s", _status(ar))


def _smi_cell(c: Any) -> Cell:
    if c is None:
        return Cell("—")
    if c.status == "skipped":
        why = "no nvidia-smi on a simulated machine" if c.why == "simulated" else (c.why or "")
        return Cell("skipped", tooltip=why)
    disagree = c.figures.get("disagree") or []
    if disagree:
        tip = "\n".join(f"{d.get('field')}: NVML {d.get('nvml')}, nvidia-smi {d.get('smi')}" for d in disagree)
        return Cell(f"{len(disagree)} differ", "warn", tip)
    return Cell("agree", "good", ", ".join(map(str, c.figures.get("compared") or [])))


def _health_cell(c: Any) -> Cell:
    if c is None:
        return Cell("—")
    f = c.figures
    parts = []
    if isinstance(f.get("ecc_uncorrected"), int) and f["ecc_uncorrected"] > 0:
        parts.append(f"{f['ecc_uncorrected']} ECC errors")
    if isinstance(f.get("xid"), int) and f["xid"] > 0:
        parts.append(f"XID {f['xid']}")
    if f.get("throttle"):
        parts.append("throttled: " + ", ".join(map(str, f["throttle"])))
    if not parts:
        return Cell(
            "ok" if c.status == "ok" else _not_run(c.status), _status(c) or ("good" if c.status == "ok" else None)
        )
    return Cell("; ".join(parts), _status(c) or "warn")
