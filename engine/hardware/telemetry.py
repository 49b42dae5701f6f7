"""Telemetry samples and the interface every hardware backend implements.

A backend answers two questions: what the machine is (`machine()`, asked once)
and what it is doing now (`sample_gpus(tier)`, asked often). The `Sampler`
in `sampler.py` decides how often each tier is asked for.

Fields follow the same rule as the machine model: `None` plus a reason in
`unavailable` when a GPU cannot tell, never a made-up zero.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol

from rigpilot.engine.hardware.machine import Machine


class Tier(IntEnum):
    """How expensive a field is to read.

    FAST fields are cheap counters read every tick. SLOW fields cost a
    blocking driver call (PCIe throughput samples for ~20 ms), walk the
    process table, or change rarely (ECC counts), so they are read less often
    and carried forward in between.
    """

    FAST = 0
    SLOW = 1


@dataclass
class GpuProcess:
    pid: int
    used_memory: int | None = None  # bytes
    user: str | None = None
    command: str | None = None
    kind: str = "compute"  # "compute" | "graphics"


@dataclass
class GpuSample:
    index: int
    # FAST tier
    gpu_util: float | None = None  # percent
    mem_util: float | None = None  # percent (memory controller busy)
    memory_used: int | None = None  # bytes
    memory_total: int | None = None  # bytes
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    fan_pct: float | None = None
    throttle_reasons: list[str] | None = None  # [] = not throttled
    nvlink_rx_bps: float | None = None  # from counter deltas between ticks
    nvlink_tx_bps: float | None = None
    # SLOW tier
    pcie_rx_bps: float | None = None
    pcie_tx_bps: float | None = None
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    xid: int | None = None  # last XID error seen, if any
    health: str | None = None  # "ok" | "lost" | "xid <n>" | ...
    processes: list[GpuProcess] | None = None
    unavailable: dict[str, str] = field(default_factory=dict)

    def na(self, name: str, reason: str) -> None:
        setattr(self, name, None)
        self.unavailable[name] = reason


SLOW_FIELDS = ("pcie_rx_bps", "pcie_tx_bps", "ecc_corrected", "ecc_uncorrected", "xid", "health", "processes")


@dataclass
class HostSample:
    cpu_percent: list[float] = field(default_factory=list)  # per logical core
    memory_used: int | None = None
    memory_total: int | None = None
    swap_used: int | None = None
    swap_total: int | None = None


@dataclass
class TelemetrySample:
    time: float  # unix seconds
    gpus: list[GpuSample]
    host: HostSample | None = None
    simulated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TelemetrySample:
        gpus = []
        for g in d["gpus"]:
            procs = g.get("processes")
            g = {k: v for k, v in g.items() if k in _GPU_SAMPLE_FIELDS}
            g["processes"] = None if procs is None else [GpuProcess(**p) for p in procs]
            gpus.append(GpuSample(**g))
        host = HostSample(**d["host"]) if d.get("host") else None
        return cls(time=d["time"], gpus=gpus, host=host, simulated=d.get("simulated", False))


_GPU_SAMPLE_FIELDS = {f.name for f in dataclasses.fields(GpuSample)}


class Backend(Protocol):
    """A source of machine facts and GPU telemetry (NVML, simulated, imported)."""

    def machine(self) -> Machine: ...

    def sample_gpus(self, tier: Tier) -> list[GpuSample]:
        """Read the fields of `tier` and every cheaper tier, for every GPU."""
        ...

    def close(self) -> None: ...
