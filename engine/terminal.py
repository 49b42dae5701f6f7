"""Text views of a machine for the terminal: the `gpus` table and the live `watch` frame."""

from __future__ import annotations

import shutil
import time

from rigpilot.engine.hardware.machine import Machine, short_gpu_name
from rigpilot.engine.hardware.telemetry import GpuSample, HostSample, TelemetrySample

NA = "n/a"
MIB = 1024**2
GIB = 1024**3


def _num(v: float | None, fmt: str = "{:.0f}", unit: str = "") -> str:
    return NA if v is None else fmt.format(v) + unit


def _mib(v: int | None) -> str:
    return NA if v is None else f"{v / MIB:.0f}MiB"


def _gib(v: float | None) -> str:
    return NA if v is None else f"{v / GIB:.1f}"


def _rate(bps: float | None) -> str:
    """Bytes per second, compact: '12.5G', '640M', '3k', '0'."""
    if bps is None:
        return NA
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if bps >= div:
            return f"{bps / div:.1f}{unit}" if bps < 100 * div else f"{bps / div:.0f}{unit}"
    return f"{bps:.0f}"


def printable(text: object) -> str:
    """`text` safe to print on a terminal: control and format characters (ANSI escapes, bidi overrides,
    newlines) shown as Python escapes, so a job name cannot move the cursor, recolour or hide output."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in s)


def bar(fraction: float | None, width: int = 10) -> str:
    if fraction is None:
        return "[" + "n/a".center(width) + "]"
    fraction = min(max(fraction, 0.0), 1.0)
    filled = round(fraction * width)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def flags(s: GpuSample) -> str:
    out = []
    if s.health and s.health != "ok":
        out.append(s.health.upper())
    reasons = [r for r in (s.throttle_reasons or []) if r != "idle"]
    out += reasons
    if s.ecc_uncorrected:
        out.append(f"ECC×{s.ecc_uncorrected}")
    return ",".join(out)


def machine_header(machine: Machine) -> str:
    h = machine.host
    parts = [machine.label]
    if h.driver_version:
        parts.append(f"driver {h.driver_version}")
    if h.cuda_driver_version:
        parts.append(f"CUDA {h.cuda_driver_version}")
    return "  ·  ".join(parts)


def gpus_table(machine: Machine, sample: TelemetrySample) -> str:
    """A summary like nvidia-smi's, one line per GPU, then the processes."""
    by_index = {s.index: s for s in sample.gpus}
    names = {g.index: short_gpu_name(g.name) for g in machine.gpus}
    name_w = max([len("Name"), *(len(n) for n in names.values())])
    head = f"{'GPU':>3}  {'Name':<{name_w}}  {'Bus-Id':<16}  {'Temp':>5}  {'Power':>11}  {'Memory-Usage':>21}  {'Util':>4}  {'Fan':>4}  Flags"
    lines = [machine_header(machine), "", head, "-" * len(head)]
    for g in machine.gpus:
        s = by_index.get(g.index, GpuSample(index=g.index))
        power = f"{_num(s.power_w, unit='W')} / {_num(s.power_limit_w or g.power_limit_w, unit='W')}"
        mem = f"{_mib(s.memory_used)} / {_mib(s.memory_total or g.memory_total)}"
        lines.append(
            f"{g.index:>3}  {names[g.index]:<{name_w}}  {(g.pci_bus_id or NA):<16}  {_num(s.temperature_c, unit='C'):>5}  "
            f"{power:>11}  {mem:>21}  {_num(s.gpu_util, unit='%'):>4}  {_num(s.fan_pct, unit='%'):>4}  {flags(s)}"
        )
    procs = [(s.index, p) for s in sample.gpus for p in (s.processes or [])]
    lines += ["", "Processes:"]
    if procs:
        lines.append(f"{'GPU':>5}  {'PID':>8}  {'User':<10}  {'GPU Memory':>10}  Command")
        for i, p in procs:
            lines.append(f"{i:>5}  {p.pid:>8}  {(p.user or NA):<10}  {_mib(p.used_memory):>10}  {p.command or NA}")
    elif all(s.processes is None for s in sample.gpus):
        reasons = {r for s in sample.gpus if (r := s.unavailable.get("processes")) is not None}
        lines.append(f"  {NA} ({', '.join(sorted(reasons))})" if reasons else f"  {NA}")
    else:
        lines.append("  No running processes found")
    return "\n".join(lines)


def _host_line(h: HostSample | None) -> str:
    if h is None:
        return ""
    cpu = sum(h.cpu_percent) / len(h.cpu_percent) if h.cpu_percent else None
    return (
        f"Host  CPU {bar(None if cpu is None else cpu / 100, 20)} {_num(cpu, unit='%'):>4} ({len(h.cpu_percent)} threads)   "
        f"RAM {_gib(h.memory_used)}/{_gib(h.memory_total)} GiB   swap {_gib(h.swap_used)}/{_gib(h.swap_total)} GiB"
    )


def watch_frame(machine: Machine, sample: TelemetrySample, width: int | None = None) -> str:
    """One screen of the live view."""
    width = width or shutil.get_terminal_size((120, 40)).columns
    stamp = time.strftime("%H:%M:%S", time.localtime(sample.time))
    lines = [f"Rigpilot watch — {machine_header(machine)}   {stamp}   (Ctrl-C to quit)", ""]
    lines.append(
        f"{'GPU':>3}  {'Name':<14} {'Util':<17} {'Memory':<27} {'Temp':>5} {'Power':>11} {'SM clk':>8}"
        f" {'PCIe rx/tx B/s':>15} {'NVLink rx/tx B/s':>17}  Flags"
    )
    by_index = {s.index: s for s in sample.gpus}
    for g in machine.gpus:
        s = by_index.get(g.index, GpuSample(index=g.index))
        total = s.memory_total or g.memory_total
        mem_frac = s.memory_used / total if (s.memory_used is not None and total) else None
        util = None if s.gpu_util is None else s.gpu_util / 100
        lines.append(
            f"{g.index:>3}  {short_gpu_name(g.name)[:14]:<14} {bar(util)} {_num(s.gpu_util, unit='%'):>4}  "
            f"{bar(mem_frac)} {_gib(s.memory_used):>5}/{_gib(total):<5}GiB"
            f"{_num(s.temperature_c, unit='C'):>5} {_num(s.power_w, unit='W'):>5}/{_num(s.power_limit_w, unit='W'):<5} "
            f"{_num(s.sm_clock_mhz, unit='MHz'):>8} {_rate(s.pcie_rx_bps):>7}/{_rate(s.pcie_tx_bps):<7} "
            f"{_rate(s.nvlink_rx_bps):>8}/{_rate(s.nvlink_tx_bps):<8}  {flags(s)}"
        )
    lines += ["", _host_line(sample.host)]
    procs = [(s.index, p) for s in sample.gpus for p in (s.processes or [])]
    if procs:
        lines += ["", f"{'GPU':>5}  {'PID':>8}  {'User':<10}  {'GPU Memory':>10}  Command"]
        lines += [f"{i:>5}  {p.pid:>8}  {(p.user or NA):<10}  {_mib(p.used_memory):>10}  {p.command or NA}" for i, p in procs]
    return "\n".join(line[:width] for line in lines)
