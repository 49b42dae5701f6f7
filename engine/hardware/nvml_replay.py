"""A stand-in for the `pynvml` module, so the NVML backend runs without a GPU.

`FakeNvml(machine, telemetry)` answers the NVML functions the backend uses
from a `Machine` (a simulated profile, an import, or one built by hand) and a
telemetry source (a `SimulatedBackend`, or any callable returning
`list[GpuSample]`). It speaks pynvml's language exactly: the same function
names and arguments, the real constants, ctypes structures where pynvml
returns them, and the real `pynvml.NVMLError` classes, so errors can be
injected the way a driver would raise them:

    fake.inject("nvmlDeviceGetFanSpeed", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=1)
    fake.lose_gpu(2)                     # every call on GPU 2 raises GpuIsLost
    fake.fail_init(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

Any value the machine or the telemetry leaves as None is answered with
NVML_ERROR_NOT_SUPPORTED, which is what a driver says for a field a GPU lacks.

`install(fake)` puts the fake's functions into the real `pynvml` module for
the duration of a `with` block, so code that does `import pynvml` runs
against the replay unmodified.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import pynvml

from rigpilot.engine.hardware.machine import P2P, Gpu, Machine, PciePath
from rigpilot.engine.hardware.nvml_backend import encode_clock_event_reasons
from rigpilot.engine.hardware.telemetry import GpuSample, Tier

MIB = 1024**2
UINT_MAX = 0xFFFFFFFF

_PCIE_TO_LEVEL = {
    PciePath.SELF: pynvml.NVML_TOPOLOGY_INTERNAL,
    PciePath.PIX: pynvml.NVML_TOPOLOGY_SINGLE,
    PciePath.PXB: pynvml.NVML_TOPOLOGY_MULTIPLE,
    PciePath.PHB: pynvml.NVML_TOPOLOGY_HOSTBRIDGE,
    PciePath.NODE: pynvml.NVML_TOPOLOGY_NODE,
    PciePath.SYS: pynvml.NVML_TOPOLOGY_SYSTEM,
}
_P2P_TO_STATUS = {
    P2P.OK: pynvml.NVML_P2P_STATUS_OK,
    P2P.UNSUPPORTED: pynvml.NVML_P2P_STATUS_NOT_SUPPORTED,
    P2P.UNKNOWN: pynvml.NVML_P2P_STATUS_UNKNOWN,
}
# NVLink generation -> the nvmlNvlinkVersion_t a driver reports for it.
_GEN_TO_NVLINK_VERSION = {
    1: pynvml.NVML_NVLINK_VERSION_1_0,
    2: pynvml.NVML_NVLINK_VERSION_2_0,
    3: pynvml.NVML_NVLINK_VERSION_3_0,
    4: pynvml.NVML_NVLINK_VERSION_4_0,
    5: pynvml.NVML_NVLINK_VERSION_5_0,
    6: pynvml.NVML_NVLINK_VERSION_6_0,
}
_NVLINK_FIELDS = frozenset(
    {
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
        pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT,
        pynvml.NVML_FI_DEV_NVLINK_GET_SPEED,
        pynvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON,
    }
)
_UINT_FIELDS = frozenset(
    {
        pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT,
        pynvml.NVML_FI_DEV_NVLINK_GET_SPEED,
        pynvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON,
    }
)
# Library helpers in pynvml that are not driver calls; the fake lends them out unchanged.
_PYNVML_HELPERS = frozenset({"nvmlExceptionClass", "nvmlStructToFriendlyObject", "nvmlFriendlyObjectToStruct"})


class TelemetrySource(Protocol):
    def sample_gpus(self, tier: Tier) -> list[GpuSample]: ...


@dataclass(frozen=True)
class FakeHandle:
    """What `nvmlDeviceGetHandleByIndex` returns in the replay."""

    index: int


@dataclass(eq=False)
class FakeEventSet:
    gpus: dict[int, int] = field(default_factory=dict)  # gpu -> registered event types
    queue: list[Any] = field(default_factory=list)
    freed: bool = False


@dataclass
class _Injection:
    code: int
    gpu: int | None
    times: int | None  # None: for ever


@dataclass(eq=False)
class _FakeLink:
    active: bool
    remote_bus: str | None = None
    remote_type: int = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU


def _nvml_api(method: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a method as an NVML function: counted, refused before init, on lost GPUs, or when injected."""
    name = method.__name__

    @functools.wraps(method)
    def call(self: FakeNvml, *args: Any) -> Any:
        self.calls[name] += 1
        gpus = self._gpus_in(name, args)
        for g in gpus:
            self.calls_by_gpu[g] += 1
        self._check(name, gpus)
        return method(self, *args)

    call.nvml_api = True  # type: ignore[attr-defined]
    return call


def _raise(code: int) -> None:
    raise pynvml.NVMLError(code)


class FakeNvml:
    """A replay of one machine through pynvml's API. See the module docstring."""

    def __init__(
        self,
        machine: Machine,
        telemetry: TelemetrySource | Callable[[], list[GpuSample]] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        refresh_s: float = 0.05,
        nvml_numa: bool = True,
        nvlink_aggregate_scope: bool = True,
        inactive_links: int = 0,
        switches: int = 4,
    ):
        """
        clock, refresh_s: telemetry is pulled again once `refresh_s` of `clock` has passed.
        nvml_numa: answer nvmlDeviceGetNumaNodeId (False: NOT_SUPPORTED, as on most x86 machines).
        nvlink_aggregate_scope: accept scope UINT_MAX for NVLink throughput fields.
        inactive_links: extra NVLink slots, down, on every GPU that has NVLink.
        switches: NVSwitch chips that switch links are spread over.
        """
        self.machine = machine
        self.gpus = sorted(machine.gpus, key=lambda g: g.index)
        if [g.index for g in self.gpus] != list(range(len(self.gpus))):
            raise ValueError("FakeNvml needs GPUs numbered 0..n-1")
        self.calls: Counter[str] = Counter()
        self.calls_by_gpu: Counter[int] = Counter()
        self.max_wait_timeout_ms = 0
        self.driver_version = machine.host.driver_version or "550.54.15"
        self.cuda_version = _cuda_int(machine.host.cuda_driver_version or "12.4")
        self.nvml_version = f"12.{self.driver_version}"
        self._telemetry = telemetry if telemetry is not None else _default_telemetry(machine, clock)
        self._clock = clock
        self._refresh_s = refresh_s
        self._nvml_numa = nvml_numa
        self._aggregate_scope = nvlink_aggregate_scope
        self._injections: dict[str, list[_Injection]] = {}
        self._lost: set[int] = set()
        self._init_error: int | None = None
        self._init_count = 0
        self._event_sets: list[FakeEventSet] = []
        self._samples: dict[int, GpuSample] = {}
        self._sampled_at: float | None = None
        self._counters_at: float | None = None
        self._nvlink_kib = {g.index: [0.0, 0.0] for g in self.gpus}  # rx, tx
        self._links = _build_links(machine, self.gpus, inactive_links, switches)
        self._active_links = {i: sum(lk.active for lk in links) for i, links in self._links.items()}

    # -- test controls -------------------------------------------------------
    def inject(self, function: str, code: int, gpu: int | None = None, *, times: int | None = None) -> None:
        """Make `function` raise NVMLError(code) on `gpu` (None: on every GPU), `times` times or for ever."""
        if not getattr(getattr(self, function, None), "nvml_api", False):
            raise ValueError(f"FakeNvml does not implement {function!r}")
        self._injections.setdefault(function, []).append(_Injection(code, gpu, times))

    def clear_injections(self) -> None:
        self._injections.clear()

    def lose_gpu(self, index: int) -> None:
        """From now on every call on this GPU raises NVMLError_GpuIsLost, as after an XID 79."""
        self._lost.add(index)

    def fail_init(self, code: int | None) -> None:
        """nvmlInit raises NVMLError(code); None makes it succeed again."""
        self._init_error = code

    def emit_xid(self, gpu: int, xid: int) -> None:
        """Queue an XID critical-error event for every event set watching this GPU."""
        kind = pynvml.nvmlEventTypeXidCriticalError
        for es in self._event_sets:
            if not es.freed and es.gpus.get(gpu, 0) & kind:
                es.queue.append(_EventData(device=FakeHandle(gpu), eventType=kind, eventData=xid))

    def refresh(self, now: float | None = None) -> None:
        """Pull fresh telemetry; NVLink counters first accumulate the traffic of the old rates."""
        now = self._clock() if now is None else now
        self._advance_counters(now)
        samples = self._telemetry() if callable(self._telemetry) else self._telemetry.sample_gpus(Tier.SLOW)
        self._samples = {s.index: s for s in samples}
        self._sampled_at = now

    def current(self, index: int) -> GpuSample:
        """The telemetry the fake is answering with for this GPU now."""
        now = self._clock()
        if self._sampled_at is None or now - self._sampled_at >= self._refresh_s:
            self.refresh(now)
        sample = self._samples.get(index)
        if sample is None:
            raise KeyError(f"the telemetry source has no sample for GPU {index}")
        return sample

    @property
    def initialised(self) -> bool:
        return self._init_count > 0

    # -- the pynvml look-alike -------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        """Constants, error classes and structures come from the real pynvml."""
        value = getattr(pynvml, name)
        if name.startswith("nvml") and inspect.isfunction(value) and name not in _PYNVML_HELPERS:
            return functools.partial(self._not_in_replay, name)
        return value

    def _not_in_replay(self, name: str, *args: Any) -> Any:
        self.calls[name] += 1
        _raise(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def _gpus_in(self, name: str, args: tuple[Any, ...]) -> list[int]:
        if name == "nvmlDeviceGetHandleByIndex":
            return [args[0]]
        return [a.index for a in args if isinstance(a, FakeHandle)]

    def _check(self, name: str, gpus: list[int]) -> None:
        if not self._init_count and name not in ("nvmlInit", "nvmlInitWithFlags"):
            _raise(pynvml.NVML_ERROR_UNINITIALIZED)
        if self._lost.intersection(gpus):
            _raise(pynvml.NVML_ERROR_GPU_IS_LOST)
        for inj in self._injections.get(name, ()):
            if inj.times == 0 or (inj.gpu is not None and inj.gpu not in gpus):
                continue
            if inj.times is not None:
                inj.times -= 1
            _raise(inj.code)

    def _gpu(self, handle: FakeHandle) -> Gpu:
        return self.gpus[handle.index]

    # system
    @_nvml_api
    def nvmlInit(self) -> None:
        if self._init_error is not None:
            _raise(self._init_error)
        self._init_count += 1

    @_nvml_api
    def nvmlInitWithFlags(self, flags: int) -> None:
        if self._init_error is not None:
            _raise(self._init_error)
        self._init_count += 1

    @_nvml_api
    def nvmlShutdown(self) -> None:
        self._init_count -= 1

    @_nvml_api
    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver_version

    @_nvml_api
    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda_version

    @_nvml_api
    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.cuda_version

    @_nvml_api
    def nvmlSystemGetNVMLVersion(self) -> str:
        return self.nvml_version

    @_nvml_api
    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    @_nvml_api
    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        if not 0 <= index < len(self.gpus):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return FakeHandle(index)

    # device facts
    @_nvml_api
    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return self._gpu(handle).name

    @_nvml_api
    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        return _given(self._gpu(handle).uuid)

    @_nvml_api
    def nvmlDeviceGetPciInfo_v3(self, handle: FakeHandle) -> pynvml.nvmlPciInfo_t:
        return _pci_info(_given(self._gpu(handle).pci_bus_id))

    @_nvml_api
    def nvmlDeviceGetPciInfo(self, handle: FakeHandle) -> pynvml.nvmlPciInfo_t:
        return _pci_info(_given(self._gpu(handle).pci_bus_id))

    @_nvml_api
    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version: int | None = None) -> Any:
        g = self._gpu(handle)
        s = self.current(handle.index)
        total = _given(s.memory_total if s.memory_total is not None else g.memory_total)
        used = _given(s.memory_used)
        return pynvml.c_nvmlMemory_t(total=total, free=max(total - used, 0), used=used)

    @_nvml_api
    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeHandle) -> tuple[int, int]:
        major, minor = _given(self._gpu(handle).compute_capability).split(".")
        return int(major), int(minor)

    @_nvml_api
    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeHandle) -> int:
        limit = self.current(handle.index).power_limit_w
        return round(_given(limit if limit is not None else self._gpu(handle).power_limit_w) * 1000)

    @_nvml_api
    def nvmlDeviceGetMaxClockInfo(self, handle: FakeHandle, clock_type: int) -> int:
        g = self._gpu(handle)
        if clock_type in (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_GRAPHICS):
            return _given(g.max_sm_clock_mhz)
        if clock_type == pynvml.NVML_CLOCK_MEM:
            return _given(g.max_mem_clock_mhz)
        return _given(None)

    @_nvml_api
    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: FakeHandle) -> int:
        return _given(self._gpu(handle).pcie_gen_current)

    @_nvml_api
    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: FakeHandle) -> int:
        return _given(self._gpu(handle).pcie_gen_max)

    @_nvml_api
    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: FakeHandle) -> int:
        return _given(self._gpu(handle).pcie_width_current)

    @_nvml_api
    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: FakeHandle) -> int:
        return _given(self._gpu(handle).pcie_width_max)

    @_nvml_api
    def nvmlDeviceGetNumaNodeId(self, handle: FakeHandle) -> int:
        if not self._nvml_numa:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return _given(self._gpu(handle).numa_node)

    @_nvml_api
    def nvmlDeviceGetCpuAffinity(self, handle: FakeHandle, cpu_set_size: int) -> Any:
        words = (ctypes.c_ulonglong * cpu_set_size)()
        for cpu in _given(self._gpu(handle).cpu_affinity):
            if cpu < cpu_set_size * 64:  # a short buffer truncates, as in the driver
                words[cpu // 64] |= 1 << (cpu % 64)
        return words

    @_nvml_api
    def nvmlDeviceGetEccMode(self, handle: FakeHandle) -> list[int]:
        on = _feature(_given(self._gpu(handle).ecc_enabled))
        return [on, on]

    @_nvml_api
    def nvmlDeviceGetMigMode(self, handle: FakeHandle) -> list[int]:
        mig = pynvml.NVML_DEVICE_MIG_ENABLE if _given(self._gpu(handle).mig_enabled) else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mig, mig]

    @_nvml_api
    def nvmlDeviceGetPersistenceMode(self, handle: FakeHandle) -> int:
        return _feature(_given(self._gpu(handle).persistence_mode))

    # NVLink and topology
    def _link(self, handle: FakeHandle, link: int) -> _FakeLink:
        links = self._links[handle.index]
        if not links:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)  # a GPU without NVLink
        if not 0 <= link < len(links):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # a slot the GPU does not have
        return links[link]

    @_nvml_api
    def nvmlDeviceGetNvLinkState(self, handle: FakeHandle, link: int) -> int:
        return _feature(self._link(handle, link).active)

    @_nvml_api
    def nvmlDeviceGetNvLinkVersion(self, handle: FakeHandle, link: int) -> int:
        self._link(handle, link)
        gen = _given(self._gpu(handle).nvlink_gen)
        return _GEN_TO_NVLINK_VERSION.get(gen, pynvml.NVML_NVLINK_VERSION_INVALID)

    def _remote(self, handle: FakeHandle, link: int) -> _FakeLink:
        lk = self._link(handle, link)
        if not lk.active or lk.remote_bus is None:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return lk

    @_nvml_api
    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: FakeHandle, link: int) -> pynvml.nvmlPciInfo_t:
        return _pci_info(self._remote(handle, link).remote_bus or "")

    @_nvml_api
    def nvmlDeviceGetNvLinkRemotePciInfo_v2(self, handle: FakeHandle, link: int) -> pynvml.nvmlPciInfo_t:
        return _pci_info(self._remote(handle, link).remote_bus or "")

    @_nvml_api
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: FakeHandle, link: int) -> int:
        return self._remote(handle, link).remote_type

    @_nvml_api
    def nvmlDeviceGetTopologyCommonAncestor(self, a: FakeHandle, b: FakeHandle) -> int:
        if a.index == b.index:
            return pynvml.NVML_TOPOLOGY_INTERNAL
        pair = self.machine.pair(a.index, b.index)
        return _PCIE_TO_LEVEL[_given(pair.pcie if pair else None)]

    @_nvml_api
    def nvmlDeviceGetP2PStatus(self, a: FakeHandle, b: FakeHandle, p2p_index: Any) -> int:
        if isinstance(p2p_index, tuple):  # pynvml's NVML_P2P_CAPS_INDEX_READ is the tuple (0,)
            p2p_index = p2p_index[0]
        if a.index == b.index:
            return pynvml.NVML_P2P_STATUS_OK
        pair = self.machine.pair(a.index, b.index)
        if pair is None:
            return pynvml.NVML_P2P_STATUS_UNKNOWN
        if p2p_index == pynvml.NVML_P2P_CAPS_INDEX_WRITE:
            return _P2P_TO_STATUS[pair.p2p_write]
        if p2p_index == 0:
            return _P2P_TO_STATUS[pair.p2p_read]
        return pynvml.NVML_P2P_STATUS_UNKNOWN

    # telemetry, fast
    @_nvml_api
    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> Any:
        s = self.current(handle.index)
        return pynvml.c_nvmlUtilization_t(gpu=round(_given(s.gpu_util)), memory=round(_given(s.mem_util)))

    @_nvml_api
    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        return self._temperature(handle, sensor)

    @_nvml_api
    def nvmlDeviceGetTemperatureV(self, handle: FakeHandle, sensor: int, version: int | None = None) -> int:
        return self._temperature(handle, sensor)

    def _temperature(self, handle: FakeHandle, sensor: int) -> int:
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return round(_given(self.current(handle.index).temperature_c))

    @_nvml_api
    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        return round(_given(self.current(handle.index).power_w) * 1000)

    @_nvml_api
    def nvmlDeviceGetClockInfo(self, handle: FakeHandle, clock_type: int) -> int:
        s = self.current(handle.index)
        if clock_type in (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_GRAPHICS):
            return _given(s.sm_clock_mhz)
        if clock_type == pynvml.NVML_CLOCK_MEM:
            return _given(s.mem_clock_mhz)
        return _given(None)

    @_nvml_api
    def nvmlDeviceGetFanSpeed(self, handle: FakeHandle) -> int:
        return round(_given(self.current(handle.index).fan_pct))

    @_nvml_api
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:
        return encode_clock_event_reasons(_given(self.current(handle.index).throttle_reasons))

    @_nvml_api
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeHandle) -> int:
        return encode_clock_event_reasons(_given(self.current(handle.index).throttle_reasons))

    @_nvml_api
    def nvmlDeviceGetFieldValues(self, handle: FakeHandle, field_ids: list[Any]) -> Any:
        now = self._clock()
        self.current(handle.index)  # refreshes, and with it the counters, when due
        self._advance_counters(now)
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for v, fid in zip(values, field_ids, strict=True):
            # As pynvml does: a bare id leaves the scope at 0.
            v.fieldId, v.scopeId = fid if isinstance(fid, tuple) else (fid, 0)
            v.timestamp = int(now * 1e6)
            v.nvmlReturn, value = self._field(handle.index, v.fieldId, v.scopeId)
            if isinstance(value, float):
                v.valueType, v.value.dVal = pynvml.NVML_VALUE_TYPE_DOUBLE, value
            elif v.fieldId in _UINT_FIELDS:
                v.valueType, v.value.uiVal = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, value
            else:
                v.valueType, v.value.ullVal = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, value
        return values

    def _field(self, index: int, field_id: int, scope: int) -> tuple[int, int | float]:
        """(nvmlReturn, value) of one field, as the driver fills one slot of nvmlDeviceGetFieldValues."""
        links = self._links[index]
        if field_id not in _NVLINK_FIELDS or not links:
            return pynvml.NVML_ERROR_NOT_SUPPORTED, 0
        if field_id == pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT:
            return pynvml.NVML_SUCCESS, len(links)
        if field_id in (pynvml.NVML_FI_DEV_NVLINK_GET_SPEED, pynvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON):
            gbps = self.gpus[index].nvlink_link_gbps
            if gbps is None:
                return pynvml.NVML_ERROR_NOT_SUPPORTED, 0
            if field_id == pynvml.NVML_FI_DEV_NVLINK_GET_SPEED and not (0 <= scope < len(links)):
                return pynvml.NVML_ERROR_INVALID_ARGUMENT, 0
            return pynvml.NVML_SUCCESS, round(gbps * 1000)  # MB/s
        total = self._nvlink_kib[index][0 if field_id == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX else 1]
        if scope == UINT_MAX:
            return (
                (pynvml.NVML_SUCCESS, int(total)) if self._aggregate_scope else (pynvml.NVML_ERROR_INVALID_ARGUMENT, 0)
            )
        if scope >= len(links):
            return pynvml.NVML_ERROR_INVALID_ARGUMENT, 0
        # Traffic spreads evenly over the links that are up.
        active = self._active_links[index]
        return pynvml.NVML_SUCCESS, int(total / active) if links[scope].active and active else 0

    def _advance_counters(self, now: float) -> None:
        if self._counters_at is not None and now > self._counters_at:
            dt = now - self._counters_at
            for index, kib in self._nvlink_kib.items():
                s = self._samples.get(index)
                if s is not None:
                    kib[0] += (s.nvlink_rx_bps or 0.0) * dt / 1024
                    kib[1] += (s.nvlink_tx_bps or 0.0) * dt / 1024
        if self._counters_at is None or now > self._counters_at:
            self._counters_at = now

    def reset_nvlink_counters(self) -> None:
        """As a driver reload does."""
        for kib in self._nvlink_kib.values():
            kib[0] = kib[1] = 0.0

    # telemetry, slow
    @_nvml_api
    def nvmlDeviceGetPcieThroughput(self, handle: FakeHandle, counter: int) -> int:
        s = self.current(handle.index)
        bps = s.pcie_rx_bps if counter == pynvml.NVML_PCIE_UTIL_RX_BYTES else s.pcie_tx_bps
        return int(_given(bps) / 1024)  # KiB/s

    @_nvml_api
    def nvmlDeviceGetTotalEccErrors(self, handle: FakeHandle, error_type: int, counter_type: int) -> int:
        if not self._gpu(handle).ecc_enabled:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        s = self.current(handle.index)
        if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return _given(s.ecc_corrected)
        return _given(s.ecc_uncorrected)

    def _processes(self, handle: FakeHandle, kind: str) -> list[Any]:
        procs = _given(self.current(handle.index).processes)
        return [
            pynvml.nvmlFriendlyObject(
                {"pid": p.pid, "usedGpuMemory": p.used_memory, "gpuInstanceId": UINT_MAX, "computeInstanceId": UINT_MAX}
            )
            for p in procs
            if p.kind == kind or (kind == "compute" and p.kind not in ("compute", "graphics"))
        ]

    @_nvml_api
    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        return self._processes(handle, "compute")

    @_nvml_api
    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: FakeHandle) -> list[Any]:
        return self._processes(handle, "compute")

    @_nvml_api
    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: FakeHandle) -> list[Any]:
        return self._processes(handle, "compute")

    @_nvml_api
    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        return self._processes(handle, "graphics")

    @_nvml_api
    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: FakeHandle) -> list[Any]:
        return self._processes(handle, "graphics")

    @_nvml_api
    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle: FakeHandle) -> list[Any]:
        return self._processes(handle, "graphics")

    # events
    @_nvml_api
    def nvmlEventSetCreate(self) -> FakeEventSet:
        es = FakeEventSet()
        self._event_sets.append(es)
        return es

    @_nvml_api
    def nvmlDeviceGetSupportedEventTypes(self, handle: FakeHandle) -> int:
        return pynvml.nvmlEventTypeAll

    @_nvml_api
    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, event_types: int, event_set: FakeEventSet) -> None:
        event_set.gpus[handle.index] = event_set.gpus.get(handle.index, 0) | event_types

    @_nvml_api
    def nvmlEventSetWait(self, event_set: FakeEventSet, timeout_ms: int) -> Any:
        return self._wait(event_set, timeout_ms)

    @_nvml_api
    def nvmlEventSetWait_v2(self, event_set: FakeEventSet, timeout_ms: int) -> Any:
        return self._wait(event_set, timeout_ms)

    def _wait(self, event_set: FakeEventSet, timeout_ms: int) -> Any:
        # Never sleeps: the largest timeout asked for is recorded so tests can insist on 0.
        self.max_wait_timeout_ms = max(self.max_wait_timeout_ms, timeout_ms)
        if event_set.freed:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not event_set.queue:
            _raise(pynvml.NVML_ERROR_TIMEOUT)
        return event_set.queue.pop(0)

    @_nvml_api
    def nvmlEventSetFree(self, event_set: FakeEventSet) -> None:
        event_set.freed = True

    @_nvml_api
    def nvmlErrorString(self, code: int) -> str:
        return pynvml.NVMLError._errcode_to_string.get(code, f"Unknown Error {code}")


@dataclass
class _EventData:
    """Shaped like pynvml's c_nvmlEventData_t, with a FakeHandle as the device."""

    device: FakeHandle
    eventType: int
    eventData: int
    gpuInstanceId: int = UINT_MAX
    computeInstanceId: int = UINT_MAX


def api_functions() -> list[str]:
    """The NVML functions FakeNvml implements."""
    return sorted(n for n, v in vars(FakeNvml).items() if getattr(v, "nvml_api", False))


@contextmanager
def install(fake: FakeNvml) -> Iterator[FakeNvml]:
    """Within the block, the real `pynvml` module answers from `fake`.

    Every function the fake implements is swapped in; everything else that would
    reach the C library fails with NVMLError_FunctionNotFound instead.
    """
    missing = object()
    saved: dict[str, Any] = {}

    def swap(name: str, value: Any) -> None:
        saved.setdefault(name, vars(pynvml).get(name, missing))
        setattr(pynvml, name, value)

    try:
        for name in api_functions():
            swap(name, getattr(fake, name))
        swap("_nvmlGetFunctionPointer", _no_library)
        yield fake
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(pynvml, name)
            else:
                setattr(pynvml, name, value)


def _no_library(name: str) -> Any:
    raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)


# -- building the replay ---------------------------------------------------------


def _given(value: Any) -> Any:
    """A value the machine or telemetry has, or the driver's answer for one it lacks."""
    if value is None:
        _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return value


def _feature(on: bool) -> int:
    return pynvml.NVML_FEATURE_ENABLED if on else pynvml.NVML_FEATURE_DISABLED


def _cuda_int(version: str) -> int:
    major, minor = version.split(".")[:2]
    return int(major) * 1000 + int(minor) * 10


def _pci_info(bus_id: str) -> Any:
    info = pynvml.nvmlPciInfo_t()
    info.busId = bus_id.encode()
    dom, bus, rest = bus_id.split(":")
    info.busIdLegacy = f"{int(dom, 16):04X}:{bus}:{rest}".encode()
    info.domain, info.bus, info.device = int(dom, 16), int(bus, 16), int(rest.split(".")[0], 16)
    return info


def _build_links(machine: Machine, gpus: list[Gpu], inactive: int, switches: int) -> dict[int, list[_FakeLink]]:
    """Lay out NVLink slots so that walking them gives back the machine's pairs.

    Direct pairs (bridges, NVLink meshes) get `nvlink_count` links on each side
    pointing at each other; a GPU on an NVSwitch fabric gets its remaining active
    links spread round-robin over `switches` switch chips.
    """
    used_buses = {int(g.pci_bus_id.split(":")[1], 16) for g in gpus if g.pci_bus_id}
    free = [b for b in range(1, 256) if b not in used_buses]
    switch_buses = [f"00000000:{free[i]:02X}:00.0" for i in range(max(switches, 1))]
    on_fabric = {i for p in machine.pairs if p.nvswitch and p.nvlink_count for i in (p.a, p.b)}
    links: dict[int, list[_FakeLink]] = {g.index: [] for g in gpus}
    for p in machine.pairs:
        if p.nvlink_count and not p.nvswitch:
            ga, gb = gpus[p.a], gpus[p.b]
            links[p.a] += [_FakeLink(True, gb.pci_bus_id) for _ in range(p.nvlink_count)]
            links[p.b] += [_FakeLink(True, ga.pci_bus_id) for _ in range(p.nvlink_count)]
    for g in gpus:
        own = links[g.index]
        if g.index in on_fabric:
            extra = (g.nvlink_links or 0) - len(own)
            own += [
                _FakeLink(True, switch_buses[n % len(switch_buses)], pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH)
                for n in range(extra)
            ]
        if own or g.nvlink_links:
            own += [_FakeLink(False) for _ in range(inactive)]
    return links


def _default_telemetry(machine: Machine, clock: Callable[[], float]) -> TelemetrySource | Callable[[], list[GpuSample]]:
    if machine.simulated and machine.profile:
        from rigpilot.engine.hardware.simulated import SimulatedBackend

        return SimulatedBackend(machine, seed=0, clock=clock)
    return functools.partial(idle_samples, machine)


def idle_samples(machine: Machine) -> list[GpuSample]:
    """Plausible telemetry of an idle machine, for replays of machines without a simulation."""
    out = []
    for g in machine.gpus:
        out.append(
            GpuSample(
                index=g.index,
                gpu_util=0.0,
                mem_util=0.0,
                memory_used=512 * MIB,
                memory_total=g.memory_total,
                temperature_c=35.0,
                power_w=40.0,
                power_limit_w=g.power_limit_w,
                sm_clock_mhz=210,
                mem_clock_mhz=405,
                fan_pct=30.0,
                throttle_reasons=["idle"],
                nvlink_rx_bps=0.0,
                nvlink_tx_bps=0.0,
                pcie_rx_bps=0.0,
                pcie_tx_bps=0.0,
                ecc_corrected=0,
                ecc_uncorrected=0,
                processes=[],
            )
        )
    return out
