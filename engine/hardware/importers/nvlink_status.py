"""Read `nvidia-smi nvlink --status`: which NVLink links of each GPU are up, and at what speed.

    GPU 0: NVIDIA RTX A6000 (UUID: GPU-5baec991-...)
         Link 0: 14.062 GB/s
         Link 1: <inactive>
    GPU 2: NVIDIA RTX A6000 (UUID: GPU-02c05ee3-...)
    NVML: Unable to retrieve NVLink information as all links are inActive

The link lines are indented with a tab or spaces. The speed is per link and direction. A GPU with no link lines (all inactive, or no NVLink) has 0 links.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rigpilot.engine.hardware.importers.common import MachineImportError, mark_unavailable
from rigpilot.engine.hardware.machine import Gpu, Host, Machine, Source

__all__ = ["NvlinkGpuStatus", "looks_like_nvlink_status", "machine_from_nvlink", "merge_nvlink", "parse_nvlink_status"]

_SOURCE = "nvlink --status"
_GPU_LINE = re.compile(r"GPU (\d+): (.*?)(?: \(UUID: ([^)\s]+)\))?")
_LINK_LINE = re.compile(r"Link (\d+): (.*)")
_SPEED = re.compile(r"(\d+(?:\.\d+)?) GB/s")


@dataclass
class NvlinkGpuStatus:
    index: int
    name: str | None
    uuid: str | None
    line: int  # of the "GPU n:" line, for messages
    links: dict[int, float | None] = field(default_factory=dict)  # link -> GB/s, None when inactive
    message: str | None = None  # what NVML said instead of listing links

    @property
    def active_links(self) -> int:
        return sum(1 for speed in self.links.values() if speed is not None)

    @property
    def link_speed_gbps(self) -> float | None:
        """The speed of the slowest active link: what a transfer striped over all of them runs at."""
        speeds = [s for s in self.links.values() if s is not None]
        return min(speeds) if speeds else None


def looks_like_nvlink_status(text: str) -> bool:
    """True for nvlink --status output (and for `nvidia-smi -L`, whose GPU lines are the same)."""
    return any(_GPU_LINE.fullmatch(line.strip()) and "(UUID:" in line for line in text.splitlines())


def parse_nvlink_status(text: str) -> list[NvlinkGpuStatus]:
    """One entry per GPU listed, in file order. Text before the first GPU line (warnings) is skipped."""
    statuses: list[NvlinkGpuStatus] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if m := _GPU_LINE.fullmatch(line):
            index = int(m.group(1))
            if any(s.index == index for s in statuses):
                raise MachineImportError(f"line {lineno}: GPU {index} is listed twice")
            statuses.append(NvlinkGpuStatus(index=index, name=m.group(2) or None, uuid=m.group(3), line=lineno))
        elif not statuses:
            continue
        elif m := _LINK_LINE.fullmatch(line):
            statuses[-1].links[int(m.group(1))] = _speed(m.group(2), lineno)
        elif line.startswith("NVML:"):
            statuses[-1].message = line.removeprefix("NVML:").strip()
        elif line.startswith("MIG "):
            continue  # `nvidia-smi -L` lists MIG instances under their GPU
        else:
            raise MachineImportError(f"line {lineno}: expected 'Link N: ...' or 'GPU N: ...', found {line[:60]!r}")
    if not statuses:
        raise MachineImportError("no 'GPU N: ...' lines in the nvlink --status output")
    return statuses


def _speed(value: str, lineno: int) -> float | None:
    if "inactive" in value.casefold():
        return None
    m = _SPEED.fullmatch(value.strip())
    if not m:
        raise MachineImportError(f"line {lineno}: cannot read the link speed {value!r} (expected like '25 GB/s')")
    return float(m.group(1))


def machine_from_nvlink(statuses: list[NvlinkGpuStatus], origin: str | None = None) -> Machine:
    """A Machine known only from nvlink --status: GPU names, UUIDs and link counts, nothing else."""
    gpus = []
    for status in sorted(statuses, key=lambda s: s.index):
        gpu = Gpu(index=status.index, name=f"GPU {status.index}")
        gpu.unavailable["name"] = f"not in {_SOURCE}"  # until merge_nvlink fills it from the GPU line
        gpus.append(gpu)
    machine = Machine(
        source=Source.IMPORTED,
        host=Host(),
        gpus=gpus,
        origin=origin,
        notes=["nvlink --status has no topology: which GPUs the links join is unknown (import topo -m too)"],
    )
    merge_nvlink(machine, statuses, origin or _SOURCE)
    for gpu in gpus:
        mark_unavailable(gpu, f"not in {_SOURCE}")
    mark_unavailable(machine.host, f"not in {_SOURCE}")
    return machine


def merge_nvlink(machine: Machine, statuses: list[NvlinkGpuStatus], origin: str) -> None:
    """Set `nvlink_links` (and the per-link speed) of the GPUs `statuses` lists; check they are the same GPUs."""
    # `nvidia-smi -L` prints the same GPU lines and nothing else: then the links are unknown, not zero.
    has_link_info = any(s.links or s.message for s in statuses)
    for status in statuses:
        gpu = next((g for g in machine.gpus if g.index == status.index), None)
        if gpu is None:
            known = ", ".join(str(g.index) for g in machine.gpus) or "none"
            raise MachineImportError(
                f"{origin}: line {status.line}: GPU {status.index} is not on the machine the other files describe "
                f"(GPUs {known})"
            )
        _check_same_gpu(gpu, status, origin)
        if not has_link_info:
            continue
        if gpu.nvlink_links is not None and gpu.nvlink_links != status.active_links:
            raise MachineImportError(
                f"{origin}: line {status.line}: GPU {gpu.index} has {status.active_links} active NVLink links "
                f"but another file says {gpu.nvlink_links}"
            )
        gpu.nvlink_links = status.active_links
        gpu.nvlink_link_gbps = status.link_speed_gbps
        gpu.unavailable.pop("nvlink_links", None)
        if gpu.nvlink_link_gbps is None:
            gpu.unavailable["nvlink_link_gbps"] = "no active NVLink link"
        else:
            gpu.unavailable.pop("nvlink_link_gbps", None)
        speeds = {s for s in status.links.values() if s is not None}
        if len(speeds) > 1:
            machine.notes.append(
                f"GPU {gpu.index}: NVLink links run at different speeds "
                f"({', '.join(f'{s:g}' for s in sorted(speeds))} GB/s); kept the slowest"
            )

    listed = {s.index for s in statuses}
    for gpu in machine.gpus:
        if gpu.nvlink_links is not None:
            continue
        if not has_link_info:
            gpu.unavailable["nvlink_links"] = f"{origin} lists GPUs but no NVLink links (a `nvidia-smi -L` list?)"
        elif gpu.index not in listed:
            gpu.unavailable["nvlink_links"] = f"{origin} does not list GPU {gpu.index}"


def _check_same_gpu(gpu: Gpu, status: NvlinkGpuStatus, origin: str) -> None:
    if status.uuid and gpu.uuid and status.uuid != gpu.uuid:
        raise MachineImportError(
            f"{origin}: line {status.line}: GPU {gpu.index} has UUID {status.uuid} here but {gpu.uuid} in another file; "
            "are they from the same machine?"
        )
    # A GPU whose name is unavailable carries a placeholder (topo -m names no GPU); nvlink --status names them.
    if status.name and "name" in gpu.unavailable:
        gpu.name = status.name
        gpu.unavailable.pop("name")
    elif status.name and gpu.name != status.name:
        raise MachineImportError(
            f"{origin}: line {status.line}: GPU {gpu.index} is a {status.name} here but a {gpu.name} in another file; "
            "are they from the same machine?"
        )
    if gpu.uuid is None and status.uuid:
        gpu.uuid = status.uuid
        gpu.unavailable.pop("uuid", None)
