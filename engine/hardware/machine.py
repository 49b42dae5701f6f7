"""The machine model: what GPUs a host has and how they are wired.

Everything here is plain data (dataclasses) that round-trips through JSON, so
the same `Machine` can come from NVML, a simulated profile or an imported
`nvidia-smi` text and be sent over the engine socket unchanged.

A field that a source could not provide is `None`, and `unavailable[field]`
says why ("not supported", "no permission", "GPU lost", "not in import").
Nothing is ever reported as zero because it was missing.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

SCHEMA_VERSION = 1


class PciePath(StrEnum):
    """How traffic between two devices crosses PCIe, in `nvidia-smi topo -m` terms.

    Ordered from closest to farthest, so `max()` over a group gives its worst hop.
    """

    SELF = "X"
    PIX = "PIX"  # at most one PCIe bridge (a shared switch)
    PXB = "PXB"  # several PCIe bridges, not through the host bridge
    PHB = "PHB"  # through a PCIe host bridge (the CPU)
    NODE = "NODE"  # between host bridges inside one NUMA node
    SYS = "SYS"  # across the SMP interconnect between NUMA nodes (QPI/UPI/xGMI)

    @property
    def rank(self) -> int:
        return _PCIE_ORDER.index(self)

    @property
    def description(self) -> str:
        return PCIE_LEGEND[self.value]


_PCIE_ORDER = list(PciePath)

PCIE_LEGEND = {
    "X": "Self",
    "SYS": "Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)",
    "NODE": "Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node",
    "PHB": "Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)",
    "PXB": "Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)",
    "PIX": "Connection traversing at most a single PCIe bridge",
    "NV#": "Connection traversing a bonded set of # NVLinks",
}


class Source(StrEnum):
    NVML = "nvml"
    SIMULATED = "simulated"
    IMPORTED = "imported"


@dataclass
class NumaNode:
    id: int
    cpus: list[int] = field(default_factory=list)
    memory_total: int | None = None  # bytes


@dataclass
class Host:
    hostname: str | None = None
    cpu_model: str | None = None
    sockets: int | None = None
    cores: int | None = None  # physical
    threads: int | None = None  # logical
    memory_total: int | None = None  # bytes
    numa_nodes: list[NumaNode] = field(default_factory=list)
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # "12.5"
    nvml_version: str | None = None
    unavailable: dict[str, str] = field(default_factory=dict)


@dataclass
class Gpu:
    index: int
    name: str
    uuid: str | None = None
    pci_bus_id: str | None = None  # "00000000:41:00.0"
    memory_total: int | None = None  # bytes
    compute_capability: str | None = None  # "9.0"
    power_limit_w: float | None = None
    max_sm_clock_mhz: int | None = None
    max_mem_clock_mhz: int | None = None
    pcie_gen_current: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_current: int | None = None
    pcie_width_max: int | None = None
    numa_node: int | None = None
    cpu_affinity: list[int] | None = None  # logical CPU ids
    ecc_enabled: bool | None = None
    mig_enabled: bool | None = None
    persistence_mode: bool | None = None
    nvlink_links: int | None = None  # active NVLink links on this GPU
    nvlink_gen: int | None = None
    nvlink_link_gbps: float | None = None  # speed of one link, per direction, as `nvidia-smi nvlink --status` shows
    unavailable: dict[str, str] = field(default_factory=dict)

    def na(self, name: str, reason: str) -> None:
        """Mark a field as not available, with the reason shown to users."""
        setattr(self, name, None)
        self.unavailable[name] = reason


class P2P(StrEnum):
    OK = "ok"
    UNSUPPORTED = "unsupported"
    UNKNOWN = "unknown"


@dataclass
class GpuPair:
    """How GPUs `a` < `b` reach each other."""

    a: int
    b: int
    pcie: PciePath | None = None  # None when only the NVLink relation is known
    nvlink_count: int = 0
    nvlink_gen: int | None = None
    nvswitch: bool = False  # the links go through an NVSwitch fabric
    p2p_read: P2P = P2P.UNKNOWN
    p2p_write: P2P = P2P.UNKNOWN

    @property
    def key(self) -> tuple[int, int]:
        return (self.a, self.b)

    @property
    def topo_code(self) -> str:
        """The cell `nvidia-smi topo -m` prints for this pair."""
        if self.nvlink_count:
            return f"NV{self.nvlink_count}"
        return self.pcie.value if self.pcie else "N/A"


@dataclass
class Nic:
    """A network adapter that appears in a `topo -m` matrix (imported machines)."""

    label: str  # "NIC0" or, on old drivers, the device name itself
    device: str | None = None  # "mlx5_0"
    gpu_paths: dict[int, str] = field(default_factory=dict)  # gpu index -> topo code


@dataclass
class Machine:
    source: Source
    host: Host
    gpus: list[Gpu]
    pairs: list[GpuPair] = field(default_factory=list)
    nics: list[Nic] = field(default_factory=list)
    profile: str | None = None  # simulated profile id
    origin: str | None = None  # imported file name, or "NVML <driver>"
    notes: list[str] = field(default_factory=list)  # what the reader had to guess or skip
    schema_version: int = SCHEMA_VERSION

    # -- lookups -----------------------------------------------------------
    def pair(self, a: int, b: int) -> GpuPair | None:
        if a == b:
            return None
        lo, hi = min(a, b), max(a, b)
        for p in self.pairs:
            if p.a == lo and p.b == hi:
                return p
        return None

    def gpu(self, index: int) -> Gpu:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(f"no GPU {index} on this machine (has {', '.join(str(g.index) for g in self.gpus) or 'none'})")

    @property
    def simulated(self) -> bool:
        """Whether this machine is simulated (its ranks run on the CPU): the one place that decides it. Jobs
        carry it from here (JobSpec.simulated, set at submission); clients holding the JSON ask `is_simulated`."""
        return self.source is Source.SIMULATED

    @property
    def summary_name(self) -> str:
        """'4×RTX 4090', '1×RTX 4090 + 1×RTX 3090', '2×(unnamed)'."""
        counts: dict[str, int] = {}
        for g in self.gpus:
            counts[short_gpu_name(g.name)] = counts.get(short_gpu_name(g.name), 0) + 1
        if not counts:
            return "no GPUs"
        return " + ".join(f"{n}×{name}" for name, n in counts.items())

    @property
    def label(self) -> str:
        """What every view shows as the machine's title; simulated machines say so."""
        if self.source is Source.SIMULATED:
            return f"simulated: {self.summary_name}"
        if self.source is Source.IMPORTED:
            return f"imported: {self.summary_name}" + (f" ({self.origin})" if self.origin else "")
        return f"{self.host.hostname or 'this machine'}: {self.summary_name}"

    # -- JSON --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["source"] = self.source.value
        d["label"] = self.label
        d["pairs"] = [_pair_to_dict(p) for p in self.pairs]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Machine:
        host = d.get("host") or {}
        numa = [NumaNode(**n) for n in host.get("numa_nodes", [])]
        host = Host(**{**{k: v for k, v in host.items() if k in _HOST_FIELDS}, "numa_nodes": numa})
        gpus = [Gpu(**{k: v for k, v in g.items() if k in _GPU_FIELDS}) for g in d.get("gpus", [])]
        pairs = []
        for p in d.get("pairs", []):
            q = {k: v for k, v in p.items() if k in _PAIR_FIELDS}
            q["pcie"] = PciePath(q["pcie"]) if q.get("pcie") else None
            q["p2p_read"] = P2P(q.get("p2p_read", "unknown"))
            q["p2p_write"] = P2P(q.get("p2p_write", "unknown"))
            pairs.append(GpuPair(**q))
        nics = [
            Nic(label=n["label"], device=n.get("device"), gpu_paths={int(k): v for k, v in n.get("gpu_paths", {}).items()})
            for n in d.get("nics", [])
        ]
        return cls(
            source=Source(d["source"]),
            host=host,
            gpus=gpus,
            pairs=pairs,
            nics=nics,
            profile=d.get("profile"),
            origin=d.get("origin"),
            notes=list(d.get("notes", [])),
            schema_version=d.get("schema_version", SCHEMA_VERSION),
        )


def is_simulated(machine: Mapping[str, Any] | None) -> bool:
    """`Machine.simulated` of a machine held as its JSON (Machine.to_dict, as the engine sends it)."""
    return machine is not None and machine.get("source") == Source.SIMULATED.value


def _pair_to_dict(p: GpuPair) -> dict[str, Any]:
    d = dataclasses.asdict(p)
    d["pcie"] = p.pcie.value if p.pcie else None
    d["p2p_read"] = p.p2p_read.value
    d["p2p_write"] = p.p2p_write.value
    d["topo"] = p.topo_code
    return d


_HOST_FIELDS = {f.name for f in dataclasses.fields(Host)}
_GPU_FIELDS = {f.name for f in dataclasses.fields(Gpu)}
_PAIR_FIELDS = {f.name for f in dataclasses.fields(GpuPair)}

_NAME_NOISE = re.compile(r"^(NVIDIA|Tesla|Quadro|GeForce)\s+", re.IGNORECASE)


def short_gpu_name(name: str) -> str:
    """'NVIDIA GeForce RTX 4090' -> 'RTX 4090'; 'Tesla V100S-PCIE-32GB' -> 'V100S-PCIE-32GB'."""
    prev = None
    while prev != name:
        prev, name = name, _NAME_NOISE.sub("", name.strip())
    return name or "(unnamed)"


def parse_cpu_list(text: str) -> list[int]:
    """'0-11,24-35' -> [0..11, 24..35]. Raises ValueError on anything else."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            lo_i, hi_i = int(lo), int(hi)
            if hi_i < lo_i:
                raise ValueError(f"bad CPU range {part!r}")
            cpus.extend(range(lo_i, hi_i + 1))
        else:
            cpus.append(int(part))
    return cpus


def format_cpu_list(cpus: list[int] | None) -> str:
    """[0,1,2,5] -> '0-2,5' (the notation nvidia-smi and the kernel use)."""
    if not cpus:
        return "N/A"
    cpus = sorted(set(cpus))
    runs: list[str] = []
    start = prev = cpus[0]
    for c in [*cpus[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        runs.append(f"{start}-{prev}" if prev != start else f"{start}")
        if c is not None:
            start = prev = c
    return ",".join(runs)
