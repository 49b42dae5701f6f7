"""Choosing where machine facts and telemetry come from.

Order: an explicit `--simulate PROFILE`, an explicit `--import FILE...`, then
the real GPUs through NVML. When NVML cannot be used (no driver, no GPU, no
library) the simulated profile from settings stands in, and the reason is
kept as a note that every client shows once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.machine import Machine
from rigpilot.engine.hardware.simulated import SimulatedBackend, load_profile
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
    notes: list[str] = field(default_factory=list)


def open_backend(
    simulate: str | None = None,
    import_paths: list[Path] | None = None,
    settings: Settings | None = None,
) -> Discovery:
    if simulate and import_paths:
        raise UserError("--simulate and --import cannot be used together")
    simulate = simulate or os.environ.get(SIMULATE_ENV) or None
    if simulate:
        backend = SimulatedBackend(load_profile(simulate))
        return Discovery(backend, backend.machine())
    if import_paths:
        from rigpilot.engine.hardware.importers import MachineImportError, import_machine

        try:
            machine = import_machine(list(import_paths))
        except MachineImportError as e:
            raise UserError(str(e)) from e
        return Discovery(StaticBackend(machine), machine, list(machine.notes))

    from rigpilot.engine.hardware.nvml_backend import NvmlBackend, NvmlUnavailable

    try:
        nvml = NvmlBackend()
        machine = nvml.machine()
        if machine.gpus:
            return Discovery(nvml, machine)
        nvml.close()
        reason = "NVML found no GPU"
    except NvmlUnavailable as e:
        reason = str(e)
    settings = settings or Settings.load()
    backend = SimulatedBackend(load_profile(settings.simulated_profile))
    machine = backend.machine()
    note = f"No NVIDIA GPU in use ({reason}); showing {machine.label}. Choose another with --simulate or in Settings."
    return Discovery(backend, machine, [*settings.warnings, note])
