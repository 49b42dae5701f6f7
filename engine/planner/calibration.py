"""The calibration file: what `rigpilot run calibrate` measured, as `rigpilot plan --calibration` and the engine read it.

One versioned format (`rigpilot.calibration/1`), written by the calibrate job
(engine/workers/calibrate.py) and read here:

    {
      "schema": "rigpilot.calibration/1",
      "measured_at": "2026-11-23T20:55:00Z",
      "simulated": false,               # true: CPU ranks over gloo, not the GPUs
      "device_type": "cuda", "backend": "nccl", "precision": "bf16",
      "machine": {"gpus": {"0": "NVIDIA H100 80GB HBM3", ...}, "gpu_count": 8, "driver": "550.90.07"},
      "matmul_tflops": {"bf16": {"0": 640.2, ...}, "fp32": {...}},   # dtype -> GPU index -> TFLOP/s
      "bus_bandwidth_gbs": {"0,1,2,3,4,5,6,7": 360.5},                # GPU group -> all-reduce busbw
      "p2p_gbs": {"0->1": 310.0, ...},                                 # ordered pair -> send/recv GB/s
      "detail": {...}                                                  # the raw rows, for people
    }

Applied to a plan (`apply`): matmul TFLOP/s in the plan's dtype replaces the
compute prior of the GPUs measured, bus bandwidth replaces the link priors of
the groups measured. A calibration measured on CPU ranks is labelled and not
applied to GPU predictions. One measured on other GPUs than the machine planned
for is refused: its numbers describe another machine, and applying them would
make every prediction wrong without a sign of it; calibrating again takes a minute.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.machine import Machine, short_gpu_name
from rigpilot.engine.hardware.specs import match_spec
from rigpilot.engine.planner.links import Calibration
from rigpilot.engine.schema import Precision

SCHEMA = "rigpilot.calibration/1"
DTYPES = tuple(p.value for p in Precision)  # what a calibration measures: each dtype a job can compute in
NOT_CALIBRATED = "Not calibrated: speeds come from spec-sheet peaks and priors (see 'Numbers used')."


@dataclass
class MachineCalibration:
    measured_at: str  # ISO 8601, UTC
    simulated: bool
    gpus: dict[int, str]  # machine GPU index -> the device name the rank on it reported
    device_type: str = "cuda"
    backend: str = "nccl"
    precision: str = "bf16"
    gpu_count: int | None = None  # GPUs on the machine when measured
    driver: str | None = None
    matmul_tflops: dict[str, dict[int, float]] = field(default_factory=dict)
    bus_bandwidth_gbs: dict[str, float] = field(default_factory=dict)
    p2p_gbs: dict[str, float] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)

    # -- JSON ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "measured_at": self.measured_at,
            "simulated": self.simulated,
            "device_type": self.device_type,
            "backend": self.backend,
            "precision": self.precision,
            "machine": {
                "gpus": {str(k): v for k, v in sorted(self.gpus.items())},
                "gpu_count": self.gpu_count,
                "driver": self.driver,
            },
            "matmul_tflops": {d: {str(k): v for k, v in sorted(by.items())} for d, by in self.matmul_tflops.items()},
            "bus_bandwidth_gbs": dict(self.bus_bandwidth_gbs),
            "p2p_gbs": dict(self.p2p_gbs),
            "detail": self.detail,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "calibration") -> MachineCalibration:
        """Parse and check; anything wrong is one UserError line naming `where`."""
        if not isinstance(d, dict):
            raise UserError(f"{where} must hold a JSON object")
        if d.get("schema") != SCHEMA:
            got = f"schema {d['schema']!r}" if "schema" in d else "no schema"
            raise UserError(f"{where} is not a Rigpilot calibration ({got}, expected {SCHEMA!r}); "
                            "measure one with `rigpilot run calibrate`")  # fmt: skip
        try:
            machine = d["machine"]
            measured_at = str(d["measured_at"])
            parse_time(measured_at)
            simulated = d["simulated"]
            if not isinstance(simulated, bool):
                raise ValueError("simulated must be true or false")
            gpus = {int(k): str(v) for k, v in machine["gpus"].items()}
            count = machine.get("gpu_count")
            mm = {
                str(dtype): {int(k): float(v) for k, v in by.items()}
                for dtype, by in (d.get("matmul_tflops") or {}).items()
            }
            bw = {_group_key(k): float(v) for k, v in (d.get("bus_bandwidth_gbs") or {}).items()}
            p2p = {str(k): float(v) for k, v in (d.get("p2p_gbs") or {}).items()}
            detail = d.get("detail")
            cal = cls(
                measured_at=measured_at,
                simulated=simulated,
                gpus=gpus,
                device_type=str(d.get("device_type") or ("cpu" if simulated else "cuda")),
                backend=str(d.get("backend") or ""),
                precision=str(d.get("precision") or "bf16"),
                gpu_count=None if count is None else int(count),
                driver=None if machine.get("driver") is None else str(machine["driver"]),
                matmul_tflops=mm,
                bus_bandwidth_gbs=bw,
                p2p_gbs=p2p,
                detail=detail if isinstance(detail, dict) else {},
            )
        except KeyError as e:
            raise UserError(f"{where} lacks {e.args[0]!r}; measure it again with `rigpilot run calibrate`") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise UserError(f"{where} is malformed: {e}") from None
        unknown = sorted(set(mm) - set(DTYPES))
        if unknown:
            raise UserError(f"{where}: unknown dtype {unknown[0]!r} in matmul_tflops (use {', '.join(DTYPES)})")
        figures = [v for by in mm.values() for v in by.values()] + list(bw.values()) + list(p2p.values())
        if any(not math.isfinite(v) or v <= 0 for v in figures):
            raise UserError(f"{where}: calibration figures must be positive")
        return cal

    @classmethod
    def load(cls, path: Path) -> MachineCalibration:
        from rigpilot.engine.argtypes import read_json_object

        return cls.from_dict(read_json_object(Path(path), "calibration"), f"calibration {path}")

    # -- what it says ------------------------------------------------------------------------------
    @property
    def date(self) -> str:
        return parse_time(self.measured_at).strftime("%Y-%m-%d")

    def mismatch(self, machine: Machine) -> str | None:
        """Why these numbers are not this machine's (other GPUs, another count), or None."""
        if self.gpu_count is not None and self.gpu_count != len(machine.gpus):
            return f"it was measured on a machine with {self.gpu_count} GPUs; this one has {len(machine.gpus)}"
        have = {g.index: g for g in machine.gpus}
        for index, name in sorted(self.gpus.items()):
            gpu = have.get(index)
            if gpu is None:
                return f"it measured GPU {index}, which this machine does not have"
            if not _same_model(name, gpu.name, gpu.memory_total):
                return f"it measured GPU {index} as {short_gpu_name(name)}; here GPU {index} is {short_gpu_name(gpu.name)}"
        return None

    def numbers(self, dtype: str) -> Calibration:
        """The figures that replace priors for a plan in `dtype`."""
        return Calibration(dict(self.matmul_tflops.get(dtype, {})), dict(self.bus_bandwidth_gbs))

    def summary(self, dtype: str) -> str:
        """'matmul 312 TFLOPS bf16, all-reduce 0,1: 180 GB/s'."""
        parts = []
        by = self.matmul_tflops.get(dtype) or {}
        if by:
            lo, hi = min(by.values()), max(by.values())
            span = _num(hi) if _num(lo) == _num(hi) else f"{_num(lo)}–{_num(hi)}"
            parts.append(f"matmul {span} TFLOPS {dtype}")
        elif self.matmul_tflops:
            have = ", ".join(sorted(self.matmul_tflops))
            parts.append(f"matmul measured in {have} only (the {dtype} prior stays)")
        parts += [f"all-reduce {k}: {_num(v)} GB/s" for k, v in sorted(self.bus_bandwidth_gbs.items())]
        return ", ".join(parts) if parts else "no figures"


@dataclass(frozen=True)
class CalibrationStatus:
    """How a calibration bears on a plan: what the plan says about it, and whether its numbers were used."""

    state: str  # "applied" | "simulated" | "other-machine" | "none"
    line: str
    measured_at: str | None = None

    @property
    def applied(self) -> bool:
        return self.state == "applied"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"applied": self.applied}


def apply(
    cal: MachineCalibration | None, machine: Machine, dtype: str, *, strict: bool = True,
    checked: MachineCalibration | None = None,
) -> tuple[Calibration | None, CalibrationStatus]:
    """The numbers a search should use, and the line saying so.

    strict: a calibration of another machine is refused (UserError), as for a file the user named;
    otherwise (the engine's stored calibration after a GPU was swapped) it is left out and the line says why.
    checked: what the machine check measured on this machine's GPUs (engine.planner.machine_check, which
    leaves out a simulated check's or another machine's): it counts beside the calibration, the newer
    measurement of each figure winning (`newer_wins`).
    """
    numbers, status = _apply(cal, machine, dtype, strict=strict)
    if checked is None:
        return numbers, status
    if status.applied and cal is not None:
        both = newer_wins(cal, checked)
        line = (f"Calibrated {cal.date} and machine check of {checked.date} (both measured on this machine; "
                f"the newer figure of each wins): {both.summary(dtype)}.")  # fmt: skip
        return both.numbers(dtype), CalibrationStatus("applied", line, both.measured_at)
    line = f"Machine check of {checked.date} (measured on this machine): {checked.summary(dtype)}."
    if status.state != "none":
        line += " " + status.line
    return checked.numbers(dtype), CalibrationStatus("applied", line, checked.measured_at)


def newer_wins(a: MachineCalibration, b: MachineCalibration) -> MachineCalibration:
    """Two measurements of one machine as one: each figure (a GPU's matmul rate in a dtype, a group's all-reduce
    bus bandwidth, a pair's copy rate) from the newer of the two where both measured it, else from the one that did.

    Per figure, not per file: a calibrate job measures matmuls in every dtype and the all-GPU group, the machine
    check every pair and the all-GPU group, so neither replaces the other whole; and a figure measured again
    later (a driver update, a card reseated) describes the machine as it is now.
    """
    old, new = sorted((a, b), key=lambda c: parse_time(c.measured_at))
    matmul = {d: dict(by) for d, by in old.matmul_tflops.items()}
    for d, by in new.matmul_tflops.items():
        matmul.setdefault(d, {}).update(by)
    return dataclasses.replace(
        new, gpus={**old.gpus, **new.gpus}, matmul_tflops=matmul,
        bus_bandwidth_gbs={**old.bus_bandwidth_gbs, **new.bus_bandwidth_gbs}, p2p_gbs={**old.p2p_gbs, **new.p2p_gbs},
        detail={"measured_at": [old.measured_at, new.measured_at]},
    )  # fmt: skip


def _apply(
    cal: MachineCalibration | None, machine: Machine, dtype: str, *, strict: bool
) -> tuple[Calibration | None, CalibrationStatus]:
    if cal is None:
        return None, CalibrationStatus("none", NOT_CALIBRATED)
    if cal.simulated or cal.device_type != "cuda":
        return None, CalibrationStatus(
            "simulated",
            f"Calibrated {cal.date} on CPU ranks ({cal.backend or 'gloo'}, a simulated machine): "
            "not applied to GPU predictions.",
            cal.measured_at,
        )
    wrong = cal.mismatch(machine)
    if wrong:
        if strict:
            raise UserError(f"this calibration is not of this machine: {wrong}; run `rigpilot run calibrate` here")
        return None, CalibrationStatus(
            "other-machine", f"Calibration of {cal.date} not applied: {wrong}; calibrate again.", cal.measured_at
        )
    line = f"Calibrated {cal.date} (measured on this machine): {cal.summary(dtype)}."
    return cal.numbers(dtype), CalibrationStatus("applied", line, cal.measured_at)


def apply_stored(
    raw: dict[str, Any] | None, machine: Machine, dtype: str, *, checked: MachineCalibration | None = None
) -> tuple[Calibration | None, CalibrationStatus]:
    """`apply` for the engine's stored calibration (JSON as kept): one that cannot be read is said and left out."""
    cal = None
    if raw is not None:
        try:
            if "unreadable" in raw and "schema" not in raw:
                raise UserError(str(raw["unreadable"]))
            cal = MachineCalibration.from_dict(raw, "the engine's stored calibration")
        except UserError as e:
            unreadable = CalibrationStatus("unreadable", f"Calibration not applied: {e}; calibrate again.")
            if checked is None:
                return None, unreadable
            numbers, status = apply(None, machine, dtype, strict=False, checked=checked)
            return numbers, dataclasses.replace(status, line=f"{status.line} {unreadable.line}")
    return apply(cal, machine, dtype, strict=False, checked=checked)


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> datetime.datetime:
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"measured_at {text!r} is not an ISO 8601 time") from None


def _group_key(key: Any) -> str:
    indices = sorted({int(x) for x in str(key).replace(" ", "").split(",") if x})
    if len(indices) < 2:
        raise ValueError(f"bus bandwidth group {key!r} needs two GPUs or more")
    return ",".join(map(str, indices))


def _same_model(measured: str, here: str, memory: int | None) -> bool:
    if measured.strip().lower() == here.strip().lower():
        return True
    a, b = match_spec(measured, None), match_spec(here, memory)
    return a is not None and b is not None and a.key == b.key


def _num(v: float) -> str:
    return f"{v:,.0f}" if v >= 10 else f"{v:.3g}"
