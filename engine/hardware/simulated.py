"""Simulated machines: GPU workstations described by data files in resources/machines.

They stand in for real GPUs wherever none are present, so every flow (topology,
planning, jobs, charts) can run and be tested on a CPU. Their telemetry evolves
over time with first-order lags (utilisation in about a second, power in a few,
temperature in tens of seconds) and reacts to load that the engine reports for
the jobs it runs on them. Everything built from them says "simulated".
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rigpilot import resources
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.doctor import LINK_FAULTS
from rigpilot.engine.hardware.health import fault_of, parse_simulated_fault
from rigpilot.engine.hardware.machine import (
    P2P,
    Gpu,
    GpuPair,
    Host,
    Machine,
    NumaNode,
    PciePath,
    Source,
    parse_cpu_list,
)
from rigpilot.engine.hardware.telemetry import SLOW_FIELDS, GpuProcess, GpuSample, Tier

MIB = 1024**2
GIB = 1024**3
DEFAULT_PROFILE = "4x-rtx4090"

# NVLink bandwidth per link and direction by generation (GB/s), for simulated traffic ceilings.
_NVLINK_LINK_GBS = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}


def profiles_dir() -> Path:
    return resources.path("machines")


def list_profiles() -> list[dict[str, Any]]:
    """Every simulated profile: id, title and GPU summary, in a stable order."""
    out = []
    for f in sorted(profiles_dir().glob("*.json")):
        m = load_profile(f.stem)
        out.append({"id": f.stem, "title": _read(f)["title"], "gpus": len(m.gpus), "label": m.label})
    return out


def load_profile(profile_id: str) -> Machine:
    # A profile is a name from the list, never a path: looked up, not joined onto the folder, so no
    # name (too long for a file name, with a '/', a NUL) reaches the file system.
    known = {p.stem: p for p in sorted(profiles_dir().glob("*.json"))}
    if profile_id not in known:
        asked = profile_id if len(profile_id) <= 60 else profile_id[:59] + "…"
        raise UserError(f"unknown simulated profile {asked!r}; known profiles: {', '.join(known)}")
    return machine_from_profile(_read(known[profile_id]))


def _read(f: Path) -> dict[str, Any]:
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read machine profile {f}: {e}") from e


def machine_from_profile(p: dict[str, Any]) -> Machine:
    h = p["host"]
    numa = [NumaNode(id=int(k), cpus=parse_cpu_list(v)) for k, v in sorted(h["numa"].items(), key=lambda kv: int(kv[0]))]
    per_node_mem = h["memory_gib"] * GIB // max(len(numa), 1)
    for n in numa:
        n.memory_total = per_node_mem
    host = Host(
        hostname=h.get("hostname"),
        cpu_model=h.get("cpu_model"),
        sockets=h.get("sockets"),
        cores=h.get("cores"),
        threads=h.get("threads"),
        memory_total=h["memory_gib"] * GIB,
        numa_nodes=numa,
        driver_version=p.get("driver_version"),
        cuda_driver_version=p.get("cuda_driver_version"),
        nvml_version="simulated",
    )
    nv = p.get("nvlink") or {}
    nv_pairs = {(min(a, b), max(a, b)): n for a, b, n in nv.get("pairs", [])}
    gpus = []
    for i, g in enumerate(p["gpus"]):
        spec = {**p.get("gpu", {}), **g}
        node = spec.get("numa_node")
        links = spec.get("nvlink_links")
        if links is None:
            links = nv.get("links_per_gpu", 0) if nv.get("nvswitch") else sum(n for k, n in nv_pairs.items() if i in k)
        gpu = Gpu(
            index=i,
            name=spec["name"],
            uuid=_fake_uuid(p["id"], i),
            pci_bus_id=spec["pci_bus_id"],
            memory_total=spec["memory_mib"] * MIB,
            compute_capability=spec.get("compute_capability"),
            power_limit_w=spec.get("power_limit_w"),
            max_sm_clock_mhz=spec.get("max_sm_clock_mhz"),
            max_mem_clock_mhz=spec.get("max_mem_clock_mhz"),
            pcie_gen_current=spec.get("pcie_gen_current", spec.get("pcie_gen_max")),
            pcie_gen_max=spec.get("pcie_gen_max"),
            pcie_width_current=spec.get("pcie_width_current", spec.get("pcie_width_max")),
            pcie_width_max=spec.get("pcie_width_max"),
            numa_node=node,
            cpu_affinity=next((n.cpus for n in numa if n.id == node), None),
            ecc_enabled=spec.get("ecc"),
            mig_enabled=False if spec.get("mig_capable", True) else None,
            persistence_mode=spec.get("persistence"),
            nvlink_links=links,
            nvlink_gen=nv.get("gen") if links else None,
        )
        gpus.append(gpu)
    matrix = [row.split() for row in p["pcie"]]
    if len(matrix) != len(gpus) or any(len(r) != len(gpus) for r in matrix):
        raise UserError(f"profile {p['id']}: the pcie matrix must be {len(gpus)}×{len(gpus)}")
    pairs = []
    for a in range(len(gpus)):
        for b in range(a + 1, len(gpus)):
            pcie = PciePath(matrix[a][b])
            count = nv_pairs.get((a, b), 0)
            switch = bool(nv.get("nvswitch"))
            if switch:
                count = min(gpus[a].nvlink_links or 0, gpus[b].nvlink_links or 0)
            p2p = _p2p(p.get("p2p", "none"), pcie, count)
            pairs.append(
                GpuPair(
                    a=a, b=b, pcie=pcie, nvlink_count=count, nvlink_gen=nv.get("gen") if count else None,
                    nvswitch=switch and count > 0, p2p_read=p2p, p2p_write=p2p,
                )
            )
    return Machine(
        source=Source.SIMULATED, host=host, gpus=gpus, pairs=pairs, profile=p["id"], origin=p.get("title"),
    )


def host_ram_note(machine: Machine, this_computer: int | None = None) -> str | None:
    """Whose RAM a simulated machine's host figure is, when it is not this computer's.

    A simulated machine is a whole workstation: plans for it count its RAM, as they count its
    GPUs' memory, so a plan shows what that machine would do. Its jobs run here, as CPU ranks in
    this computer's RAM, which the engine checks before it starts one. Both figures are named.
    """
    import psutil

    if not machine.simulated or not machine.host.memory_total:
        return None
    here = this_computer if this_computer is not None else psutil.virtual_memory().total
    if here == machine.host.memory_total:
        return None
    return (
        f"Host RAM: the simulated machine has {machine.host.memory_total / GIB:,.0f} GiB and plans count that; "
        f"this computer has {here / GIB:,.1f} GiB, where its jobs run as CPU processes."
    )


def served_machine(profile_id: str) -> Machine:
    """A simulated profile as the machine Rigpilot serves on this computer: its notes say whose RAM is whose."""
    machine = load_profile(profile_id)
    note = host_ram_note(machine)
    if note:
        machine.notes.append(note)
    return machine


def _p2p(rule: str, pcie: PciePath, nvlinks: int) -> P2P:
    ok = {
        "all": True,
        "none": False,
        "nvlink-only": nvlinks > 0,
        "same-socket": nvlinks > 0 or pcie is not PciePath.SYS,
    }[rule]
    return P2P.OK if ok else P2P.UNSUPPORTED


def _fake_uuid(profile: str, index: int) -> str:
    h = hashlib.sha1(f"{profile}/{index}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


# -- telemetry --------------------------------------------------------------


@dataclass
class Load:
    """What the engine says a job is doing on one simulated GPU."""

    utilization: float = 0.0  # percent of SMs busy
    memory_bytes: int = 0
    comm_fraction: float = 0.0  # share of time spent moving data to peers
    pid: int | None = None
    command: str | None = None


@dataclass
class _GpuState:
    util: float
    mem_util: float
    memory_used: float
    power: float
    temp: float
    fan: float
    nvlink_rx: float = 0.0
    nvlink_tx: float = 0.0
    pcie_rx: float = 0.0
    pcie_tx: float = 0.0
    loads: dict[str, Load] = field(default_factory=dict)


class SimulatedBackend:
    """Telemetry for a simulated machine. Thread-safe; `clock` is injectable for tests."""

    def __init__(self, machine: Machine, *, seed: int | None = None, clock=time.monotonic):
        if not machine.simulated:
            raise ValueError("SimulatedBackend needs a simulated machine")
        self._machine = machine
        self._clock = clock
        self._lock = threading.Lock()
        self._rng = random.Random(seed if seed is not None else machine.profile)
        self._profile = _read(profiles_dir() / f"{machine.profile}.json") if machine.profile else {}
        self._last = clock()
        self._state = [self._idle_state(g) for g in machine.gpus]
        self._faults: dict[int, tuple[str, int | None]] = {}
        self._link_faults: dict[tuple[int, int], str] = {}

    def machine(self) -> Machine:
        return self._machine

    def set_fault(self, gpu: int, fault: str | None) -> None:
        """Make a GPU report a hardware fault as NVML would ("lost", "ecc", "xid 79"); None clears it.

        Telemetry and `health()` show it from then on, so recovery can be exercised without a broken card.
        """
        self._machine.gpu(gpu)  # KeyError on a GPU that does not exist
        parsed = parse_simulated_fault(fault)
        with self._lock:
            if parsed is None:
                self._faults.pop(gpu, None)
            else:
                self._faults[gpu] = parsed

    def set_link_fault(self, a: int, b: int, fault: str | None) -> None:
        """Make the link between two GPUs misbehave as broken peer paths do (engine.hardware.doctor LINK_FAULTS:
        wrong data, a hung all-reduce, a stalled copy); None clears it. The machine check's ranks
        are told (engine.workers.doctor), so its detection and what the engine does about it can be exercised."""
        self._machine.gpu(a), self._machine.gpu(b)  # KeyError on a GPU that does not exist
        if a == b:
            raise ValueError("a link joins two different GPUs")
        if fault not in (None, *LINK_FAULTS):
            raise ValueError(f"unknown link fault {str(fault)[:40]!r}; choose one of {', '.join(LINK_FAULTS)}, or clear")
        with self._lock:
            if fault is None:
                self._link_faults.pop((min(a, b), max(a, b)), None)
            else:
                self._link_faults[(min(a, b), max(a, b))] = fault

    def link_faults(self) -> dict[tuple[int, int], str]:
        with self._lock:
            return dict(self._link_faults)

    def health(self) -> dict[int, str | None]:
        """{GPU index: why it must not run a job again, or None}, judged as NVML's answers are (engine.hardware.health)."""
        with self._lock:
            out: dict[int, str | None] = {}
            for g in self._machine.gpus:
                sample = GpuSample(index=g.index, health="ok", ecc_uncorrected=0 if g.ecc_enabled else None)
                _apply_fault(sample, self._faults.get(g.index))
                out[g.index] = fault_of(sample)
            return out

    def set_load(self, gpu: int, key: str, load: Load | None) -> None:
        """Attach (or with None, remove) a job's load on a GPU; several jobs may share one."""
        self._machine.gpu(gpu)  # KeyError on a GPU that does not exist
        with self._lock:
            loads = self._state[gpu].loads
            if load is None:
                loads.pop(key, None)
            else:
                loads[key] = load

    def sample_gpus(self, tier: Tier) -> list[GpuSample]:
        with self._lock:
            now = self._clock()
            dt = max(now - self._last, 0.0)
            self._last = now
            samples = [self._advance(g, s, dt, tier) for g, s in zip(self._machine.gpus, self._state, strict=True)]
            for sample in samples:
                _apply_fault(sample, self._faults.get(sample.index), tier)
            return samples

    def close(self) -> None:
        pass

    # -- model ----------------------------------------------------------
    def _gpu_profile(self, index: int) -> dict[str, Any]:
        p = self._profile
        return {**p.get("gpu", {}), **(p.get("gpus", [{}] * (index + 1))[index])}

    def _idle_state(self, g: Gpu) -> _GpuState:
        spec = self._gpu_profile(g.index)
        base_mem = (spec.get("display_memory_mib", 0) + 4) * MIB
        return _GpuState(
            util=0.0, mem_util=0.0, memory_used=base_mem, power=spec.get("idle_power_w", 30.0),
            temp=spec.get("idle_temp_c", 35.0), fan=30.0,
        )

    def _advance(self, g: Gpu, s: _GpuState, dt: float, tier: Tier) -> GpuSample:
        spec = self._gpu_profile(g.index)
        limit = g.power_limit_w or 300.0
        idle_power = spec.get("idle_power_w", 30.0)
        idle_temp = spec.get("idle_temp_c", 35.0)
        base_mem = (spec.get("display_memory_mib", 0) + 4) * MIB
        loads = list(s.loads.values())
        busy = min(sum(x.utilization for x in loads), 100.0)
        comm = max((x.comm_fraction for x in loads), default=0.0)
        target_mem = base_mem + sum(x.memory_bytes for x in loads)
        jitter = self._rng.uniform(-2.0, 2.0) if busy > 0 else self._rng.uniform(0.0, 0.6)

        s.util = _approach(s.util, max(busy + jitter, 0.0), dt, tau=0.8)
        s.mem_util = _approach(s.mem_util, 0.55 * s.util, dt, tau=0.8)
        s.memory_used = _approach(s.memory_used, target_mem, dt, tau=0.5)
        # Idle cards still wander a watt or two (display refresh, fan control); a flat line looks dead.
        target_power = idle_power + (limit * 0.92 - idle_power) * (s.util / 100.0) + self._rng.uniform(-1.5, 1.5)
        s.power = _approach(s.power, target_power, dt, tau=2.0)
        # Steady-state temperature rises with power; a 40 s time constant is typical of a heatsink.
        target_temp = idle_temp + 48.0 * (s.power - idle_power) / max(limit - idle_power, 1.0)
        s.temp = _approach(s.temp, target_temp, dt, tau=40.0)
        s.fan = _approach(s.fan, 30.0 + max(s.temp - 40.0, 0.0) * 1.6, dt, tau=5.0)

        link_gbs = _NVLINK_LINK_GBS.get(g.nvlink_gen or 0, 25.0) * (g.nvlink_links or 0)
        s.nvlink_rx = s.nvlink_tx = link_gbs * 1e9 * 0.6 * comm * (s.util / 100.0)
        pcie_gbs = {3: 16.0, 4: 32.0, 5: 64.0}.get(g.pcie_gen_current or 4, 32.0) * (g.pcie_width_current or 16) / 16
        host_share = comm if not g.nvlink_links else 0.05
        s.pcie_rx = pcie_gbs * 1e9 * (0.002 + 0.5 * host_share * s.util / 100.0)
        s.pcie_tx = s.pcie_rx * 0.8

        sample = GpuSample(
            index=g.index,
            gpu_util=round(min(s.util, 100.0), 1),
            mem_util=round(min(s.mem_util, 100.0), 1),
            memory_used=int(min(s.memory_used, g.memory_total or s.memory_used)),
            memory_total=g.memory_total,
            temperature_c=round(s.temp, 1),
            power_w=round(s.power, 1),
            power_limit_w=limit,
            sm_clock_mhz=self._sm_clock(g, s, limit),
            mem_clock_mhz=g.max_mem_clock_mhz if s.util > 1 else int((g.max_mem_clock_mhz or 0) * 0.05) or None,
            fan_pct=round(min(s.fan, 100.0), 0) if spec.get("fan", True) else None,
            throttle_reasons=self._throttle(s, limit),
        )
        if not spec.get("fan", True):
            sample.unavailable["fan_pct"] = "not supported (passively cooled)"
        if g.nvlink_links:
            sample.nvlink_rx_bps, sample.nvlink_tx_bps = s.nvlink_rx, s.nvlink_tx
        else:
            sample.na("nvlink_rx_bps", "no NVLink")
            sample.na("nvlink_tx_bps", "no NVLink")
        if tier >= Tier.SLOW:
            sample.pcie_rx_bps, sample.pcie_tx_bps = s.pcie_rx, s.pcie_tx
            if g.ecc_enabled:
                sample.ecc_corrected, sample.ecc_uncorrected = 0, 0
            else:
                sample.na("ecc_corrected", "ECC disabled")
                sample.na("ecc_uncorrected", "ECC disabled")
            sample.health = "ok"
            sample.processes = [
                GpuProcess(pid=x.pid, used_memory=x.memory_bytes, user=None, command=x.command)
                for x in loads
                if x.pid is not None
            ]
        return sample

    def _sm_clock(self, g: Gpu, s: _GpuState, limit: float) -> int | None:
        if not g.max_sm_clock_mhz:
            return None
        if s.util < 1:
            return int(g.max_sm_clock_mhz * 0.1)
        # Under load a card runs near its published boost clock, not the VBIOS ceiling NVML calls its
        # maximum (an RTX 4090: 2520 MHz boost, 3120 MHz maximum), and sags as it nears its power limit.
        boost = self._gpu_profile(g.index).get("boost_sm_clock_mhz") or g.max_sm_clock_mhz
        return int(boost * (1.0 - 0.12 * max(0.0, s.power / limit - 0.8) / 0.2))

    @staticmethod
    def _throttle(s: _GpuState, limit: float) -> list[str]:
        reasons = []
        if s.util < 1:
            reasons.append("idle")
        if s.power >= 0.9 * limit:
            reasons.append("sw_power_cap")
        if s.temp >= 85:
            reasons.append("sw_thermal_slowdown")
        return reasons


def _apply_fault(sample: GpuSample, fault: tuple[str, int | None] | None, tier: Tier = Tier.SLOW) -> None:
    """Overwrite a sample with what NVML reports for `fault` (nvml_backend: a lost GPU answers nothing)."""
    if fault is None:
        return
    kind, xid = fault
    if kind == "lost":
        for name in [f for f in vars(sample) if f not in ("index", "unavailable")]:
            if name in SLOW_FIELDS and tier < Tier.SLOW:
                continue
            sample.na(name, "GPU lost")
        sample.health = "lost"
        sample.unavailable.pop("health", None)
    elif tier >= Tier.SLOW and kind == "ecc":
        sample.ecc_uncorrected = max(sample.ecc_uncorrected or 0, 1)
        sample.unavailable.pop("ecc_uncorrected", None)
    elif tier >= Tier.SLOW and kind == "xid":
        sample.xid = xid
        sample.health = f"xid {xid}"
        sample.unavailable.pop("xid", None)


def _approach(value: float, target: float, dt: float, tau: float) -> float:
    """First-order lag: move `value` towards `target` as a system with time constant `tau`."""
    if dt <= 0:
        return value
    return target + (value - target) * math.exp(-dt / tau)
