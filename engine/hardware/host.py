"""The host side of a machine: CPU, sockets, NUMA nodes, RAM (psutil and /sys)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import psutil

from rigpilot.engine.hardware.machine import Host, NumaNode, parse_cpu_list
from rigpilot.engine.hardware.telemetry import HostSample

SYS = Path("/sys")
PROC = Path("/proc")


def read_host(sys_root: Path = SYS, proc_root: Path = PROC) -> Host:
    """Describe this computer. Fields that cannot be read are marked unavailable."""
    host = Host(hostname=socket.gethostname())
    host.cpu_model = _cpu_model(proc_root)
    if host.cpu_model is None:
        host.unavailable["cpu_model"] = "not in /proc/cpuinfo"
    host.threads = psutil.cpu_count(logical=True)
    host.cores = psutil.cpu_count(logical=False)
    host.memory_total = psutil.virtual_memory().total
    host.sockets = _socket_count(sys_root)
    if host.sockets is None:
        host.unavailable["sockets"] = "no CPU topology in /sys"
    host.numa_nodes = read_numa_nodes(sys_root)
    return host


def read_numa_nodes(sys_root: Path = SYS) -> list[NumaNode]:
    nodes = []
    node_dir = sys_root / "devices/system/node"
    for d in sorted(node_dir.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = parse_cpu_list((d / "cpulist").read_text())
        except (OSError, ValueError):
            cpus = []
        nodes.append(NumaNode(id=int(d.name[4:]), cpus=cpus, memory_total=_node_memory(d)))
    if not nodes:  # kernels without NUMA support still have one memory node
        nodes.append(NumaNode(id=0, cpus=list(range(os.cpu_count() or 1)), memory_total=psutil.virtual_memory().total))
    return nodes


def pci_numa_node(bus_id: str, sys_root: Path = SYS) -> int | None:
    """NUMA node of a PCI device from sysfs ('00000000:41:00.0' -> 0); None when unknown (-1)."""
    # sysfs uses a 4-digit domain; NVML reports 8 digits.
    dom, rest = bus_id.lower().split(":", 1)
    path = sys_root / "bus/pci/devices" / f"{int(dom, 16):04x}:{rest}" / "numa_node"
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def read_host_sample() -> HostSample:
    vm = psutil.virtual_memory()
    sw = psutil.swap_memory()
    return HostSample(
        cpu_percent=psutil.cpu_percent(percpu=True),
        memory_used=vm.total - vm.available,
        memory_total=vm.total,
        swap_used=sw.used,
        swap_total=sw.total,
    )


def _cpu_model(proc_root: Path) -> str | None:
    try:
        for line in (proc_root / "cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _socket_count(sys_root: Path) -> int | None:
    ids = set()
    for f in (sys_root / "devices/system/cpu").glob("cpu[0-9]*/topology/physical_package_id"):
        try:
            ids.add(int(f.read_text()))
        except (OSError, ValueError):
            continue
    return len(ids) or None


def _node_memory(node_dir: Path) -> int | None:
    try:
        for line in (node_dir / "meminfo").read_text().splitlines():
            if "MemTotal:" in line:
                return int(line.split()[-2]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
