import json

import pytest

from rigpilot.engine.hardware.machine import (
    P2P,
    Gpu,
    GpuPair,
    Host,
    Machine,
    PciePath,
    Source,
    format_cpu_list,
    parse_cpu_list,
    short_gpu_name,
)
from rigpilot.engine.hardware.simulated import list_profiles, load_profile


@pytest.mark.parametrize("profile", [p["id"] for p in list_profiles()])
def test_every_profile_round_trips_through_json(profile):
    m = load_profile(profile)
    text = json.dumps(m.to_dict())
    back = Machine.from_dict(json.loads(text))
    assert back == m
    assert json.loads(text)["label"].startswith("simulated: ")


def test_cpu_lists_parse_and_format_like_the_kernel():
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert format_cpu_list([]) == "N/A"
    with pytest.raises(ValueError):
        parse_cpu_list("5-2")
    with pytest.raises(ValueError):
        parse_cpu_list("zero")


def test_names_and_labels():
    assert short_gpu_name("NVIDIA GeForce RTX 4090") == "RTX 4090"
    assert short_gpu_name("Tesla V100S-PCIE-32GB") == "V100S-PCIE-32GB"
    m = Machine(source=Source.IMPORTED, host=Host(), gpus=[Gpu(0, "NVIDIA RTX A6000"), Gpu(1, "NVIDIA GeForce RTX 3090")],
                origin="box.txt")
    assert m.label == "imported: 1×RTX A6000 + 1×RTX 3090 (box.txt)"
    with pytest.raises(KeyError, match="no GPU 5"):
        m.gpu(5)


def test_pair_code_prefers_nvlink_and_pair_lookup_is_symmetric():
    m = Machine(
        source=Source.SIMULATED, host=Host(), gpus=[Gpu(0, "a"), Gpu(1, "b")],
        pairs=[GpuPair(0, 1, pcie=PciePath.PHB, nvlink_count=4, p2p_read=P2P.OK, p2p_write=P2P.OK)],
    )
    assert m.pair(1, 0).topo_code == "NV4"
    assert m.pair(0, 0) is None
    assert GpuPair(0, 1, pcie=PciePath.SYS).topo_code == "SYS"
    assert PciePath.SYS.rank > PciePath.PIX.rank


def test_unavailable_fields_are_none_with_a_reason():
    g = Gpu(0, "x", power_limit_w=300.0)
    g.na("power_limit_w", "no permission")
    assert g.power_limit_w is None and g.unavailable == {"power_limit_w": "no permission"}
    back = Machine.from_dict(Machine(source=Source.NVML, host=Host(), gpus=[g]).to_dict())
    assert back.gpus[0].unavailable == {"power_limit_w": "no permission"}
