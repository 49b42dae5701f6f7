"""The machine check's tables, in words and a status per cell: what `rigpilot doctor` prints and the app's
Settings page shows are the same cells, decided here once.

A cell's `status` ("good" | "warn" | "bad" | "info" | None) is how bad it is: the app colours it, the CLI marks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rigpilot.engine.hardware.doctor import DoctorReport, figure, number
from rigpilot.engine.hardware.machine import short_gpu_name

GPU_COLUMNS = ["GPU", "Name", "Matmul TFLOP/s (share of peak)", "Memory GB/s (peak)", "NVML vs nvidia-smi", "Health"]
PAIR_COLUMNS = ["GPUs", "Link", "P2P (driver)", "Copy correct?", "Peer GB/s (host)", "All-reduce GB/s"]


@dataclass
class Cell:
    text: str
    status: str | None = None  # "good" | "warn" | "bad" | "info" | None
    tooltip: str = ""


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
            peer, through_host = figure(gbs), figure(host)
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
            reduce_cell(ar),
        ])  # fmt: skip
    return rows


def group_lines(report: DoctorReport) -> list[tuple[str | None, str]]:
    out: list[tuple[str | None, str]] = []
    for grp in report.groups:
        ar = grp.check("all_reduce")
        if ar is None:
            continue
        cell = reduce_cell(ar)
        out.append((cell.status, f"All-reduce over GPUs {', '.join(map(str, grp.gpus))}: {cell.text}"))
    return out


def action_line(report: DoctorReport) -> str:
    env = (report.actions or {}).get("nccl_env")
    if not env:
        return ""
    pairs = ", ".join(f"{a}–{b}" for a, b in report.actions.get("pairs") or [])
    setting = " ".join(f"{k}={v}" for k, v in env.items())
    return f"Jobs on GPU pairs {pairs} run with {setting} (a job's own setting of it wins)."


def _number(v: Any) -> bool:
    return figure(v) is not None


def _status(check: Any) -> str | None:
    if check is None:
        return None
    return {"ok": None, "warn": "warn", "fail": "bad", "timeout": "bad", "skipped": None}[check.status]


def _not_run(status: str) -> str:
    return {"skipped": "skipped", "timeout": "timed out", "fail": "failed"}.get(status, "—")


def reduce_cell(ar: Any) -> Cell:
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
