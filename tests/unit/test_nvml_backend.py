"""The NVML backend, run against FakeNvml replays of simulated and hand-built machines.

No GPU or driver is needed: FakeNvml answers pynvml's functions from a Machine
and raises the real pynvml error classes when told to.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import psutil
import pynvml
import pytest

from rigpilot.engine.hardware import nvml_backend
from rigpilot.engine.hardware.discovery import plain_reason
from rigpilot.engine.hardware.machine import P2P, Gpu, GpuPair, Host, Machine, NumaNode, PciePath, Source
from rigpilot.engine.hardware.nvml_backend import (
    CLOCK_EVENT_REASONS,
    ECC_DISABLED,
    FAST_FIELDS,
    GPU_LOST,
    NO_NVLINK,
    NOT_SUPPORTED,
    TOPOLOGY_LEVELS,
    WARMING_UP,
    NvmlBackend,
    NvmlFailure,
    NvmlUnavailable,
    bus_key,
    cpus_from_affinity_words,
    cuda_version_string,
    decode_clock_event_reasons,
    encode_clock_event_reasons,
    is_throttled,
)
from rigpilot.engine.hardware.nvml_replay import FakeHandle, FakeNvml, api_functions, idle_samples, install
from rigpilot.engine.hardware.simulated import Load, SimulatedBackend, load_profile
from rigpilot.engine.hardware.telemetry import SLOW_FIELDS, GpuProcess, GpuSample, TelemetrySample, Tier

PROFILES = [
    "8x-h100-sxm",
    "8x-a100-pcie",
    "4x-rtx4090",
    "2x-rtx3090-nvlink",
    "4x-rtxa6000-bridged",
    "mixed-4090-3090",
    "1x-rtx4090",
]
GIB = 1024**3
MIB = 1024**2
VANISHED_PID = 2**22 + 1  # above the kernel's largest pid_max, so never a live process


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class Telemetry:
    """A telemetry source whose samples a test sets by hand."""

    def __init__(self, machine: Machine):
        self.samples = idle_samples(machine)
        for s in self.samples:
            s.ecc_corrected, s.ecc_uncorrected = 0, 0

    def __call__(self) -> list[GpuSample]:
        return self.samples

    def __getitem__(self, index: int) -> GpuSample:
        return self.samples[index]


def backend_for(fake: FakeNvml, **kw) -> NvmlBackend:
    host = fake.machine.host
    return NvmlBackend(fake, host_reader=lambda: copy.deepcopy(host), **kw)


def replay(machine: Machine | str, telemetry=None, **fake_kw) -> tuple[FakeNvml, NvmlBackend]:
    m = load_profile(machine) if isinstance(machine, str) else machine
    fake = FakeNvml(m, telemetry, **fake_kw)
    return fake, backend_for(fake)


def rich_machine() -> Machine:
    """Two NVLinked GPUs that can report every field (ECC on, fans present)."""
    m = load_profile("2x-rtx3090-nvlink")
    for g in m.gpus:
        g.ecc_enabled = True
        g.nvlink_link_gbps = 14.062
    return m


def hand_machine(pcie: dict[tuple[int, int], PciePath], n: int, **pair_kw) -> Machine:
    host = Host(threads=8, numa_nodes=[NumaNode(0, list(range(8)))], driver_version="535.104.05")
    host.cuda_driver_version = "12.2"
    gpus = [
        Gpu(
            index=i,
            name="NVIDIA L40S",
            uuid=f"GPU-{i}",
            pci_bus_id=f"00000000:{0x41 + i:02X}:00.0",
            memory_total=48 * GIB,
            numa_node=0,
            cpu_affinity=list(range(8)),
            nvlink_links=0,
        )
        for i in range(n)
    ]
    pairs = [GpuPair(a=a, b=b, pcie=pcie.get((a, b)), **pair_kw) for a in range(n) for b in range(a + 1, n)]
    return Machine(source=Source.SIMULATED, host=host, gpus=gpus, pairs=pairs)


def gpu_facts(g: Gpu) -> dict:
    d = dataclasses.asdict(g)
    del d["unavailable"]
    return d


def pair_facts(p: GpuPair) -> tuple:
    return (p.a, p.b, p.pcie, p.nvlink_count, p.nvlink_gen, p.nvswitch, p.p2p_read, p.p2p_write, p.topo_code)


# -- topology -------------------------------------------------------------------


@pytest.mark.parametrize("profile", PROFILES)
def test_replay_reproduces_the_machine(profile):
    want = load_profile(profile)
    _, backend = replay(profile)
    got = backend.machine()

    assert got.source is Source.NVML
    assert got.host.driver_version == want.host.driver_version
    assert got.host.cuda_driver_version == want.host.cuda_driver_version
    assert got.host.nvml_version == f"12.{want.host.driver_version}"
    assert got.origin == f"NVML {want.host.driver_version}"
    assert [gpu_facts(g) for g in got.gpus] == [gpu_facts(g) for g in want.gpus]
    assert [pair_facts(p) for p in got.pairs] == [pair_facts(p) for p in want.pairs]
    assert got.notes == []
    for g in got.gpus:  # every missing field says why
        assert {k for k, v in gpu_facts(g).items() if v is None} == set(g.unavailable)
    # Plain data: it crosses the engine socket as JSON and comes back the same.
    assert Machine.from_dict(json.loads(json.dumps(got.to_dict()))) == got
    backend.close()


def test_nvswitch_fabric_gives_every_pair_nv18():
    h100 = load_profile("8x-h100-sxm")
    for g in h100.gpus:
        g.nvlink_link_gbps = 26.562
    fake, backend = replay(h100)
    m = backend.machine()
    assert {g.nvlink_link_gbps for g in m.gpus} == {26.562}
    assert len(m.pairs) == 28
    assert {p.topo_code for p in m.pairs} == {"NV18"}
    assert all(p.nvswitch and p.nvlink_gen == 4 for p in m.pairs)
    assert all(g.nvlink_links == 18 and g.nvlink_gen == 4 for g in m.gpus)
    # The fabric is several switch chips, and the links really were walked to them.
    switch_buses = {fake.nvmlDeviceGetNvLinkRemotePciInfo(FakeHandle(0), link).busId for link in range(18)}
    assert len(switch_buses) == 4
    assert fake.calls["nvmlDeviceGetNvLinkRemoteDeviceType"] >= 8 * 18


def test_nvswitch_pair_count_is_the_weaker_gpus_links():
    m = load_profile("8x-h100-sxm")
    m.gpus[3].nvlink_links = 16  # two links down on GPU 3
    _, backend = replay(m)
    got = backend.machine()
    for p in got.pairs:
        assert p.nvswitch
        assert p.nvlink_count == (16 if 3 in (p.a, p.b) else 18), p


def test_link_speed_from_the_older_field():
    m = rich_machine()
    fake = FakeNvml(m)
    real_field = fake._field
    newer = pynvml.NVML_FI_DEV_NVLINK_GET_SPEED
    fake._field = lambda i, f, scope: (pynvml.NVML_ERROR_INVALID_ARGUMENT, 0) if f == newer else real_field(i, f, scope)
    assert [g.nvlink_link_gbps for g in backend_for(fake).machine().gpus] == [14.062, 14.062]

    fake = FakeNvml(load_profile("2x-rtx3090-nvlink"))  # a driver that knows neither field
    g = backend_for(fake).machine().gpus[0]
    assert g.nvlink_link_gbps is None and g.unavailable["nvlink_link_gbps"] == NOT_SUPPORTED


def test_inactive_links_are_not_counted():
    _, backend = replay("2x-rtx3090-nvlink", inactive_links=2)
    m = backend.machine()
    assert [g.nvlink_links for g in m.gpus] == [4, 4]
    assert m.pair(0, 1).topo_code == "NV4" and not m.pair(0, 1).nvswitch


def test_links_without_remote_type_are_still_placed():
    fake = FakeNvml(load_profile("8x-h100-sxm"))
    fake.inject("nvmlDeviceGetNvLinkRemoteDeviceType", pynvml.NVML_ERROR_NOT_SUPPORTED)
    m = backend_for(fake).machine()
    assert {p.topo_code for p in m.pairs} == {"NV18"} and all(p.nvswitch for p in m.pairs)
    assert any("NVSwitch" in n for n in m.notes)

    fake = FakeNvml(load_profile("2x-rtx3090-nvlink"))
    fake.inject("nvmlDeviceGetNvLinkRemoteDeviceType", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    m = backend_for(fake).machine()
    assert m.pair(0, 1).topo_code == "NV4" and not m.pair(0, 1).nvswitch
    assert m.notes == []


def test_every_pcie_level_maps_to_its_topo_code():
    pcie = {
        (0, 1): PciePath.PIX,
        (0, 2): PciePath.PXB,
        (0, 3): PciePath.PHB,
        (1, 2): PciePath.NODE,
        (1, 3): PciePath.SYS,
        (2, 3): PciePath.SELF,  # the fake answers NVML_TOPOLOGY_INTERNAL: two GPUs on one board
    }
    _, backend = replay(hand_machine(pcie, 4))
    m = backend.machine()
    assert {p.key: p.pcie for p in m.pairs} == {**pcie, (2, 3): PciePath.PIX}
    assert m.pair(0, 1).topo_code == "PIX" and m.pair(1, 3).topo_code == "SYS"
    assert TOPOLOGY_LEVELS == {
        pynvml.NVML_TOPOLOGY_INTERNAL: PciePath.PIX,
        pynvml.NVML_TOPOLOGY_SINGLE: PciePath.PIX,
        pynvml.NVML_TOPOLOGY_MULTIPLE: PciePath.PXB,
        pynvml.NVML_TOPOLOGY_HOSTBRIDGE: PciePath.PHB,
        pynvml.NVML_TOPOLOGY_NODE: PciePath.NODE,
        pynvml.NVML_TOPOLOGY_SYSTEM: PciePath.SYS,
    }


def test_unknown_pcie_path_is_none_with_a_note():
    fake = FakeNvml(hand_machine({(0, 1): PciePath.PHB}, 3))  # (0,2) and (1,2) not given: NOT_SUPPORTED
    m = backend_for(fake).machine()
    assert m.pair(0, 1).pcie is PciePath.PHB
    assert m.pair(0, 2).pcie is None and m.pair(0, 2).topo_code == "N/A"
    assert m.notes == ["PCIe path unknown for 2 GPU pairs (not supported)."]


def test_p2p_status_read_write_and_unknown():
    m = hand_machine({}, 3, p2p_read=P2P.OK, p2p_write=P2P.UNSUPPORTED)
    m.pair(1, 2).p2p_read = P2P.UNKNOWN
    fake = FakeNvml(m)
    fake.inject("nvmlDeviceGetP2PStatus", pynvml.NVML_ERROR_UNKNOWN, gpu=2, times=1)
    got = backend_for(fake).machine()
    assert (got.pair(0, 1).p2p_read, got.pair(0, 1).p2p_write) == (P2P.OK, P2P.UNSUPPORTED)
    assert got.pair(0, 2).p2p_read is P2P.UNKNOWN  # the one failed query
    assert got.pair(0, 2).p2p_write is P2P.UNSUPPORTED
    assert got.pair(1, 2).p2p_read is P2P.UNKNOWN


def test_cpu_affinity_words():
    assert cpus_from_affinity_words([0b1011, 1 << 63]) == [0, 1, 3, 127]
    assert cpus_from_affinity_words([0, 0]) == []
    fake, backend = replay("8x-h100-sxm")  # 224 CPUs: four words
    m = backend.machine()
    assert m.gpus[0].cpu_affinity == list(range(56)) + list(range(112, 168))
    assert m.gpus[7].cpu_affinity == list(range(56, 112)) + list(range(168, 224))
    words = fake.nvmlDeviceGetCpuAffinity(FakeHandle(7), 4)
    assert cpus_from_affinity_words(words) == m.gpus[7].cpu_affinity


def write_sysfs_numa(root: Path, bus_id: str, node: int) -> None:
    dom, rest = bus_id.lower().split(":", 1)
    d = root / "bus/pci/devices" / f"{int(dom, 16):04x}:{rest}"
    d.mkdir(parents=True)
    (d / "numa_node").write_text(f"{node}\n")


def test_numa_node_from_sysfs_when_nvml_cannot_tell(tmp_path):
    m = load_profile("8x-h100-sxm")
    for g in m.gpus:
        write_sysfs_numa(tmp_path, g.pci_bus_id, g.numa_node)
    fake = FakeNvml(m, nvml_numa=False)
    got = backend_for(fake, sys_root=tmp_path).machine()
    assert [g.numa_node for g in got.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert fake.calls["nvmlDeviceGetNumaNodeId"] == 8

    # Neither NVML nor sysfs: None, with NVML's reason.
    got = backend_for(FakeNvml(m, nvml_numa=False), sys_root=tmp_path / "nothing").machine()
    assert got.gpus[0].numa_node is None and got.gpus[0].unavailable["numa_node"] == NOT_SUPPORTED


def test_numa_node_of_gpu_memory_is_replaced_by_the_pci_node(tmp_path):
    # On Grace Hopper NVML names the GPU's own (CPU-less) memory node.
    m = hand_machine({}, 1)
    m.host.numa_nodes = [NumaNode(0, list(range(8))), NumaNode(1, [])]
    m.gpus[0].numa_node = 1
    write_sysfs_numa(tmp_path, m.gpus[0].pci_bus_id, 0)
    got = backend_for(FakeNvml(m), sys_root=tmp_path).machine()
    assert got.gpus[0].numa_node == 0


def test_bus_ids_compare_whatever_their_spelling():
    assert bus_key("00000000:2A:00.0") == bus_key("0000:2a:00.0") == (0, 0x2A, 0, 0)
    assert bus_key(b"00000001:c1:00.1") == (1, 0xC1, 0, 1)
    assert bus_key("") is None and bus_key("garbage") is None and bus_key(None) is None


# -- versions -----------------------------------------------------------------------


def test_cuda_version_string():
    assert cuda_version_string(12050) == "12.5"
    assert cuda_version_string(11080) == "11.8"
    assert cuda_version_string(12000) == "12.0"


def test_cuda_version_falls_back_to_the_older_function():
    fake = FakeNvml(load_profile("4x-rtx4090"))
    fake.inject("nvmlSystemGetCudaDriverVersion_v2", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    m = backend_for(fake).machine()
    assert m.host.cuda_driver_version == "12.4"
    assert fake.calls["nvmlSystemGetCudaDriverVersion"] == 1


def test_versions_that_cannot_be_read():
    fake = FakeNvml(load_profile("4x-rtx4090"))
    fake.inject("nvmlSystemGetDriverVersion", pynvml.NVML_ERROR_NO_PERMISSION)
    fake.inject("nvmlSystemGetCudaDriverVersion_v2", pynvml.NVML_ERROR_NOT_SUPPORTED)
    fake.inject("nvmlSystemGetNVMLVersion", pynvml.NVML_ERROR_UNKNOWN)
    m = backend_for(fake).machine()
    assert (m.host.driver_version, m.host.cuda_driver_version, m.host.nvml_version) == (None, None, None)
    assert m.host.unavailable == {
        "driver_version": "no permission",
        "cuda_driver_version": "not supported",
        "nvml_version": "NVML error: Unknown Error",
    }
    assert m.origin == "NVML"
    assert len(m.gpus) == 4


# -- errors, field by field -----------------------------------------------------------

ERRORS = [
    (pynvml.NVML_ERROR_NOT_SUPPORTED, "not supported"),
    (pynvml.NVML_ERROR_NO_PERMISSION, "no permission"),
    (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, "NVML error: Function Not Found"),
    (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "NVML error: RM has detected an NVML/RM version mismatch."),
    (pynvml.NVML_ERROR_CORRUPTED_INFOROM, "NVML error: Corrupted infoROM"),
    (pynvml.NVML_ERROR_UNKNOWN, "NVML error: Unknown Error"),
]

# (where the field lives, the functions that fill it, the fields they fill)
FIELDS = [
    ("gpu", ["nvmlDeviceGetUUID"], ["uuid"]),
    ("gpu", ["nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetPciInfo"], ["pci_bus_id"]),
    ("gpu", ["nvmlDeviceGetCudaComputeCapability"], ["compute_capability"]),
    ("gpu", ["nvmlDeviceGetMaxClockInfo"], ["max_sm_clock_mhz", "max_mem_clock_mhz"]),
    ("gpu", ["nvmlDeviceGetCurrPcieLinkGeneration"], ["pcie_gen_current"]),
    ("gpu", ["nvmlDeviceGetMaxPcieLinkGeneration"], ["pcie_gen_max"]),
    ("gpu", ["nvmlDeviceGetCurrPcieLinkWidth"], ["pcie_width_current"]),
    ("gpu", ["nvmlDeviceGetMaxPcieLinkWidth"], ["pcie_width_max"]),
    ("gpu", ["nvmlDeviceGetCpuAffinity"], ["cpu_affinity"]),
    ("gpu", ["nvmlDeviceGetEccMode"], ["ecc_enabled"]),
    ("gpu", ["nvmlDeviceGetMigMode"], ["mig_enabled"]),
    ("gpu", ["nvmlDeviceGetPersistenceMode"], ["persistence_mode"]),
    ("gpu", ["nvmlDeviceGetNvLinkVersion"], ["nvlink_gen"]),
    ("gpu", ["nvmlDeviceGetFieldValues"], ["nvlink_link_gbps"]),
    ("gpu", ["nvmlDeviceGetMemoryInfo"], ["memory_total"]),
    ("gpu", ["nvmlDeviceGetEnforcedPowerLimit"], ["power_limit_w"]),
    ("fast", ["nvmlDeviceGetUtilizationRates"], ["gpu_util", "mem_util"]),
    ("fast", ["nvmlDeviceGetMemoryInfo"], ["memory_used", "memory_total"]),
    ("fast", ["nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"], ["temperature_c"]),
    ("fast", ["nvmlDeviceGetPowerUsage"], ["power_w"]),
    ("fast", ["nvmlDeviceGetEnforcedPowerLimit"], ["power_limit_w"]),
    ("fast", ["nvmlDeviceGetClockInfo"], ["sm_clock_mhz", "mem_clock_mhz"]),
    ("fast", ["nvmlDeviceGetFanSpeed"], ["fan_pct"]),
    (
        "fast",
        ["nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"],
        ["throttle_reasons"],
    ),
    ("fast", ["nvmlDeviceGetFieldValues"], ["nvlink_rx_bps", "nvlink_tx_bps"]),
    ("slow", ["nvmlDeviceGetPcieThroughput"], ["pcie_rx_bps", "pcie_tx_bps"]),
    ("slow", ["nvmlDeviceGetTotalEccErrors"], ["ecc_corrected", "ecc_uncorrected"]),
    (
        "slow",
        [
            "nvmlDeviceGetComputeRunningProcesses_v3",
            "nvmlDeviceGetComputeRunningProcesses_v2",
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetGraphicsRunningProcesses_v3",
            "nvmlDeviceGetGraphicsRunningProcesses_v2",
            "nvmlDeviceGetGraphicsRunningProcesses",
        ],
        ["processes"],
    ),
    ("slow", ["nvmlDeviceGetSupportedEventTypes"], ["xid"]),
    ("slow", ["nvmlDeviceRegisterEvents"], ["xid"]),
]


@pytest.mark.parametrize(("code", "reason"), ERRORS, ids=[r for _, r in ERRORS])
@pytest.mark.parametrize(("where", "functions", "names"), FIELDS, ids=[f"{w}-{n[0]}" for w, _, n in FIELDS])
def test_each_error_costs_only_its_field(where, functions, names, code, reason):
    m = rich_machine()
    fake = FakeNvml(m, Telemetry(m))
    for fn in functions:
        fake.inject(fn, code, gpu=1)
    backend = backend_for(fake)
    machine = backend.machine()
    samples = backend.sample_gpus(Tier.SLOW)
    broken, fine = (machine.gpus[1], machine.gpus[0]) if where == "gpu" else (samples[1], samples[0])
    for name in names:
        assert getattr(broken, name) is None, name
        assert broken.unavailable[name] == reason, name
        assert broken.unavailable.get(name) != fine.unavailable.get(name), name
    # Everything else about the GPU was still read.
    assert machine.gpus[1].name == "NVIDIA GeForce RTX 3090"
    assert samples[1].gpu_util is not None or "gpu_util" in names
    assert samples[1].health == "ok"
    backend.close()


@pytest.mark.parametrize(("code", "reason"), ERRORS[1:], ids=[r for _, r in ERRORS[1:]])
def test_errors_walking_nvlink_leave_the_links_unknown(code, reason):
    fake = FakeNvml(load_profile("2x-rtx3090-nvlink"))
    fake.inject("nvmlDeviceGetNvLinkState", code, gpu=1)
    m = backend_for(fake).machine()
    assert m.gpus[1].nvlink_links is None and m.gpus[1].unavailable["nvlink_links"] == reason
    assert m.gpus[0].nvlink_links == 4
    assert m.pair(0, 1).nvlink_count == 4  # GPU 0's side of the bridge still counts


def test_a_gpu_without_nvlink_has_zero_links():
    m = backend_for(FakeNvml(load_profile("4x-rtx4090"))).machine()
    assert [g.nvlink_links for g in m.gpus] == [0, 0, 0, 0]
    assert m.gpus[0].unavailable["nvlink_gen"] == m.gpus[0].unavailable["nvlink_link_gbps"] == NO_NVLINK


def test_gpu_name_that_cannot_be_read():
    fake = FakeNvml(rich_machine())
    fake.inject("nvmlDeviceGetName", pynvml.NVML_ERROR_UNKNOWN, gpu=0)
    m = backend_for(fake).machine()
    assert m.gpus[0].name == "(unknown)" and m.gpus[0].unavailable["name"] == "NVML error: Unknown Error"
    assert m.gpus[0].uuid is not None


def test_transient_error_recovers():
    m = rich_machine()
    fake = FakeNvml(m, Telemetry(m))
    backend = backend_for(fake)
    fake.inject("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_UNKNOWN, times=1)
    assert backend.sample_gpus(Tier.FAST)[0].power_w is None
    assert backend.sample_gpus(Tier.FAST)[0].power_w == 40.0


# -- lost GPUs -----------------------------------------------------------------------


def test_gpu_lost_while_sampling():
    fake, backend = replay("8x-h100-sxm")
    backend.sample_gpus(Tier.SLOW)
    fake.lose_gpu(2)
    fast = backend.sample_gpus(Tier.FAST)
    lost = fast[2]
    assert lost.health == "lost"
    for name in FAST_FIELDS:
        assert getattr(lost, name) is None and lost.unavailable[name] == GPU_LOST
    assert all(s.gpu_util is not None and s.health is None for i, s in enumerate(fast) if i != 2)

    # A lost GPU is not asked again.
    asked = fake.calls_by_gpu[2]
    slow = backend.sample_gpus(Tier.SLOW)
    backend.sample_gpus(Tier.FAST)
    assert fake.calls_by_gpu[2] == asked
    assert slow[2].health == "lost"
    for name in SLOW_FIELDS:
        if name != "health":
            assert slow[2].unavailable[name] == GPU_LOST
    assert [s.health for i, s in enumerate(slow) if i != 2] == ["ok"] * 7


def test_gpu_lost_before_start():
    fake = FakeNvml(load_profile("2x-rtx3090-nvlink"))
    fake.lose_gpu(1)
    backend = backend_for(fake)
    m = backend.machine()
    g = m.gpus[1]
    assert g.name == "(unknown)"
    for name, value in gpu_facts(g).items():
        if name not in ("index", "name"):
            assert value is None and g.unavailable[name] == GPU_LOST, name
    pair = m.pair(0, 1)
    assert pair.pcie is None and pair.p2p_read is P2P.UNKNOWN
    assert pair.nvlink_count == 0  # GPU 0's links point at a GPU NVML no longer knows
    assert m.gpus[0].nvlink_links == 4
    assert m.notes == ["PCIe path unknown for 1 GPU pair (GPU lost)."]
    assert [s.health for s in backend.sample_gpus(Tier.SLOW)] == ["ok", "lost"]


def test_gpu_lost_half_way_through_its_facts():
    fake = FakeNvml(rich_machine())
    fake.inject("nvmlDeviceGetCudaComputeCapability", pynvml.NVML_ERROR_GPU_IS_LOST, gpu=1)
    backend = backend_for(fake)
    g = backend.machine().gpus[1]
    assert g.memory_total == 24 * GIB  # read before
    assert g.unavailable["compute_capability"] == GPU_LOST
    assert g.unavailable["power_limit_w"] == GPU_LOST  # read after
    assert g.unavailable["nvlink_links"] == GPU_LOST
    assert backend.sample_gpus(Tier.FAST)[1].health == "lost"


def test_other_handle_failures_are_not_called_lost():
    fake = FakeNvml(rich_machine())
    fake.inject("nvmlDeviceGetHandleByIndex", pynvml.NVML_ERROR_NO_PERMISSION, gpu=0)
    backend = backend_for(fake)
    assert backend.machine().gpus[0].unavailable["uuid"] == "no permission"
    s = backend.sample_gpus(Tier.SLOW)[0]
    assert s.health is None and s.unavailable["health"] == "no permission"


# -- starting NVML ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "kind", "plain"),
    [
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, NvmlFailure.DRIVER_NOT_LOADED, "The NVIDIA driver is installed but not loaded"),
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, NvmlFailure.DRIVER_MISSING, "No NVIDIA driver found (libnvidia-ml.so.1 is missing)"),
        (pynvml.NVML_ERROR_NO_PERMISSION, NvmlFailure.NO_PERMISSION, "Your user may not use the NVIDIA driver"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, NvmlFailure.VERSION_MISMATCH,
         "The NVIDIA driver was updated and needs a reboot"),
        (pynvml.NVML_ERROR_UNKNOWN, NvmlFailure.OTHER, "Rigpilot could not use the NVIDIA driver"),
    ],
)
def test_an_init_failure_has_a_kind_and_the_kind_chooses_the_plain_words(code, kind, plain):
    fake = FakeNvml(load_profile("4x-rtx4090"))
    fake.fail_init(code)
    with pytest.raises(NvmlUnavailable) as err:
        backend_for(fake)
    assert err.value.kind is kind and plain_reason(err.value.kind) == plain
    # The line keeps NVML's own words, on one line, for the log and a tooltip.
    assert "\n" not in str(err.value) and f"(NVML: {pynvml.NVMLError(code)})" in str(err.value)
    assert isinstance(err.value.__cause__, pynvml.NVMLError)


def test_the_driver_line_is_worded_for_the_log():
    # Wording is the point here: what the log and the banner's tooltip show for the commonest failure.
    fake = FakeNvml(load_profile("4x-rtx4090"))
    fake.fail_init(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    with pytest.raises(NvmlUnavailable) as err:
        backend_for(fake)
    assert str(err.value) == "NVIDIA driver not installed: libnvidia-ml.so.1 not found (NVML: NVML Shared Library Not Found)"


def test_device_count_failure_shuts_nvml_down():
    fake = FakeNvml(load_profile("4x-rtx4090"))
    fake.inject("nvmlDeviceGetCount", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(NvmlUnavailable, match="could not count") as err:
        backend_for(fake)
    assert not fake.initialised and err.value.kind is NvmlFailure.OTHER


def test_pynvml_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with pytest.raises(NvmlUnavailable, match=r"^nvidia-ml-py is not installed \(.*pynvml.*\)$") as err:
        NvmlBackend()
    assert err.value.kind is NvmlFailure.LIBRARY_MISSING


def test_real_pynvml_on_this_machine():
    """Without a driver the real module must fail cleanly; with one it must describe the GPUs."""
    try:
        backend = NvmlBackend()
    except NvmlUnavailable as e:
        assert "\n" not in str(e) and "(NVML: " in str(e)
        return
    with backend:
        m = backend.machine()
        samples = backend.sample_gpus(Tier.SLOW)
    assert len(samples) == len(m.gpus)
    assert all(g.pci_bus_id and g.memory_total for g in m.gpus)
    json.dumps(m.to_dict())


def test_no_gpus():
    m = hand_machine({}, 0)
    _, backend = replay(m)
    assert backend.machine().gpus == [] and backend.sample_gpus(Tier.SLOW) == []


def test_init_once_handles_cached_and_close():
    fake, backend = replay("8x-h100-sxm")
    backend.machine()
    for _ in range(5):
        backend.sample_gpus(Tier.FAST)
        backend.sample_gpus(Tier.SLOW)
    assert fake.calls["nvmlInit"] == 1
    assert fake.calls["nvmlDeviceGetHandleByIndex"] == 8
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 8 * 36  # walked once, at start
    backend.close()
    backend.close()
    assert fake.calls["nvmlShutdown"] == 1 and not fake.initialised
    assert fake.calls["nvmlEventSetFree"] == 1
    with pytest.raises(RuntimeError, match="closed"):
        backend.sample_gpus(Tier.FAST)


# -- telemetry values ------------------------------------------------------------------------


def test_fast_tier_values():
    m = rich_machine()
    t = Telemetry(m)
    s = t[1]
    s.gpu_util, s.mem_util, s.memory_used = 87.0, 41.0, 10 * GIB
    s.temperature_c, s.power_w, s.power_limit_w = 71.0, 312.5, 350.0
    s.sm_clock_mhz, s.mem_clock_mhz, s.fan_pct = 1800, 9501, 65.0
    s.throttle_reasons = ["sw_power_cap", "hw_thermal_slowdown"]
    fake = FakeNvml(m, t)
    got = backend_for(fake).sample_gpus(Tier.FAST)[1]
    assert (got.gpu_util, got.mem_util, got.memory_used, got.memory_total) == (87.0, 41.0, 10 * GIB, 24 * GIB)
    assert (got.temperature_c, got.power_w, got.power_limit_w) == (71.0, 312.5, 350.0)
    assert (got.sm_clock_mhz, got.mem_clock_mhz, got.fan_pct) == (1800, 9501, 65.0)
    assert got.throttle_reasons == ["sw_power_cap", "hw_thermal_slowdown"]
    assert got.unavailable == {"nvlink_rx_bps": WARMING_UP, "nvlink_tx_bps": WARMING_UP}
    for name in SLOW_FIELDS:  # the fast tier leaves the slow fields alone
        assert getattr(got, name) is None and name not in got.unavailable
    for fn in ("nvmlDeviceGetPcieThroughput", "nvmlDeviceGetTotalEccErrors", "nvmlEventSetWait"):
        assert fake.calls[fn] == 0, fn


def test_slow_tier_values():
    m = rich_machine()
    t = Telemetry(m)
    s = t[0]
    s.pcie_rx_bps, s.pcie_tx_bps = 3 * GIB, 512 * MIB
    s.ecc_corrected, s.ecc_uncorrected = 12, 1
    got = backend_for(FakeNvml(m, t)).sample_gpus(Tier.SLOW)[0]
    assert (got.pcie_rx_bps, got.pcie_tx_bps) == (3 * GIB, 512 * MIB)
    assert (got.ecc_corrected, got.ecc_uncorrected) == (12, 1)
    assert got.health == "ok" and got.xid is None and "xid" not in got.unavailable
    assert got.processes == []
    sample = TelemetrySample(time=0.0, gpus=[got])
    assert TelemetrySample.from_dict(json.loads(json.dumps(sample.to_dict()))) == sample


def test_ecc_disabled_is_not_asked():
    fake, backend = replay("4x-rtx4090")
    s = backend.sample_gpus(Tier.SLOW)[0]
    assert s.ecc_corrected is None and s.unavailable["ecc_corrected"] == ECC_DISABLED
    assert fake.calls["nvmlDeviceGetTotalEccErrors"] == 0


def test_replay_of_a_loaded_simulation():
    clock = Clock()
    m = load_profile("8x-h100-sxm")
    sim = SimulatedBackend(m, seed=1, clock=clock)
    for i in range(8):
        sim.set_load(i, "job", Load(utilization=95, memory_bytes=60 * GIB, comm_fraction=0.5))
    fake = FakeNvml(m, sim, clock=clock)
    backend = backend_for(fake)
    backend.sample_gpus(Tier.FAST)
    for _ in range(5):
        # The counters grow at the rate the simulation had during the interval, i.e. its previous one.
        nvlink_before = [fake.current(i).nvlink_rx_bps for i in range(8)]
        clock.advance(1.0)
        samples = backend.sample_gpus(Tier.SLOW)
    for got in samples:
        want = fake.current(got.index)
        assert got.gpu_util == round(want.gpu_util)
        assert got.memory_used == want.memory_used
        assert got.temperature_c == round(want.temperature_c)
        assert got.power_w == pytest.approx(want.power_w, abs=0.001)
        assert got.sm_clock_mhz == want.sm_clock_mhz
        assert got.throttle_reasons == want.throttle_reasons
        assert got.fan_pct is None and got.unavailable["fan_pct"] == NOT_SUPPORTED  # SXM boards have no fans
        assert got.pcie_rx_bps == pytest.approx(want.pcie_rx_bps, abs=1024)
        assert got.nvlink_rx_bps == pytest.approx(nvlink_before[got.index], rel=1e-6)
        assert got.nvlink_rx_bps > 100e9  # a busy NVSwitch fabric, not one link's worth
    assert not is_throttled(samples[0].throttle_reasons) or "sw_power_cap" in samples[0].throttle_reasons


# -- NVLink throughput -----------------------------------------------------------------------


def nvlink_replay(rate: float, **fake_kw):
    clock = Clock()
    m = load_profile("8x-h100-sxm")
    t = Telemetry(m)
    for s in t.samples:
        s.nvlink_rx_bps, s.nvlink_tx_bps = rate, rate / 2
    fake = FakeNvml(m, t, clock=clock, **fake_kw)
    return clock, t, fake, backend_for(fake)


RATE = 18 * 1024 * 5_000_000.0  # ~92 GB/s, a whole number of KiB on each of 18 links


def test_nvlink_throughput_from_counter_deltas():
    clock, t, fake, backend = nvlink_replay(RATE)
    first = backend.sample_gpus(Tier.FAST)[0]
    assert first.nvlink_rx_bps is None and first.unavailable["nvlink_rx_bps"] == WARMING_UP
    clock.advance(1.0)
    s = backend.sample_gpus(Tier.FAST)[0]
    # All 18 links summed: a bare field id would have read link 0 alone (1/18 of this).
    assert (s.nvlink_rx_bps, s.nvlink_tx_bps) == (RATE, RATE / 2)
    clock.advance(2.0)
    assert backend.sample_gpus(Tier.FAST)[0].nvlink_rx_bps == RATE
    for sample in t.samples:
        sample.nvlink_rx_bps = 0.0
    fake.refresh()
    clock.advance(0.5)
    assert backend.sample_gpus(Tier.FAST)[3].nvlink_rx_bps == 0.0


def test_nvlink_throughput_summed_per_link_when_the_driver_wants_it():
    clock, _, fake, backend = nvlink_replay(RATE, nvlink_aggregate_scope=False)
    backend.sample_gpus(Tier.FAST)
    clock.advance(1.0)
    assert backend.sample_gpus(Tier.FAST)[0].nvlink_rx_bps == RATE
    before = fake.calls["nvmlDeviceGetFieldValues"]
    backend.sample_gpus(Tier.FAST)
    assert fake.calls["nvmlDeviceGetFieldValues"] - before == 8  # settled on one call per GPU


def test_nvlink_throughput_not_supported_by_the_driver(monkeypatch):
    clock, _, fake, backend = nvlink_replay(RATE)
    monkeypatch.setattr(fake, "_field", lambda *a: (pynvml.NVML_ERROR_NOT_SUPPORTED, 0))
    backend.machine()
    fake.calls.clear()
    for _ in range(3):
        s = backend.sample_gpus(Tier.FAST)[0]
        clock.advance(1.0)
        assert s.nvlink_rx_bps is None and s.unavailable["nvlink_rx_bps"] == NOT_SUPPORTED
    # The all-links scope and the per-link fallback each tried once, then only the former.
    assert fake.calls["nvmlDeviceGetFieldValues"] == 8 * 4


def test_nvlink_counter_reset_starts_over():
    clock, _, fake, backend = nvlink_replay(RATE)
    backend.sample_gpus(Tier.FAST)
    clock.advance(3.0)
    assert backend.sample_gpus(Tier.FAST)[0].nvlink_rx_bps == RATE
    fake.reset_nvlink_counters()  # counters now below the last reading
    clock.advance(1.0)
    assert backend.sample_gpus(Tier.FAST)[0].unavailable["nvlink_rx_bps"] == WARMING_UP
    clock.advance(1.0)
    assert backend.sample_gpus(Tier.FAST)[0].nvlink_rx_bps == RATE


def test_nvlink_throughput_without_nvlink():
    fake, backend = replay("4x-rtx4090")
    s = backend.sample_gpus(Tier.FAST)[0]
    assert s.unavailable["nvlink_rx_bps"] == s.unavailable["nvlink_tx_bps"] == NO_NVLINK
    assert fake.calls["nvmlDeviceGetFieldValues"] == 0


# -- throttle reasons ----------------------------------------------------------------------


def test_clock_event_reasons_decode():
    assert decode_clock_event_reasons(0) == []
    assert decode_clock_event_reasons(0x1) == ["idle"]
    assert decode_clock_event_reasons(0x45) == ["idle", "sw_power_cap", "hw_thermal_slowdown"]
    assert decode_clock_event_reasons(0x88 | 1 << 20) == ["hw_slowdown", "hw_power_brake_slowdown", "unknown_0x100000"]
    for mask in (0, 0x1, 0x7FF, 0x45 | 1 << 40):
        assert encode_clock_event_reasons(decode_clock_event_reasons(mask)) == mask
    with pytest.raises(ValueError):
        encode_clock_event_reasons(["too_hot"])


def test_idle_is_a_reason_but_not_throttling():
    assert not is_throttled(["idle"])
    assert not is_throttled([]) and not is_throttled(None)
    assert is_throttled(["idle", "sw_power_cap"])


def test_clock_event_bits_are_nvmls():
    constants = {
        "idle": pynvml.nvmlClocksEventReasonGpuIdle,
        "applications_clocks": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
        "sw_power_cap": pynvml.nvmlClocksEventReasonSwPowerCap,
        "hw_slowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
        "sync_boost": pynvml.nvmlClocksEventReasonSyncBoost,
        "sw_thermal_slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
        "hw_thermal_slowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
        "hw_power_brake_slowdown": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
        "display_clock": pynvml.nvmlClocksEventReasonDisplayClockSetting,
        "board_limit": pynvml.nvmlClocksThrottleReasonBoardLimit,
        "reliability": pynvml.nvmlClocksThrottleReasonReliability,
    }
    assert {name: bit for bit, name in CLOCK_EVENT_REASONS} == constants


def test_throttle_reasons_from_the_older_function():
    m = rich_machine()
    t = Telemetry(m)
    t[0].throttle_reasons = ["hw_slowdown"]
    fake = FakeNvml(m, t)
    fake.inject("nvmlDeviceGetCurrentClocksEventReasons", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    assert backend_for(fake).sample_gpus(Tier.FAST)[0].throttle_reasons == ["hw_slowdown"]
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 2


# -- processes -------------------------------------------------------------------------------


def test_processes_with_a_vanished_pid():
    me = psutil.Process()
    m = rich_machine()
    t = Telemetry(m)
    t[0].processes = [
        GpuProcess(pid=os.getpid(), used_memory=GIB),
        GpuProcess(pid=VANISHED_PID, used_memory=2 * GIB),
        GpuProcess(pid=os.getpid(), used_memory=GIB, kind="graphics"),  # the same process, both engines
        GpuProcess(pid=1, used_memory=None, kind="graphics"),  # memory unknown (as under WDDM)
    ]
    got = backend_for(FakeNvml(m, t)).sample_gpus(Tier.SLOW)[0]
    procs = {p.pid: p for p in got.processes}
    assert list(procs) == [os.getpid(), VANISHED_PID, 1]
    mine = procs[os.getpid()]
    assert (mine.used_memory, mine.kind, mine.user) == (GIB, "compute", me.username())
    assert mine.command == " ".join(me.cmdline())
    gone = procs[VANISHED_PID]
    assert (gone.used_memory, gone.user, gone.command) == (2 * GIB, None, None)
    assert procs[1].kind == "graphics" and procs[1].used_memory is None


class DeniedProcess:
    """Another user's process under hidepid: only its name can be read."""

    def __init__(self, pid):
        self.pid = pid

    def username(self):
        raise psutil.AccessDenied(self.pid)

    def cmdline(self):
        raise psutil.AccessDenied(self.pid)

    def name(self):
        return "secret-trainer"


class ExitingProcess(DeniedProcess):
    """A process that exits between being found and being described."""

    def username(self):
        return "alice"

    def cmdline(self):
        raise psutil.NoSuchProcess(self.pid)


@pytest.mark.parametrize(
    ("process", "user", "command"), [(DeniedProcess, None, "secret-trainer"), (ExitingProcess, "alice", None)]
)
def test_processes_that_cannot_be_fully_described(monkeypatch, process, user, command):
    monkeypatch.setattr(nvml_backend.psutil, "Process", process)
    m = rich_machine()
    t = Telemetry(m)
    t[1].processes = [GpuProcess(pid=4242, used_memory=MIB)]
    p = backend_for(FakeNvml(m, t)).sample_gpus(Tier.SLOW)[1].processes[0]
    assert (p.pid, p.used_memory, p.user, p.command) == (4242, MIB, user, command)


def test_process_lookups_are_remembered_while_the_pid_lives(monkeypatch):
    looked_up = []
    monkeypatch.setattr(nvml_backend, "_describe_pid", lambda pid: looked_up.append(pid) or ("u", "c"))
    m = rich_machine()
    t = Telemetry(m)
    fake = FakeNvml(m, t)
    backend = backend_for(fake)
    t[0].processes = [GpuProcess(pid=10), GpuProcess(pid=11)]
    backend.sample_gpus(Tier.SLOW)
    backend.sample_gpus(Tier.SLOW)
    assert looked_up == [10, 11]
    t[0].processes = [GpuProcess(pid=11)]
    fake.refresh()
    backend.sample_gpus(Tier.SLOW)
    t[0].processes = [GpuProcess(pid=10), GpuProcess(pid=11)]
    fake.refresh()
    backend.sample_gpus(Tier.SLOW)
    assert looked_up == [10, 11, 10]  # 10 went away in between, so it may be another process now


def test_processes_from_one_list_when_the_other_is_unsupported():
    m = rich_machine()
    t = Telemetry(m)
    t[0].processes = [GpuProcess(pid=VANISHED_PID, used_memory=MIB)]
    fake = FakeNvml(m, t)
    for fn in api_functions():
        if "GraphicsRunningProcesses" in fn:
            fake.inject(fn, pynvml.NVML_ERROR_NOT_SUPPORTED)
    s = backend_for(fake).sample_gpus(Tier.SLOW)[0]
    assert [p.pid for p in s.processes] == [VANISHED_PID] and "processes" not in s.unavailable


# -- XID events -----------------------------------------------------------------------------------


def test_xid_events_are_polled_without_blocking():
    fake, backend = replay(rich_machine())
    backend.sample_gpus(Tier.SLOW)
    fake.emit_xid(1, 79)
    assert fake.calls["nvmlEventSetWait"] == 1
    backend.sample_gpus(Tier.FAST)
    assert fake.calls["nvmlEventSetWait"] == 1  # the fast tier does not poll
    first = backend.sample_gpus(Tier.SLOW)
    assert (first[1].xid, first[1].health) == (79, "xid 79")
    assert (first[0].xid, first[0].health) == (None, "ok")
    later = backend.sample_gpus(Tier.SLOW)
    assert (later[1].xid, later[1].health) == (79, "ok")  # remembered, no longer news
    assert fake.max_wait_timeout_ms == 0


def test_xid_poll_failure_is_reported_for_that_sample():
    fake, backend = replay(rich_machine())
    fake.inject("nvmlEventSetWait", pynvml.NVML_ERROR_UNKNOWN, times=1)
    s = backend.sample_gpus(Tier.SLOW)[0]
    assert s.xid is None and s.unavailable["xid"] == "NVML error: Unknown Error"
    assert "xid" not in backend.sample_gpus(Tier.SLOW)[0].unavailable


def test_an_xid_storm_does_not_stall_a_sample():
    fake, backend = replay(rich_machine())
    for n in range(1000):
        fake.emit_xid(0, n)
    backend.sample_gpus(Tier.SLOW)
    assert fake.calls["nvmlEventSetWait"] == 256


# -- the replay itself ----------------------------------------------------------------------


def test_fake_speaks_pynvml():
    fake = FakeNvml(rich_machine())
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    assert fake.NVML_ERROR_NOT_SUPPORTED == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert fake.NVMLError is pynvml.NVMLError
    fake.inject("nvmlDeviceGetFanSpeed", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=1)
    h0, h1 = fake.nvmlDeviceGetHandleByIndex(0), fake.nvmlDeviceGetHandleByIndex(1)
    assert fake.nvmlDeviceGetFanSpeed(h0) == 30
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetFanSpeed(h1)
    assert fake.calls["nvmlDeviceGetFanSpeed"] == 2
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        fake.nvmlDeviceGetBAR1MemoryInfo(h0)  # not part of the replay: as on an old driver
    with pytest.raises(ValueError, match="does not implement"):
        fake.inject("nvmlDeviceGetFanSpeeed", pynvml.NVML_ERROR_UNKNOWN)
    fake.lose_gpu(0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetName(h0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetP2PStatus(h1, h0, 0)


def test_fake_models_nvlink_slots_like_a_driver():
    fake = FakeNvml(load_profile("2x-rtx3090-nvlink"))
    fake.nvmlInit()
    h0 = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetNvLinkState(h0, 3) == pynvml.NVML_FEATURE_ENABLED
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetNvLinkState(h0, 4)  # beyond the GPU's links
    assert fake.nvmlDeviceGetNvLinkRemotePciInfo(h0, 0).busId == "00000000:4A:00.0"  # pynvml decodes it
    assert fake.nvmlDeviceGetNvLinkVersion(h0, 0) == pynvml.NVML_NVLINK_VERSION_3_0
    fake = FakeNvml(load_profile("4x-rtx4090"))
    fake.nvmlInit()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetNvLinkState(fake.nvmlDeviceGetHandleByIndex(0), 0)


def test_install_serves_code_that_imports_pynvml():
    original = pynvml.nvmlInit
    fake = FakeNvml(load_profile("8x-a100-pcie"))
    with install(fake):
        import pynvml as module

        assert module.nvmlInit == fake.nvmlInit
        backend = NvmlBackend(host_reader=lambda: copy.deepcopy(fake.machine.host))
        m = backend.machine()
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):  # nothing reaches the C library
            pynvml.nvmlDeviceGetBAR1MemoryInfo(fake.nvmlDeviceGetHandleByIndex(0))
        backend.close()
    assert [pair_facts(p) for p in m.pairs] == [pair_facts(p) for p in load_profile("8x-a100-pcie").pairs]
    assert pynvml.nvmlInit is original
    assert not hasattr(pynvml, "nvmlDeviceGetNvLinkRemotePciInfo_v2")  # added for the block only
    assert fake.calls["nvmlInit"] == 1


# -- cost ------------------------------------------------------------------------------------------


def per_sample_us(backend: NvmlBackend, tier: Tier, n: int) -> float:
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            backend.sample_gpus(tier)
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return min(runs)


def test_sampling_cost_of_eight_gpus(capsys):
    _, backend = replay("8x-h100-sxm")
    backend.sample_gpus(Tier.SLOW)
    fast = per_sample_us(backend, Tier.FAST, 100)
    slow = per_sample_us(backend, Tier.SLOW, 30)
    with capsys.disabled():
        print(f"\n8-GPU replay: fast {fast:.0f} µs/sample, slow {slow:.0f} µs/sample (backend + FakeNvml)")
    assert fast / 8 < 1000, "the fast tier should cost well under 1 ms per GPU"
    assert statistics.fmean([fast, slow]) < 20_000
