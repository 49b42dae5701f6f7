"""What the machine check (`rigpilot doctor`, engine/hardware/doctor.py) changes in a plan.

Links. Where the check found a pair's peer path broken or slow (`p2p_off_pairs`: wrong data, a hung all-reduce,
copies slower than through host memory), every job on both GPUs of the pair runs with NCCL_P2P_DISABLE=1
(engine.jobs.submission). That variable is the job's, not the pair's: NCCL then sends the traffic of every pair
of the job, NVLink included, through host memory. The planner plans what will run: when the GPUs planned for hold
such a pair, every pair among them is planned without P2P and without NVLink (the host-bounce link of
links._pair_link, or the socket link for SYS pairs), and the explanation says which finding did it. An inference
plan on fewer GPUs that leaves the pair out would keep P2P when it runs; it is planned as the selection is, the
cautious side.

Figures. A check of real GPUs (not simulated, CUDA) measured what a calibrate job measures, in the same shape
(`calibration_from_doctor`): each GPU's matmul TFLOP/s per dtype, each pair's all-reduce bus bandwidth as group
"a,b", and the all-GPU group's. It counts beside the stored calibration, the newer measurement of each figure
winning (calibration.newer_wins). Bandwidths measured over a pair whose P2P the engine turns off were measured
with P2P on and describe no job that will run: they are left out. A simulated check's figures are the CPU's
and describe no GPU: only its findings count.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.doctor import (
    Check,
    DoctorReport,
    Finding,
    describe,
    figure,
    nccl_env_for,
    p2p_off_pairs,
)
from rigpilot.engine.hardware.machine import P2P, Machine
from rigpilot.engine.planner.calibration import DTYPES, MachineCalibration, parse_time

# The checks whose figures count: a warning (a slow GPU, say) still measured; a failure or a timeout did not.
MEASURED = ("ok", "warn")


@dataclass
class MachineCheckUse:
    """A plan's view of the stored machine check: the machine to plan for, the figures it measured, and the
    lines the plan's explanation ends with."""

    machine: Machine
    calibration: MachineCalibration | None = None  # for calibration.apply(checked=...)
    lines: list[str] = field(default_factory=list)
    p2p_off: list[Finding] = field(default_factory=list)  # the findings that turned P2P off for the GPUs planned


def use(raw: dict[str, Any] | None, machine: Machine, gpus: list[int] | None = None) -> MachineCheckUse:
    """What the engine's stored machine check (its JSON, as doctor_store.latest gives it; None: never checked)
    means for a plan on `gpus` (None: all) of `machine`. One that cannot be read is said and left out."""
    if raw is None:
        return MachineCheckUse(machine)
    try:
        report = DoctorReport.from_dict(raw, "the engine's stored machine check")
    except UserError as e:
        return MachineCheckUse(machine, lines=[f"Machine check not used: {e}."])
    chosen = (
        [g.index for g in machine.gpus] if gpus is None else [g for g in gpus if g in {x.index for x in machine.gpus}]
    )
    planned, off = planned_machine(machine, report, chosen)
    where = _source(report)
    lines = [f"{where}: {describe(f)}; this plan counts every link among GPUs {_list(chosen)} through host memory."
             for f in off]  # fmt: skip
    planned.notes = [*planned.notes, *lines]
    measured = calibration_from_doctor(report)
    if measured is not None:
        wrong = measured.mismatch(machine)
        if wrong:
            lines.append(f"{where} not used for speeds: {wrong}; check the machine again.")
            measured = None
    return MachineCheckUse(planned, measured, lines, off)


def planned_machine(machine: Machine, report: DoctorReport | None, gpus: list[int]) -> tuple[Machine, list[Finding]]:
    """`machine` as a job on `gpus` sees it after the check: without P2P or NVLink between any two of them when
    the check turns NCCL's P2P off for that job (nccl_env_for, the launcher's own rule); and the findings why."""
    env, why = nccl_env_for(report, gpus)
    if not env:
        return machine, []
    chosen = set(gpus)
    pairs = [
        dataclasses.replace(p, nvlink_count=0, nvlink_gen=None, nvswitch=False, p2p_read=P2P.UNSUPPORTED,
                            p2p_write=P2P.UNSUPPORTED)
        if p.a in chosen and p.b in chosen else p
        for p in machine.pairs
    ]  # fmt: skip
    return dataclasses.replace(machine, pairs=pairs, notes=list(machine.notes)), why


def calibration_from_doctor(report: DoctorReport) -> MachineCalibration | None:
    """The check's measured figures in the calibration file's shape, or None: a simulated check (CPU figures),
    or one that measured nothing that counts."""
    if report.simulated or report.device_type != "cuda":
        return None
    off = p2p_off_pairs(report)
    matmul: dict[str, dict[int, float]] = {}
    for g in report.gpus:
        c = g.check("matmul")
        if c is None or c.status not in MEASURED:
            continue
        for dtype, v in (c.figures.get("tflops") or {}).items():
            tflops = figure(v)
            if dtype in DTYPES and tflops is not None:
                matmul.setdefault(dtype, {})[g.gpu] = tflops
    bus: dict[str, float] = {}
    for p in report.pairs:
        v = _busbw(p.check("all_reduce"))
        if v is not None and tuple(p.gpus) not in off:
            bus[f"{p.gpus[0]},{p.gpus[1]}"] = v
    for grp in report.groups:
        v = _busbw(grp.check("all_reduce"))
        members = sorted(set(grp.gpus))
        if v is not None and len(members) > 1 and not any(a in members and b in members for a, b in off):
            bus[",".join(map(str, members))] = v
    if not matmul and not bus:
        return None
    names = {g.gpu: g.name for g in report.gpus if g.name}
    if not names:
        names = {int(k): str(v) for k, v in (report.machine.get("gpus") or {}).items()}
    try:
        parse_time(report.measured_at)
    except ValueError:
        return None  # it cannot be weighed against a calibration: the findings still count
    return MachineCalibration(
        measured_at=report.measured_at, simulated=False, gpus=names, device_type=report.device_type,
        backend=report.backend, driver=report.machine.get("driver"), matmul_tflops=matmul, bus_bandwidth_gbs=bus,
        detail={"source": "machine check"},
    )  # fmt: skip


def _busbw(c: Check | None) -> float | None:
    if c is None or c.status not in MEASURED:
        return None
    return figure(c.figures.get("busbw_gbs"))


def _source(report: DoctorReport) -> str:
    date = report.measured_at[:10]
    return f"Machine check of {date} (simulated, on CPU ranks)" if report.simulated else f"Machine check of {date}"


def _list(gpus: list[int]) -> str:
    return ", ".join(map(str, gpus))
