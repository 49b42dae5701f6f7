"""The machine check's host half: what NVML and nvidia-smi say, added to what the doctor job's ranks measured.

- nvml_vs_smi: the machine as NVML reads it against `nvidia-smi -q` read by the same importer a user's file
  goes through (engine/hardware/importers), field by field for what both report;
- health: uncorrectable ECC errors, the last XID, throttle reasons, from a fresh telemetry sample;
- each pair's link (the `topo -m` cell) and the P2P state the driver reports.

A simulated machine has no nvidia-smi: its comparison says so (skipped, `simulated`) rather than comparing a
made-up text with itself; its health comes from the simulated backend like every other reading.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from typing import Any

from rigpilot.engine.hardware.doctor import Check, DoctorReport, actions_of, findings_of
from rigpilot.engine.hardware.machine import P2P, Gpu, Machine, Source
from rigpilot.engine.hardware.nvml_backend import NOT_THROTTLING
from rigpilot.engine.hardware.telemetry import GpuSample, Tier

SMI_TIMEOUT_S = 20.0
# The fields both NVML and `nvidia-smi -q` report, with how near two readings must be to count as the same.
COMPARED: dict[str, float] = {
    "name": 0.0,
    "uuid": 0.0,
    "memory_total": 0.01,  # MiB rounding in nvidia-smi's text
    "power_limit_w": 0.01,
    "max_sm_clock_mhz": 0.0,
    "max_mem_clock_mhz": 0.0,
    "pcie_gen_max": 0.0,
    "pcie_width_max": 0.0,
    "ecc_enabled": 0.0,
    "persistence_mode": 0.0,
}


def identity(machine: Machine) -> tuple[str, str | None]:
    """(what this machine is, its driver): a check stands for one machine on one driver."""
    if machine.source is Source.SIMULATED:
        return f"simulated:{machine.profile}", None
    ids = sorted(g.uuid or g.pci_bus_id or f"{g.index}:{g.name}" for g in machine.gpus)
    digest = hashlib.sha256("\n".join([machine.host.hostname or "", *ids]).encode()).hexdigest()[:16]
    return f"{machine.host.hostname or 'this machine'}:{digest}", machine.host.driver_version


def compare_gpus(nvml: Gpu, smi: Gpu) -> list[dict[str, Any]]:
    """Every compared field the two readings both have and disagree on."""
    out = []
    for name, tolerance in COMPARED.items():
        a, b = getattr(nvml, name, None), getattr(smi, name, None)
        if a is None or b is None:
            continue
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            same = abs(a - b) <= tolerance * max(abs(a), abs(b), 1)
        else:
            same = str(a).strip().lower() == str(b).strip().lower()
        if not same:
            out.append({"field": name, "nvml": a, "smi": b})
    return out


def smi_check(nvml: Gpu, smi_machine: Machine | None, why_not: str | None) -> Check:
    if smi_machine is None:
        return Check("nvml_vs_smi", "skipped", 0.0, {}, why_not)
    smi = _same_gpu(nvml, smi_machine)
    if smi is None:
        return Check("nvml_vs_smi", "warn", 0.0, {"disagree": [{"field": "present", "nvml": True, "smi": False}]})
    compared = [n for n in COMPARED if getattr(nvml, n, None) is not None and getattr(smi, n, None) is not None]
    disagree = compare_gpus(nvml, smi)
    return Check("nvml_vs_smi", "warn" if disagree else "ok", 0.0, {"compared": compared, "disagree": disagree})


def _same_gpu(nvml: Gpu, smi_machine: Machine) -> Gpu | None:
    for g in smi_machine.gpus:
        if nvml.uuid and g.uuid and nvml.uuid == g.uuid:
            return g
        if nvml.pci_bus_id and g.pci_bus_id and nvml.pci_bus_id.lower().endswith(g.pci_bus_id.lower()[-12:]):
            return g
    return next((g for g in smi_machine.gpus if g.index == nvml.index), None)


def read_smi() -> tuple[Machine | None, str | None]:
    """This machine as `nvidia-smi -q` describes it, or None and why not (a finding code)."""
    from rigpilot.engine.hardware.importers.smi_query import parse_query_text

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "no_nvidia_smi"
    try:
        out = subprocess.run([exe, "-q"], capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None, "nvidia_smi_failed"
    if out.returncode != 0:
        return None, "nvidia_smi_failed"
    try:
        return parse_query_text(out.stdout, origin="nvidia-smi -q"), None
    except Exception:  # an output this importer cannot read is a skipped comparison, not a failed check
        return None, "nvidia_smi_unreadable"


def health_check(sample: GpuSample | None) -> Check:
    if sample is None:
        return Check("health", "skipped", 0.0, {}, "no_sample")
    ecc = sample.ecc_uncorrected if isinstance(sample.ecc_uncorrected, int) else None
    xid = sample.xid if isinstance(sample.xid, int) else None
    # An idle GPU lowers its clocks without anything being wrong.
    throttle = [r for r in sample.throttle_reasons or [] if r not in NOT_THROTTLING]
    figures = {"ecc_uncorrected": ecc, "xid": xid, "throttle": throttle, "health": sample.health}
    from rigpilot.engine.hardware.health import fault_of

    status = "fail" if fault_of(sample) else "warn" if (throttle or xid) else "ok"
    return Check("health", status, 0.0, figures)


def complete(
    report: DoctorReport, machine: Machine, samples: list[GpuSample], smi: tuple[Machine | None, str | None]
) -> DoctorReport:  # fmt: skip
    """The ranks' half completed with the host's: checks per GPU, each pair's link, findings and actions."""
    by_index = {s.index: s for s in samples}
    smi_machine, why_not = smi
    for gpu in machine.gpus:
        result = report.gpu(gpu.index)
        if result is None:
            continue  # a GPU the check did not run on
        if machine.simulated:  # the ranks ran on the CPU; the report is of the simulated GPUs, labelled simulated
            result.name = gpu.name
        result.checks = [c for c in result.checks if c.check not in ("nvml_vs_smi", "health")]
        result.checks.append(smi_check(gpu, smi_machine, why_not))
        result.checks.append(health_check(by_index.get(gpu.index)))
    for p in report.pairs:
        pair = machine.pair(*p.gpus)
        if pair is not None:
            p.link = pair.topo_code
            if P2P.UNSUPPORTED in (pair.p2p_read, pair.p2p_write):
                p.p2p_reported = "unsupported"
            elif pair.p2p_read is P2P.OK and pair.p2p_write is P2P.OK:
                p.p2p_reported = "ok"
    ident, driver = identity(machine)
    report.machine = {
        **report.machine,
        "identity": ident,
        "label": machine.label,
        "driver": driver,
        "cuda_driver": machine.host.cuda_driver_version,
    }
    report.findings = findings_of(report)
    report.actions = actions_of(report.findings)
    return report


def samples_of(backend: Any) -> list[GpuSample]:
    """A fresh full sample of every GPU, or none when the backend cannot give one."""
    try:
        return list(backend.sample_gpus(Tier.SLOW))
    except Exception:  # a backend that fails now is reported as a skipped health check, not a failed report
        return []
