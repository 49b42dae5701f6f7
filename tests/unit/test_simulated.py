import pytest

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.machine import P2P, PciePath
from rigpilot.engine.hardware.simulated import GIB, Load, SimulatedBackend, list_profiles, load_profile
from rigpilot.engine.hardware.telemetry import Tier
from rigpilot.engine.hardware.topology import summarize

REQUIRED = {"8x-h100-sxm", "8x-a100-pcie", "4x-rtx4090", "2x-rtx3090-nvlink", "4x-rtxa6000-bridged", "mixed-4090-3090",
            "1x-rtx4090"}


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_the_required_profiles_exist_and_say_they_are_simulated():
    ids = {p["id"] for p in list_profiles()}
    assert REQUIRED <= ids
    for p in list_profiles():
        assert p["label"].startswith("simulated: ")


def test_unknown_profile_is_a_user_error_listing_the_known_ones():
    with pytest.raises(UserError, match=r"unknown simulated profile 'nope'.*4x-rtx4090"):
        load_profile("nope")


def test_8x_a100_pcie_has_four_nvlink_pairs_and_crosses_sockets():
    m = load_profile("8x-a100-pcie")
    nv = [p.key for p in m.pairs if p.nvlink_count]
    assert nv == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert all(m.pair(a, b).nvlink_count == 12 for a, b in nv)
    s = summarize(m)
    assert len(s.cross_socket_pairs) == 16  # every pair between the 4 GPUs of socket 0 and the 4 of socket 1
    assert all(m.gpu(a).numa_node != m.gpu(b).numa_node for a, b in s.cross_socket_pairs)
    assert s.nvlink_islands == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.pair(0, 4).p2p_read is P2P.UNSUPPORTED and m.pair(0, 2).p2p_read is P2P.OK


def test_8x_h100_is_an_nvswitch_fabric_at_nv18():
    m = load_profile("8x-h100-sxm")
    assert len(m.pairs) == 28
    assert {p.topo_code for p in m.pairs} == {"NV18"}
    assert all(p.nvswitch for p in m.pairs)
    assert summarize(m).nvlink_islands == [list(range(8))]


def test_4x_rtx4090_has_no_p2p_and_two_numa_nodes():
    m = load_profile("4x-rtx4090")
    assert all(p.nvlink_count == 0 for p in m.pairs)
    assert all(p.p2p_read is P2P.UNSUPPORTED for p in m.pairs)
    assert summarize(m).numa_groups == {0: [0, 1], 1: [2, 3]}
    assert m.pair(0, 2).pcie is PciePath.SYS


def test_bridged_and_mixed_profiles():
    a6000 = load_profile("4x-rtxa6000-bridged")
    assert [p.key for p in a6000.pairs if p.nvlink_count == 4] == [(0, 1), (2, 3)]
    r3090 = load_profile("2x-rtx3090-nvlink")
    assert r3090.pair(0, 1).topo_code == "NV4"
    mixed = load_profile("mixed-4090-3090")
    assert mixed.summary_name == "1×RTX 4090 + 1×RTX 3090"
    assert mixed.gpus[1].pcie_width_current == 4  # the second slot of a desktop board runs at x4


def test_telemetry_reacts_to_load_and_settles_back():
    clock = Clock()
    b = SimulatedBackend(load_profile("4x-rtx4090"), seed=1, clock=clock)
    idle = b.sample_gpus(Tier.FAST)[0]
    assert idle.gpu_util < 2 and "idle" in idle.throttle_reasons
    b.set_load(0, "job-1", Load(utilization=97, memory_bytes=18 * GIB, pid=4242, command="torchrun train.py"))
    for _ in range(60):
        clock.t += 1.0
        busy = b.sample_gpus(Tier.SLOW)
    g0, g1 = busy[0], busy[1]
    assert g0.gpu_util > 90 and g1.gpu_util < 2
    assert g0.memory_used > 18 * GIB
    assert g0.power_w > 300 and g0.temperature_c > idle.temperature_c + 20
    assert [p.pid for p in g0.processes] == [4242]
    b.set_load(0, "job-1", None)
    for _ in range(300):
        clock.t += 1.0
        after = b.sample_gpus(Tier.FAST)[0]
    assert after.gpu_util < 2 and after.memory_used < 1 * GIB
    assert after.temperature_c < g0.temperature_c - 20


def test_fields_a_gpu_lacks_are_not_available_not_zero():
    b = SimulatedBackend(load_profile("8x-h100-sxm"), seed=1)
    s = b.sample_gpus(Tier.SLOW)[0]
    assert s.fan_pct is None and "passively cooled" in s.unavailable["fan_pct"]
    s4090 = SimulatedBackend(load_profile("4x-rtx4090"), seed=1).sample_gpus(Tier.SLOW)[0]
    assert s4090.nvlink_rx_bps is None and s4090.unavailable["nvlink_rx_bps"] == "no NVLink"
    assert s4090.ecc_corrected is None and s4090.unavailable["ecc_corrected"] == "ECC disabled"


def test_fast_tier_leaves_slow_fields_unread():
    s = SimulatedBackend(load_profile("2x-rtx3090-nvlink"), seed=1).sample_gpus(Tier.FAST)[0]
    assert s.processes is None and s.pcie_rx_bps is None and s.gpu_util is not None


def test_load_on_a_missing_gpu_is_refused():
    b = SimulatedBackend(load_profile("1x-rtx4090"))
    with pytest.raises(KeyError):
        b.set_load(3, "j", Load(utilization=50))


# Published boost clocks (MHz): what a loaded card runs near, below the ceiling NVML reports as its maximum.
BOOST = {"RTX 4090": 2520, "RTX 3090": 1695, "RTX A6000": 1800, "A100 80GB PCIe": 1410, "H100 80GB HBM3": 1980}


@pytest.mark.parametrize("profile", sorted(REQUIRED))
def test_a_loaded_gpu_runs_near_its_published_boost_clock_not_its_maximum(profile):
    clock = Clock()
    machine = load_profile(profile)
    b = SimulatedBackend(machine, seed=1, clock=clock)
    for g in machine.gpus:
        b.set_load(g.index, "job", Load(utilization=97))
    for _ in range(60):
        clock.t += 1.0
        busy = b.sample_gpus(Tier.FAST)
    for g, s in zip(machine.gpus, busy, strict=True):
        boost = next(v for name, v in BOOST.items() if g.name.endswith(name))
        assert 0.85 * boost <= s.sm_clock_mhz <= boost <= g.max_sm_clock_mhz, (g.name, s.sm_clock_mhz)


def test_the_served_machine_names_both_host_rams():
    from rigpilot.engine.hardware.simulated import host_ram_note, served_machine

    m = served_machine("4x-rtx4090")
    assert m.host.memory_total == 256 * GIB  # plans are for the simulated workstation, its RAM included
    note = host_ram_note(m, this_computer=int(23.5 * GIB))
    assert note == (
        "Host RAM: the simulated machine has 256 GiB and plans count that; this computer has 23.5 GiB, "
        "where its jobs run as CPU processes."
    )
    assert host_ram_note(m, this_computer=256 * GIB) is None
    assert any(n.startswith("Host RAM: the simulated machine has 256 GiB") for n in m.notes)
    assert load_profile("4x-rtx4090").notes == []  # a profile as such (plan for any machine) carries no note
