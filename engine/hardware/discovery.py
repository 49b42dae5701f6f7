"""Choosing where machine facts and telemetry come from.

Order: an explicit `--simulate PROFILE`, an explicit `--import FILE...`, then
the real GPUs through NVML. When NVML cannot be used (no driver, no GPU, no
library) the simulated profile from settings stands in, and the reason is
kept as a note that every client shows once: one plain sentence, with the
driver's own words kept apart as detail (a tooltip, the log).

`open_backend` is the one place a machine is chosen: the engine service at
start-up and on `reload_machine`, and the CLI when no engine runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.machine import Machine
from rigpilot.engine.hardware.simulated import SimulatedBackend, served_machine
from rigpilot.engine.hardware.telemetry import Backend, GpuSample, Tier
from rigpilot.engine.settings import Settings

SIMULATE_ENV = "RIGPILOT_SIMULATE"


class StaticBackend:
    """An imported machine: its facts are known, its live state is not."""

    REASON = "imported machine: no live telemetry"

    def __init__(self, machine: Machine):
        self._machine = machine

    def machine(self) -> Machine:
        return self._machine

    def sample_gpus(self, tier: Tier) -> list[GpuSample]:
        out = []
        for g in self._machine.gpus:
            s = GpuSample(index=g.index, memory_total=g.memory_total)
            s.unavailable = {
                name: self.REASON
                for name in GpuSample.__dataclass_fields__
                if name not in ("index", "memory_total", "unavailable")
            }
            out.append(s)
        return out

    def close(self) -> None:
        pass


@dataclass
class Discovery:
    backend: Backend
    machine: Machine
    notes: list[str] = field(default_factory=list)  # for users: plain sentences
    details: list[str] = field(default_factory=list)  # the technical reasons behind the notes, for a tooltip or log


def plain_reason(kind: str) -> str:
    """Why no NVIDIA GPU is used, in a user's words ("No NVIDIA driver found (…)"), from the failure's kind
    (nvml_backend.NvmlFailure)."""
    from rigpilot.engine.hardware.nvml_backend import NvmlFailure

    plain: dict[str, str] = {
        NvmlFailure.DRIVER_MISSING: "No NVIDIA driver found (libnvidia-ml.so.1 is missing)",
        NvmlFailure.DRIVER_NOT_LOADED: "The NVIDIA driver is installed but not loaded",
        NvmlFailure.NO_PERMISSION: "Your user may not use the NVIDIA driver",
        NvmlFailure.VERSION_MISMATCH: "The NVIDIA driver was updated and needs a reboot",
        NvmlFailure.NO_GPU: "The NVIDIA driver found no GPU",
        NvmlFailure.LIBRARY_MISSING: "Rigpilot's NVIDIA library (nvidia-ml-py) is not installed",
    }
    return plain.get(kind, "Rigpilot could not use the NVIDIA driver")


def open_backend(
    simulate: str | None = None,
    import_paths: list[Path] | None = None,
    settings: Settings | None = None,
    gpu_model: str | None = None,
) -> Discovery:
    if simulate and import_paths:
        raise UserError("--simulate and --import cannot be used together")
    if not import_paths:  # an --import the user gave beats the environment's default machine
        simulate = simulate or os.environ.get(SIMULATE_ENV) or None
    if simulate:
        backend = SimulatedBackend(served_machine(simulate))
        return Discovery(backend, backend.machine())
    if import_paths:
        from rigpilot.engine.hardware.importers import MachineImportError, import_machine, with_gpu_model

        try:
            machine = import_machine(list(import_paths))
        except MachineImportError as e:
            raise UserError(str(e)) from e
        if gpu_model:
            machine = with_gpu_model(machine, gpu_model)
        return Discovery(StaticBackend(machine), machine, list(machine.notes))

    from rigpilot.engine.hardware.nvml_backend import NvmlBackend, NvmlFailure, NvmlUnavailable

    try:
        nvml = NvmlBackend()
        machine = nvml.machine()
        if machine.gpus:
            return Discovery(nvml, machine)
        nvml.close()
        kind, reason = NvmlFailure.NO_GPU, "NVML found no GPU"
    except NvmlUnavailable as e:
        kind, reason = e.kind, str(e)
    settings = settings or Settings.load()
    backend = SimulatedBackend(served_machine(settings.simulated_profile))
    machine = backend.machine()
    note = f"{plain_reason(kind)}, so Rigpilot shows a simulated machine, chosen in Settings (rigpilot settings)."
    return Discovery(backend, machine, [*settings.warnings, note], [f"NVIDIA GPUs not used: {reason}"])
