"""The real GPUs, through NVIDIA's NVML (the `pynvml` module of nvidia-ml-py).

Every NVML query goes through one wrapper (`_Nvml.call`) that turns an
`NVMLError` into "not available" with a reason users can act on, so a GPU
that cannot report its fan speed, or a driver too old for some function,
costs that one field and never the whole sample. A GPU that falls off the bus
is marked lost and not asked again.

NVML is initialised once for the backend's lifetime and device handles are
looked up once, which keeps the fast tier to about a dozen cheap calls per GPU.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

import psutil

from rigpilot.engine.hardware.health import fault_of
from rigpilot.engine.hardware.host import SYS, pci_numa_node, read_host
from rigpilot.engine.hardware.machine import P2P, Gpu, GpuPair, Host, Machine, PciePath, Source
from rigpilot.engine.hardware.telemetry import SLOW_FIELDS, GpuProcess, GpuSample, Tier

# Reasons shown to users; tests and the GUI match on them.
NOT_SUPPORTED = "not supported"
NO_PERMISSION = "no permission"
GPU_LOST = "GPU lost"
WARMING_UP = "warming up"
NO_NVLINK = "no NVLink"
ECC_DISABLED = "ECC disabled"

FAST_FIELDS = tuple(
    f.name for f in fields(GpuSample) if f.name not in ("index", "unavailable") and f.name not in SLOW_FIELDS
)

# Clock event ("throttle") reason bits, from nvml.h (nvmlClocksEventReason* / nvmlClocksThrottleReason*).
# Kept here rather than read from pynvml so decoding works without the module.
CLOCK_EVENT_REASONS: tuple[tuple[int, str], ...] = (
    (0x0001, "idle"),
    (0x0002, "applications_clocks"),
    (0x0004, "sw_power_cap"),
    (0x0008, "hw_slowdown"),
    (0x0010, "sync_boost"),
    (0x0020, "sw_thermal_slowdown"),
    (0x0040, "hw_thermal_slowdown"),
    (0x0080, "hw_power_brake_slowdown"),
    (0x0100, "display_clock"),
    (0x0200, "board_limit"),
    (0x0400, "reliability"),
)
# An idle GPU runs slow clocks because it has nothing to do, not because something holds it back.
NOT_THROTTLING = frozenset({"idle"})

# nvmlGpuTopologyLevel_t -> the `nvidia-smi topo -m` cell.
TOPOLOGY_LEVELS: dict[int, PciePath] = {
    # Two GPUs on one board (K80, M60) sit behind the board's own bridge: nvidia-smi calls that PIX.
    0: PciePath.PIX,  # NVML_TOPOLOGY_INTERNAL
    10: PciePath.PIX,  # NVML_TOPOLOGY_SINGLE
    20: PciePath.PXB,  # NVML_TOPOLOGY_MULTIPLE
    30: PciePath.PHB,  # NVML_TOPOLOGY_HOSTBRIDGE
    40: PciePath.NODE,  # NVML_TOPOLOGY_NODE
    50: PciePath.SYS,  # NVML_TOPOLOGY_SYSTEM
}

# nvmlDeviceGetNvLinkVersion answers with nvmlNvlinkVersion_t, not the generation itself
# (an A100 says 5 for NVLink 3.1).
NVLINK_VERSION_TO_GEN: dict[int, int] = {1: 1, 2: 2, 3: 2, 4: 3, 5: 3, 6: 4, 7: 5, 8: 6}

# pynvml spells NVML_P2P_CAPS_INDEX_READ with a trailing comma, which makes it the tuple (0,).
_P2P_READ = 0
_P2P_WRITE = 1
_UINT_MAX = 0xFFFFFFFF  # field scope "all links summed"
_MAX_EVENTS_PER_POLL = 256  # a storm of XIDs must not stall a sample

_CUDA_VERSION = ("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion")
_PCI_INFO = ("nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetPciInfo")
_REMOTE_PCI = ("nvmlDeviceGetNvLinkRemotePciInfo_v2", "nvmlDeviceGetNvLinkRemotePciInfo")
_TEMPERATURE = ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature")
_CLOCK_REASONS = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
_COMPUTE_PROCS = (
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses",
)
_GRAPHICS_PROCS = (
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses_v2",
    "nvmlDeviceGetGraphicsRunningProcesses",
)


class NvmlFailure(StrEnum):
    """Why NVML cannot be used, as a kind a caller words or acts on (never read from the message)."""

    DRIVER_MISSING = "driver_missing"  # libnvidia-ml.so.1 not found: no NVIDIA driver installed
    DRIVER_NOT_LOADED = "driver_not_loaded"
    NO_PERMISSION = "no_permission"
    VERSION_MISMATCH = "version_mismatch"  # the kernel module and the library differ (a driver update, no reboot)
    NO_GPU = "no_gpu"  # NVML started and found none
    LIBRARY_MISSING = "library_missing"  # nvidia-ml-py (pynvml), Rigpilot's own dependency, is not installed
    OTHER = "other"


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used at all (no library, no driver, no permission): `kind` says which, the message (one
    line, with NVML's own words) says it for a log."""

    def __init__(self, message: str, kind: NvmlFailure = NvmlFailure.OTHER) -> None:
        super().__init__(message)
        self.kind = kind


# -- small pure helpers (public for the tests and the GUI) -------------------


def decode_clock_event_reasons(mask: int) -> list[str]:
    """0x45 -> ['idle', 'sw_power_cap', 'hw_thermal_slowdown']; unknown bits become 'unknown_0x…'."""
    names = [name for bit, name in CLOCK_EVENT_REASONS if mask & bit]
    rest = mask & ~sum(bit for bit, _ in CLOCK_EVENT_REASONS)
    while rest:
        low = rest & -rest
        names.append(f"unknown_{low:#x}")
        rest ^= low
    return names


def encode_clock_event_reasons(names: Iterable[str]) -> int:
    """The inverse of `decode_clock_event_reasons` (used by the replay)."""
    bits = {name: bit for bit, name in CLOCK_EVENT_REASONS}
    mask = 0
    for name in names:
        if name in bits:
            mask |= bits[name]
        elif name.startswith("unknown_0x"):
            mask |= int(name[len("unknown_") :], 16)
        else:
            raise ValueError(f"unknown clock event reason {name!r}")
    return mask


def is_throttled(reasons: Sequence[str] | None) -> bool:
    """True when something other than idleness holds the clocks down."""
    return any(r not in NOT_THROTTLING for r in reasons or ())


def cuda_version_string(version: int) -> str:
    """NVML's CUDA driver version integer, 12050 -> '12.5'."""
    return f"{version // 1000}.{version % 1000 // 10}"


def cpus_from_affinity_words(words: Iterable[int]) -> list[int]:
    """NVML CPU-set words (64 CPUs each, CPU 0 in bit 0 of word 0) -> sorted CPU ids."""
    cpus: list[int] = []
    for w, word in enumerate(words):
        word = int(word)
        while word:
            low = word & -word
            cpus.append(w * 64 + low.bit_length() - 1)
            word ^= low
    return cpus


def bus_key(bus_id: str | bytes | None) -> tuple[int, int, int, int] | None:
    """A PCI address as numbers, so '00000000:2A:00.0' and '0000:2a:00.0' compare equal."""
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode(errors="replace")
    if not bus_id:
        return None
    try:
        dom, bus, rest = bus_id.strip().split(":")
        dev, fn = rest.split(".")
        return int(dom, 16), int(bus, 16), int(dev, 16), int(fn, 16)
    except ValueError:
        return None


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _handle_key(handle: Any) -> Any:
    """Something hashable that is equal for two handles of one GPU (NVML returns fresh ctypes pointers)."""
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


# -- the NVML wrapper ----------------------------------------------------------


class _NA:
    """A query that did not answer, and why (`code`: the NVML error code, when there was one)."""

    __slots__ = ("code", "reason")

    def __init__(self, reason: str, code: int | None = None):
        self.reason = reason
        self.code = code

    def __repr__(self) -> str:
        return f"_NA({self.reason!r})"


@dataclass(eq=False)
class _Link:
    link: int
    remote: tuple[int, int, int, int] | None  # remote PCI address
    kind: str  # "gpu" | "switch" | "unknown"


@dataclass(eq=False)
class _Device:
    index: int
    handle: Any
    gone: str | None = None  # why this GPU is not asked any more ("GPU lost", ...)
    bus: tuple[int, int, int, int] | None = None
    links: list[_Link] | None = None  # active NVLink links; None until known
    links_reason: str | None = None
    nvlink_gen: int | None = None
    ecc_enabled: bool | None = None
    xid_reason: str | None = None  # why XIDs are not watched on this GPU
    last_xid: int | None = None
    new_xid: int | None = None  # seen since the previous slow sample
    nv_prev: tuple[int, int, float] | None = None  # rx KiB, tx KiB, seconds
    nv_rates: tuple[float, float] | None = None
    nv_per_link: bool | None = None  # None: the all-links scope not yet known to fail
    procs: dict[int, tuple[str | None, str | None]] = field(default_factory=dict)

    @property
    def lost(self) -> bool:
        return self.gone == GPU_LOST


class _Nvml:
    """The one door to NVML: looks functions up once and turns errors into reasons."""

    def __init__(self, module: Any):
        self.m = module
        self.error = module.NVMLError
        self._fns: dict[str, Callable[..., Any] | None] = {}
        self._chosen: dict[tuple[str, ...], str] = {}
        self.codes = {
            "not_supported": module.NVML_ERROR_NOT_SUPPORTED,
            "no_permission": module.NVML_ERROR_NO_PERMISSION,
            "lost": module.NVML_ERROR_GPU_IS_LOST,
            "function": module.NVML_ERROR_FUNCTION_NOT_FOUND,
            "invalid": module.NVML_ERROR_INVALID_ARGUMENT,
            "timeout": module.NVML_ERROR_TIMEOUT,
        }
        # Raised by pynvml's unversioned wrappers when the library lacks the versioned function.
        self.mismatch = getattr(module, "NVMLLibraryMismatchError", self.error)

    def fn(self, name: str) -> Callable[..., Any] | None:
        if name not in self._fns:
            self._fns[name] = getattr(self.m, name, None)
        return self._fns[name]

    def reason(self, err: BaseException, dev: _Device | None = None) -> str:
        code = getattr(err, "value", None)
        if code == self.codes["not_supported"]:
            return NOT_SUPPORTED
        if code == self.codes["no_permission"]:
            return NO_PERMISSION
        if code == self.codes["lost"]:
            if dev is not None:
                dev.gone = GPU_LOST
            return GPU_LOST
        return f"NVML error: {err}"

    def call(self, dev: _Device | None, name: str, *args: Any) -> Any:
        """`name(dev.handle, *args)`, or `name(*args)` without a device; an `_NA` when it cannot answer."""
        if dev is not None and dev.gone:
            return _NA(dev.gone)
        fn = self.fn(name)
        if fn is None:
            return _NA(f"NVML error: {name} is missing from this pynvml", self.codes["function"])
        try:
            return fn(dev.handle, *args) if dev is not None else fn(*args)
        except self.error as e:
            return _NA(self.reason(e, dev), getattr(e, "value", None))
        except self.mismatch as e:
            return _NA(f"NVML error: {e}", self.codes["function"])

    def call_pair(self, a: _Device, b: _Device, name: str, *args: Any) -> Any:
        if a.gone or b.gone:
            return _NA(a.gone or b.gone or "")
        fn = self.fn(name)
        if fn is None:
            return _NA(f"NVML error: {name} is missing from this pynvml", self.codes["function"])
        try:
            return fn(a.handle, b.handle, *args)
        except self.error as e:
            return _NA(self.reason(e), getattr(e, "value", None))  # which of the two is lost is not known

    def call_first(self, dev: _Device | None, names: tuple[str, ...], *args: Any) -> Any:
        """The first of several versions of a function that this pynvml and driver both have."""
        chosen = self._chosen.get(names)
        if chosen is not None:
            return self.call(dev, chosen, *args)
        result: Any = _NA(f"NVML error: none of {', '.join(names)} in this pynvml", self.codes["function"])
        for name in names:
            if self.fn(name) is None:
                continue
            result = self.call(dev, name, *args)
            if isinstance(result, _NA) and (result.code == self.codes["function"] or (dev is not None and dev.gone)):
                continue  # older driver, or a lost GPU that cannot tell which version the driver has
            self._chosen[names] = name
            return result
        return result


# -- the backend ---------------------------------------------------------------


class NvmlBackend:
    """The `Backend` for real NVIDIA GPUs.

    `nvml` is the `pynvml` module (default) or a stand-in such as
    `rigpilot.engine.hardware.nvml_replay.FakeNvml`. Raises `NvmlUnavailable` when NVML
    cannot start, so the caller can fall back to a simulated machine.
    """

    def __init__(
        self,
        nvml: Any | None = None,
        *,
        host_reader: Callable[[], Host] = read_host,
        sys_root: Path = SYS,
        clock: Callable[[], float] = time.monotonic,
    ):
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError as e:
                raise NvmlUnavailable(f"nvidia-ml-py is not installed ({e})", NvmlFailure.LIBRARY_MISSING) from e
        self._nv = _Nvml(nvml)
        self._host_reader = host_reader
        self._sys_root = sys_root
        self._clock = clock
        self._lock = threading.Lock()
        self._machine: Machine | None = None
        self._closed = False
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            raise _init_failure(nvml, e) from e
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as e:
            self._shutdown()
            raise NvmlUnavailable(f"NVML could not count the GPUs (NVML: {e})") from e
        self._devices = [self._open_device(i) for i in range(count)]
        self._by_handle = {_handle_key(d.handle): d for d in self._devices if d.handle is not None}
        self._events = self._watch_xids()
        self._events_error: str | None = None  # why the last poll for XIDs failed

    def _open_device(self, index: int) -> _Device:
        handle = self._nv.call(None, "nvmlDeviceGetHandleByIndex", index)
        if isinstance(handle, _NA):
            return _Device(index=index, handle=None, gone=handle.reason)
        return _Device(index=index, handle=handle)

    def _watch_xids(self) -> Any:
        """One event set for all GPUs, polled without waiting in the slow tier."""
        nv = self._nv
        live = [d for d in self._devices if not d.gone]
        if not live:
            return None
        xid = nv.m.nvmlEventTypeXidCriticalError
        events = nv.call(None, "nvmlEventSetCreate")
        if isinstance(events, _NA):
            for d in live:
                d.xid_reason = events.reason
            return None
        for d in live:
            supported = nv.call(d, "nvmlDeviceGetSupportedEventTypes")
            if isinstance(supported, _NA):
                d.xid_reason = supported.reason
            elif not supported & xid:
                d.xid_reason = NOT_SUPPORTED
            else:
                done = nv.call(d, "nvmlDeviceRegisterEvents", xid, events)
                if isinstance(done, _NA):
                    d.xid_reason = done.reason
        return events

    # -- Backend protocol ----------------------------------------------------
    def machine(self) -> Machine:
        with self._lock:
            self._check_open()
            if self._machine is None:
                self._machine = self._read_machine()
            return self._machine

    def sample_gpus(self, tier: Tier) -> list[GpuSample]:
        if self._machine is None:
            self.machine()  # NVLink links and ECC mode decide what to sample
        with self._lock:
            self._check_open()
            if tier >= Tier.SLOW:
                self._drain_events()
            return [self._sample(d, tier) for d in self._devices]

    def health(self) -> dict[int, str | None]:
        """{GPU index: why it must not run a job again, or None}, asked of the driver now (engine.hardware.health).

        A GPU is faulty once NVML answers GPU_IS_LOST, counts an uncorrectable ECC error since the driver
        loaded, or sent a hardware XID since this backend started watching. XIDs are drained here
        without clearing what the next slow sample reports.
        """
        if self._machine is None:
            self.machine()  # the ECC mode decides whether to ask for ECC counts
        nv, m = self._nv, self._nv.m
        with self._lock:
            self._check_open()
            self._drain_events()
            out: dict[int, str | None] = {}
            for d in self._devices:
                s = GpuSample(index=d.index)
                if not d.gone and d.ecc_enabled is not False:
                    uncorrected = nv.call(
                        d, "nvmlDeviceGetTotalEccErrors", m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, m.NVML_VOLATILE_ECC
                    )
                    _set(s, "ecc_uncorrected", uncorrected, int)
                if not d.gone:
                    nv.call(d, "nvmlDeviceGetMemoryInfo")  # a cheap call that finds a GPU fallen off the bus
                s.health = "lost" if d.lost else None
                s.xid = d.last_xid
                out[d.index] = fault_of(s)
            return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._events is not None:
                self._nv.call(None, "nvmlEventSetFree", self._events)
                self._events = None
            self._shutdown()

    def __enter__(self) -> NvmlBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the NVML backend is closed")

    def _shutdown(self) -> None:
        self._nv.call(None, "nvmlShutdown")

    # -- machine facts -------------------------------------------------------
    def _read_machine(self) -> Machine:
        nv = self._nv
        host = self._host_reader()
        driver = self._put(host, "driver_version", None, "nvmlSystemGetDriverVersion", convert=_text)
        cuda = nv.call_first(None, _CUDA_VERSION)
        if isinstance(cuda, _NA):
            host.cuda_driver_version = None
            host.unavailable["cuda_driver_version"] = cuda.reason
        else:
            host.cuda_driver_version = cuda_version_string(int(cuda))
        self._put(host, "nvml_version", None, "nvmlSystemGetNVMLVersion", convert=_text)

        notes: list[str] = []
        gpus = [self._read_gpu(d, host) for d in self._devices]
        pairs = self._read_pairs(gpus, notes)
        return Machine(
            source=Source.NVML,
            host=host,
            gpus=gpus,
            pairs=pairs,
            origin=f"NVML {driver}" if driver else "NVML",
            notes=notes,
        )

    def _put(
        self, obj: Any, name: str, dev: _Device | None, fn: str, *args: Any, convert: Callable | None = None
    ) -> Any:
        """Set `obj.name` from one query, or mark it unavailable with the reason."""
        value = self._nv.call(dev, fn, *args)
        if isinstance(value, _NA):
            setattr(obj, name, None)
            obj.unavailable[name] = value.reason
            return None
        value = convert(value) if convert else value
        setattr(obj, name, value)
        return value

    def _read_gpu(self, d: _Device, host: Host) -> Gpu:
        nv, m = self._nv, self._nv.m
        gpu = Gpu(index=d.index, name="(unknown)")
        name = nv.call(d, "nvmlDeviceGetName")
        if isinstance(name, _NA):
            gpu.unavailable["name"] = name.reason
        else:
            gpu.name = _text(name)
        self._put(gpu, "uuid", d, "nvmlDeviceGetUUID", convert=_text)
        pci = nv.call_first(d, _PCI_INFO)
        if isinstance(pci, _NA):
            gpu.na("pci_bus_id", pci.reason)
        else:
            gpu.pci_bus_id = _text(pci.busId) or _text(pci.busIdLegacy)
            d.bus = bus_key(gpu.pci_bus_id)
        self._put(gpu, "memory_total", d, "nvmlDeviceGetMemoryInfo", convert=lambda v: int(v.total))
        self._put(
            gpu, "compute_capability", d, "nvmlDeviceGetCudaComputeCapability", convert=lambda v: f"{v[0]}.{v[1]}"
        )
        self._put(gpu, "power_limit_w", d, "nvmlDeviceGetEnforcedPowerLimit", convert=lambda mw: mw / 1000.0)
        self._put(gpu, "max_sm_clock_mhz", d, "nvmlDeviceGetMaxClockInfo", m.NVML_CLOCK_SM, convert=int)
        self._put(gpu, "max_mem_clock_mhz", d, "nvmlDeviceGetMaxClockInfo", m.NVML_CLOCK_MEM, convert=int)
        self._put(gpu, "pcie_gen_current", d, "nvmlDeviceGetCurrPcieLinkGeneration", convert=int)
        self._put(gpu, "pcie_gen_max", d, "nvmlDeviceGetMaxPcieLinkGeneration", convert=int)
        self._put(gpu, "pcie_width_current", d, "nvmlDeviceGetCurrPcieLinkWidth", convert=int)
        self._put(gpu, "pcie_width_max", d, "nvmlDeviceGetMaxPcieLinkWidth", convert=int)
        self._read_numa(d, gpu, host)
        self._put(
            gpu, "cpu_affinity", d, "nvmlDeviceGetCpuAffinity", _cpu_set_words(host), convert=cpus_from_affinity_words
        )
        enabled = m.NVML_FEATURE_ENABLED
        d.ecc_enabled = self._put(gpu, "ecc_enabled", d, "nvmlDeviceGetEccMode", convert=lambda v: v[0] == enabled)
        mig_on = m.NVML_DEVICE_MIG_ENABLE
        self._put(gpu, "mig_enabled", d, "nvmlDeviceGetMigMode", convert=lambda v: v[0] == mig_on)
        self._put(gpu, "persistence_mode", d, "nvmlDeviceGetPersistenceMode", convert=lambda v: v == enabled)
        self._read_links(d, gpu)
        return gpu

    def _read_numa(self, d: _Device, gpu: Gpu, host: Host) -> None:
        node = self._nv.call(d, "nvmlDeviceGetNumaNodeId")
        if not isinstance(node, _NA) and int(node) >= 0:
            # On coherent platforms (Grace Hopper) NVML names the GPU's own memory node, which
            # has no CPUs; the node that matters for pinning work is the one the PCI device sits on.
            cpu_less = any(n.id == node and not n.cpus for n in host.numa_nodes)
            if not cpu_less:
                gpu.numa_node = int(node)
                return
        if gpu.pci_bus_id:
            sysfs = pci_numa_node(gpu.pci_bus_id, self._sys_root)
            if sysfs is not None:
                gpu.numa_node = sysfs
                return
        gpu.na("numa_node", node.reason if isinstance(node, _NA) else "unknown to NVML and sysfs")

    def _read_links(self, d: _Device, gpu: Gpu) -> None:
        """Walk every NVLink slot: which are up, and where each one goes."""
        nv, m = self._nv, self._nv.m
        if d.gone:
            for name in ("nvlink_links", "nvlink_gen", "nvlink_link_gbps"):
                gpu.na(name, d.gone)
            return
        state_fn = nv.fn("nvmlDeviceGetNvLinkState")
        absent = (nv.codes["not_supported"], nv.codes["invalid"])
        links: list[_Link] = []
        for link in range(getattr(m, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                active = state_fn(d.handle, link) if state_fn else None
            except nv.error as e:
                if getattr(e, "value", None) in absent:
                    continue  # no such link on this GPU: slots beyond its count answer like this
                d.links_reason = nv.reason(e, d)
                break
            if active is None:
                d.links_reason = "NVML error: nvmlDeviceGetNvLinkState is missing from this pynvml"
                break
            if active != m.NVML_FEATURE_ENABLED:
                continue
            remote = nv.call_first(d, _REMOTE_PCI, link)
            remote_bus = None if isinstance(remote, _NA) else bus_key(remote.busId or remote.busIdLegacy)
            kind = nv.call(d, "nvmlDeviceGetNvLinkRemoteDeviceType", link)
            if isinstance(kind, _NA):
                kind_name = "unknown"
            elif kind == m.NVML_NVLINK_DEVICE_TYPE_SWITCH:
                kind_name = "switch"
            elif kind == m.NVML_NVLINK_DEVICE_TYPE_GPU:
                kind_name = "gpu"
            else:
                kind_name = "unknown"
            links.append(_Link(link, remote_bus, kind_name))
        if d.links_reason:
            for name in ("nvlink_links", "nvlink_gen", "nvlink_link_gbps"):
                gpu.na(name, d.links_reason)
            return
        d.links = links
        gpu.nvlink_links = len(links)
        if not links:
            gpu.na("nvlink_gen", NO_NVLINK)
            gpu.na("nvlink_link_gbps", NO_NVLINK)
            return
        speed = self._link_speed(d, links[0].link)
        if isinstance(speed, _NA):
            gpu.na("nvlink_link_gbps", speed.reason)
        else:
            gpu.nvlink_link_gbps = speed
        version = nv.call(d, "nvmlDeviceGetNvLinkVersion", links[0].link)
        if isinstance(version, _NA):
            gpu.na("nvlink_gen", version.reason)
        elif int(version) in NVLINK_VERSION_TO_GEN:
            gpu.nvlink_gen = d.nvlink_gen = NVLINK_VERSION_TO_GEN[int(version)]
        else:
            gpu.na("nvlink_gen", f"unknown NVLink version {int(version)}")

    def _link_speed(self, d: _Device, link: int) -> float | _NA:
        """One link's speed per direction in GB/s, as `nvidia-smi nvlink --status` prints it."""
        m = self._nv.m
        got: Any = _NA(NOT_SUPPORTED)
        # The per-link field is newer; the "common speed of active links" one covers older drivers.
        for field_id, scope in ((m.NVML_FI_DEV_NVLINK_GET_SPEED, link), (m.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON, 0)):
            got = self._nv.call(d, "nvmlDeviceGetFieldValues", [(field_id, scope)])
            if isinstance(got, _NA):
                return got
            v = got[0]
            if v.nvmlReturn == 0:
                return round(_field_value(v, m) / 1000, 3)  # MB/s
            got = _NA(self._nv.reason(self._nv.error(v.nvmlReturn), d), int(v.nvmlReturn))
        return got

    def _read_pairs(self, gpus: list[Gpu], notes: list[str]) -> list[GpuPair]:
        nv, m = self._nv, self._nv.m
        by_bus = {d.bus: d.index for d in self._devices if d.bus is not None}
        direct: dict[tuple[int, int], int] = {}  # (from, to) -> links
        switch_links: dict[int, int] = {}
        fabric = _UnionFind()
        guessed_switch = False
        for d in self._devices:
            for link in d.links or ():
                peer = by_bus.get(link.remote) if link.remote is not None else None
                if link.kind == "gpu" or (link.kind == "unknown" and peer is not None):
                    if peer is not None and peer != d.index:
                        direct[(d.index, peer)] = direct.get((d.index, peer), 0) + 1
                    continue
                # A link that ends neither at a known GPU nor says what it ends at goes to an
                # NVSwitch: on x86 machines that is the only other NVLink endpoint.
                guessed_switch |= link.kind == "unknown"
                switch_links[d.index] = switch_links.get(d.index, 0) + 1
                fabric.union(("gpu", d.index), ("switch", link.remote or ("anonymous",)))
        if guessed_switch:
            notes.append("NVML did not say where some NVLink links end; they were taken to be NVSwitch links.")

        unknown_pcie: dict[str, int] = {}
        pairs = []
        devs = self._devices
        for i, a in enumerate(devs):
            for b in devs[i + 1 :]:
                pair = GpuPair(a=a.index, b=b.index)
                level = nv.call_pair(a, b, "nvmlDeviceGetTopologyCommonAncestor")
                if isinstance(level, _NA) or int(level) not in TOPOLOGY_LEVELS:
                    reason = level.reason if isinstance(level, _NA) else f"unknown topology level {int(level)}"
                    unknown_pcie[reason] = unknown_pcie.get(reason, 0) + 1
                else:
                    pair.pcie = TOPOLOGY_LEVELS[int(level)]
                count = max(direct.get((a.index, b.index), 0), direct.get((b.index, a.index), 0))
                on_fabric = (
                    a.index in switch_links
                    and b.index in switch_links
                    and fabric.find(("gpu", a.index)) == fabric.find(("gpu", b.index))
                )
                if on_fabric:
                    # As `nvidia-smi topo -m` does: NV<n> with n the links the weaker GPU has into the fabric.
                    count += min(switch_links[a.index], switch_links[b.index])
                    pair.nvswitch = True
                pair.nvlink_count = count
                if count:
                    gens = [g for g in (a.nvlink_gen, b.nvlink_gen) if g is not None]
                    pair.nvlink_gen = min(gens) if gens else None
                pair.p2p_read = self._p2p(a, b, _P2P_READ, m)
                pair.p2p_write = self._p2p(a, b, _P2P_WRITE, m)
                pairs.append(pair)
        for reason, n in unknown_pcie.items():
            notes.append(f"PCIe path unknown for {n} GPU pair{'s' if n != 1 else ''} ({reason}).")
        return pairs

    def _p2p(self, a: _Device, b: _Device, index: int, m: Any) -> P2P:
        status = self._nv.call_pair(a, b, "nvmlDeviceGetP2PStatus", index)
        if isinstance(status, _NA) or status == m.NVML_P2P_STATUS_UNKNOWN:
            return P2P.UNKNOWN
        return P2P.OK if status == m.NVML_P2P_STATUS_OK else P2P.UNSUPPORTED

    # -- telemetry -----------------------------------------------------------
    def _sample(self, d: _Device, tier: Tier) -> GpuSample:
        s = GpuSample(index=d.index)
        if not d.gone:
            self._sample_fast(d, s)
            if tier >= Tier.SLOW:
                self._sample_slow(d, s)
        if d.gone:
            # Values read before a GPU fell off the bus are not worth showing next to "lost".
            for name in FAST_FIELDS + (SLOW_FIELDS if tier >= Tier.SLOW else ()):
                s.na(name, d.gone)
            if d.lost:  # known without asking, so reported in every tier
                s.health = "lost"
                s.unavailable.pop("health", None)
        return s

    def _sample_fast(self, d: _Device, s: GpuSample) -> None:
        nv, m = self._nv, self._nv.m
        util = nv.call(d, "nvmlDeviceGetUtilizationRates")
        if isinstance(util, _NA):
            s.na("gpu_util", util.reason)
            s.na("mem_util", util.reason)
        else:
            s.gpu_util, s.mem_util = float(util.gpu), float(util.memory)
        mem = nv.call(d, "nvmlDeviceGetMemoryInfo")
        if isinstance(mem, _NA):
            s.na("memory_used", mem.reason)
            s.na("memory_total", mem.reason)
        else:
            s.memory_used, s.memory_total = int(mem.used), int(mem.total)
        temp = nv.call_first(d, _TEMPERATURE, m.NVML_TEMPERATURE_GPU)
        _set(s, "temperature_c", temp, float)
        _set(s, "power_w", nv.call(d, "nvmlDeviceGetPowerUsage"), _milli)
        _set(s, "power_limit_w", nv.call(d, "nvmlDeviceGetEnforcedPowerLimit"), _milli)
        _set(s, "sm_clock_mhz", nv.call(d, "nvmlDeviceGetClockInfo", m.NVML_CLOCK_SM), int)
        _set(s, "mem_clock_mhz", nv.call(d, "nvmlDeviceGetClockInfo", m.NVML_CLOCK_MEM), int)
        _set(s, "fan_pct", nv.call(d, "nvmlDeviceGetFanSpeed"), float)
        _set(s, "throttle_reasons", nv.call_first(d, _CLOCK_REASONS), decode_clock_event_reasons)
        self._sample_nvlink(d, s)

    def _sample_nvlink(self, d: _Device, s: GpuSample) -> None:
        """NVLink bytes per second from the driver's cumulative KiB counters, between two samples."""
        if d.links is not None and not d.links:
            s.na("nvlink_rx_bps", NO_NVLINK)
            s.na("nvlink_tx_bps", NO_NVLINK)
            return
        if d.links is None:
            reason = d.links_reason or d.gone or NOT_SUPPORTED
            s.na("nvlink_rx_bps", reason)
            s.na("nvlink_tx_bps", reason)
            return
        counters = self._nvlink_counters(d)
        if isinstance(counters, _NA):
            d.nv_prev = None
            s.na("nvlink_rx_bps", counters.reason)
            s.na("nvlink_tx_bps", counters.reason)
            return
        rx, tx, t = counters
        prev, d.nv_prev = d.nv_prev, counters
        if prev is not None and (rx < prev[0] or tx < prev[1]):
            d.nv_rates = None  # counters were reset (driver reload): start over
        elif prev is not None and t > prev[2]:
            dt = t - prev[2]
            d.nv_rates = ((rx - prev[0]) * 1024 / dt, (tx - prev[1]) * 1024 / dt)
        if d.nv_rates is None:
            s.na("nvlink_rx_bps", WARMING_UP)
            s.na("nvlink_tx_bps", WARMING_UP)
        else:
            s.nvlink_rx_bps, s.nvlink_tx_bps = d.nv_rates

    def _nvlink_counters(self, d: _Device) -> tuple[int, int, float] | _NA:
        m = self._nv.m
        tx_id, rx_id = m.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, m.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
        links = [lk.link for lk in d.links or ()]
        per_link_ids = [(rx_id, lk) for lk in links] + [(tx_id, lk) for lk in links]
        if d.nv_per_link:
            return self._read_fields(d, per_link_ids)
        # A bare field id means scope 0, which is link 0 alone; UINT_MAX asks for all links summed.
        got = self._read_fields(d, [(rx_id, _UINT_MAX), (tx_id, _UINT_MAX)])
        if not isinstance(got, _NA) or d.nv_per_link is False or d.gone:
            return got
        # Some drivers reject the all-links scope: try summing the links, once.
        per_link = self._read_fields(d, per_link_ids)
        d.nv_per_link = not isinstance(per_link, _NA)
        return per_link if d.nv_per_link else got

    def _read_fields(self, d: _Device, ids: list[tuple[int, int]]) -> tuple[int, int, float] | _NA:
        """Sum the first half of `ids` as RX and the second half as TX; the time is the driver's."""
        values = self._nv.call(d, "nvmlDeviceGetFieldValues", ids)
        if isinstance(values, _NA):
            return values
        half = len(ids) // 2
        rx = tx = 0
        stamp = 0
        for i, v in enumerate(values):
            if v.nvmlReturn != 0:
                return _NA(self._nv.reason(self._nv.error(v.nvmlReturn), d), int(v.nvmlReturn))
            if i < half:
                rx += int(_field_value(v, self._nv.m))
            else:
                tx += int(_field_value(v, self._nv.m))
            stamp = max(stamp, int(v.timestamp))
        # The driver stamps each value in microseconds; fall back to our clock if it does not.
        t = stamp / 1e6 if stamp > 0 else self._clock()
        return rx, tx, t

    def _sample_slow(self, d: _Device, s: GpuSample) -> None:
        nv, m = self._nv, self._nv.m
        # NVML counts PCIe throughput in KiB/s.
        _set(s, "pcie_rx_bps", nv.call(d, "nvmlDeviceGetPcieThroughput", m.NVML_PCIE_UTIL_RX_BYTES), _kib)
        _set(s, "pcie_tx_bps", nv.call(d, "nvmlDeviceGetPcieThroughput", m.NVML_PCIE_UTIL_TX_BYTES), _kib)
        if d.ecc_enabled is False:
            s.na("ecc_corrected", ECC_DISABLED)
            s.na("ecc_uncorrected", ECC_DISABLED)
        else:
            volatile = m.NVML_VOLATILE_ECC
            corrected = nv.call(d, "nvmlDeviceGetTotalEccErrors", m.NVML_MEMORY_ERROR_TYPE_CORRECTED, volatile)
            _set(s, "ecc_corrected", corrected, int)
            uncorrected = nv.call(d, "nvmlDeviceGetTotalEccErrors", m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, volatile)
            _set(s, "ecc_uncorrected", uncorrected, int)
        if d.xid_reason or self._events_error:
            s.na("xid", d.xid_reason or self._events_error or "")
        else:
            s.xid = d.last_xid  # None without a reason: no XID seen
        self._sample_processes(d, s)
        if not d.gone:
            # An XID stays in `xid`; health reports it only for the sample that first saw it.
            s.health = f"xid {d.new_xid}" if d.new_xid is not None else "ok"
        d.new_xid = None

    def _drain_events(self) -> None:
        """Collect XID events that arrived since the last poll; a timeout of 0 never blocks."""
        self._events_error = None
        if self._events is None:
            return
        nv = self._nv
        wait = nv.fn("nvmlEventSetWait")
        if wait is None:
            self._events_error = "NVML error: nvmlEventSetWait is missing from this pynvml"
            return
        xid_type = nv.m.nvmlEventTypeXidCriticalError
        for _ in range(_MAX_EVENTS_PER_POLL):
            try:
                data = wait(self._events, 0)
            except nv.error as e:
                if getattr(e, "value", None) != nv.codes["timeout"]:  # a timeout means "no more events"
                    self._events_error = nv.reason(e)
                return
            d = self._by_handle.get(_handle_key(data.device))
            if d is not None and data.eventType & xid_type:
                d.last_xid = d.new_xid = int(data.eventData)

    def _sample_processes(self, d: _Device, s: GpuSample) -> None:
        procs: list[GpuProcess] = []
        reasons = []
        seen: set[int] = set()
        for kind, names in (("compute", _COMPUTE_PROCS), ("graphics", _GRAPHICS_PROCS)):
            found = self._nv.call_first(d, names)
            if isinstance(found, _NA):
                reasons.append(found.reason)
                continue
            for p in found:
                pid = int(p.pid)
                if pid in seen:  # a process using both engines is listed twice
                    continue
                seen.add(pid)
                used = p.usedGpuMemory
                procs.append(GpuProcess(pid=pid, used_memory=None if used is None else int(used), kind=kind))
        if len(reasons) == 2:
            s.na("processes", reasons[0])
            return
        # psutil lookups are the dearest part of the slow tier: remember them while the pid stays.
        cache, d.procs = d.procs, {}
        for p in procs:
            described = cache.get(p.pid) or _describe_pid(p.pid)
            d.procs[p.pid] = described
            p.user, p.command = described
        s.processes = procs


# -- helpers -------------------------------------------------------------------


def _set(s: GpuSample, name: str, value: Any, convert: Callable[[Any], Any]) -> None:
    if isinstance(value, _NA):
        s.na(name, value.reason)
    else:
        setattr(s, name, convert(value))


def _field_value(v: Any, m: Any) -> float | int:
    """The number in an nvmlFieldValue_t, read as the type the driver says it wrote."""
    member = {
        m.NVML_VALUE_TYPE_DOUBLE: "dVal",
        m.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        m.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        m.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        m.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
        m.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
        m.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
    }.get(v.valueType, "ullVal")
    return getattr(v.value, member)


def _milli(value: Any) -> float:
    return value / 1000.0


def _kib(value: Any) -> float:
    return float(value) * 1024


def _cpu_set_words(host: Host) -> int:
    """How many 64-bit words NVML needs to describe every logical CPU of this host."""
    highest = max((c for n in host.numa_nodes for c in n.cpus), default=-1) + 1
    n = max(host.threads or 0, highest, os.cpu_count() or 1)
    return (n + 63) // 64


def _describe_pid(pid: int) -> tuple[str | None, str | None]:
    """User and command line of a process; (None, None) once it has gone, partial when denied."""
    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        return None, None
    try:
        user: str | None = proc.username()
    except psutil.Error:
        user = None
    try:
        command: str | None = " ".join(proc.cmdline()) or proc.name()
    except psutil.NoSuchProcess:
        return user, None
    except psutil.Error:  # another user's process under hidepid: the name is often still readable
        try:
            command = proc.name()
        except psutil.Error:
            command = None
    return user, command


def _init_failure(nvml: Any, err: BaseException) -> NvmlUnavailable:
    code = getattr(err, "value", None)
    reasons = {
        nvml.NVML_ERROR_LIBRARY_NOT_FOUND: (
            NvmlFailure.DRIVER_MISSING, "NVIDIA driver not installed: libnvidia-ml.so.1 not found"),
        nvml.NVML_ERROR_DRIVER_NOT_LOADED: (NvmlFailure.DRIVER_NOT_LOADED, "NVIDIA driver not loaded"),
        nvml.NVML_ERROR_NO_PERMISSION: (NvmlFailure.NO_PERMISSION, "no permission to use the NVIDIA driver"),
        nvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
            NvmlFailure.VERSION_MISMATCH, "NVIDIA driver and library versions differ (reboot after a driver update)"),
    }  # fmt: skip
    kind, line = reasons.get(code, (NvmlFailure.OTHER, "NVML could not start"))
    text = " ".join(str(err).split())  # one line, whatever the driver says
    return NvmlUnavailable(f"{line} (NVML: {text})", kind)


class _UnionFind:
    def __init__(self) -> None:
        self._parent: dict[Any, Any] = {}

    def find(self, x: Any) -> Any:
        self._parent.setdefault(x, x)
        while self._parent[x] != x:
            self._parent[x] = self._parent[self._parent[x]]
            x = self._parent[x]
        return x

    def union(self, a: Any, b: Any) -> None:
        self._parent[self.find(a)] = self.find(b)
