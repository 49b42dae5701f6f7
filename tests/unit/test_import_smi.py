"""`nvidia-smi -q`, `-q -x` and `nvlink --status` import, and merging several files about one machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from rigpilot.engine.hardware.importers import FileKind, MachineImportError, import_machine, import_text, sniff
from rigpilot.engine.hardware.importers.smi_query import NOTE_NO_TOPOLOGY
from rigpilot.engine.hardware.importers.topo_text import NOTE_NO_GPU_NAMES
from rigpilot.engine.hardware.machine import PciePath

MiB = 1024 * 1024


def _case(smi_data: Path, prefix: str) -> Path:
    (path,) = smi_data.glob(f"{prefix}_*")
    return path


# GPUs, name, memory (MiB), driver, CUDA, power limit (W), max SM / memory clock (MHz), PCIe gen max.
QUERY_CASES = {
    "case21": (4, "NVIDIA A100-SXM4-80GB", 81920, "555.42.02", "12.5", 500.0, 1410, 1593, 4),
    "case22": (8, "NVIDIA H100 80GB HBM3", 81559, "565.57.01", "12.7", 700.0, 1980, 2619, 5),
    "case23": (2, "NVIDIA GeForce RTX 3090", 24576, "560.35.03", "12.6", 350.0, 2100, 9751, 4),
    "case24": (2, "NVIDIA H100 NVL", 95830, "550.54.14", "12.4", 310.0, 1785, 2619, 5),
    "case25": (8, "Tesla V100S-PCIE-32GB", 32510, "460.73.01", "11.2", 250.0, 1597, 1107, 3),
}


@pytest.mark.parametrize("case", sorted(QUERY_CASES))
def test_real_query_files(smi_data: Path, case: str) -> None:
    n, name, mib, driver, cuda, watts, sm, mem, gen = QUERY_CASES[case]
    path = _case(smi_data, case)
    machine = import_machine(path)

    assert [g.index for g in machine.gpus] == list(range(n))
    assert {g.name for g in machine.gpus} == {name}
    assert {g.memory_total for g in machine.gpus} == {mib * MiB}
    assert machine.host.driver_version == driver
    assert machine.host.cuda_driver_version == cuda
    assert {g.power_limit_w for g in machine.gpus} == {watts}
    assert {g.max_sm_clock_mhz for g in machine.gpus} == {sm}
    assert {g.max_mem_clock_mhz for g in machine.gpus} == {mem}
    assert {g.pcie_gen_max for g in machine.gpus} == {gen}
    assert {g.pcie_width_max for g in machine.gpus} == {16}
    assert len({g.uuid for g in machine.gpus}) == n and all(g.uuid.startswith("GPU-") for g in machine.gpus)
    assert machine.pairs == []
    assert NOTE_NO_TOPOLOGY in machine.notes
    assert machine.gpus[0].unavailable["numa_node"].startswith("not in nvidia-smi -q")
    assert machine.host.unavailable["hostname"].startswith("not in nvidia-smi -q")


def test_case21_index_is_order_not_minor_number(smi_data: Path) -> None:
    machine = import_machine(_case(smi_data, "case21"))
    assert [g.pci_bus_id for g in machine.gpus] == [
        "00000000:68:00.0",
        "00000000:9E:00.0",
        "00000000:C2:00.0",
        "00000000:D4:00.0",
    ]
    assert machine.gpus[0].uuid == "GPU-31515c3d-1414-7c2c-004a-f86a898946ac"
    gpu = machine.gpus[0]
    assert (gpu.persistence_mode, gpu.mig_enabled, gpu.ecc_enabled) == (True, False, True)
    assert (gpu.pcie_gen_current, gpu.pcie_width_current) == (4, 16)


def test_case23_consumer_gpus_have_no_mig_or_ecc(smi_data: Path) -> None:
    machine = import_machine(_case(smi_data, "case23"))
    assert [g.pci_bus_id for g in machine.gpus] == ["00000000:41:00.0", "00000000:81:00.0"]
    for gpu in machine.gpus:
        assert gpu.mig_enabled is None and gpu.unavailable["mig_enabled"] == "N/A in nvidia-smi -q"
        assert gpu.ecc_enabled is None and gpu.unavailable["ecc_enabled"] == "N/A in nvidia-smi -q"
    # Idle consumer cards drop to PCIe gen 1; the maximum stays 4.
    assert (machine.gpus[0].pcie_gen_current, machine.gpus[0].pcie_gen_max) == (1, 4)


def test_case24_power_limit_is_the_enforced_one_not_the_max(smi_data: Path) -> None:
    machine = import_machine(_case(smi_data, "case24"))
    assert [g.power_limit_w for g in machine.gpus] == [310.0, 310.0]
    assert [g.pci_bus_id for g in machine.gpus] == ["00000000:AD:00.0", "00000000:AE:00.0"]


def test_case25_xml(smi_data: Path) -> None:
    path = _case(smi_data, "case25")
    assert sniff(path.read_text()) is FileKind.SMI_XML
    machine = import_machine(path)
    assert [g.pci_bus_id for g in machine.gpus] == [f"00000000:00:{n:02X}.0" for n in range(0x0D, 0x15)]
    assert machine.gpus[7].uuid == "GPU-1d955959-c95b-4f40-2cac-100d3006ffe2"
    gpu = machine.gpus[0]
    assert (gpu.persistence_mode, gpu.ecc_enabled, gpu.pcie_gen_current) == (False, True, 3)
    assert gpu.mig_enabled is None and gpu.unavailable["mig_enabled"] == "N/A in nvidia-smi -q -x"


OLD_QUERY = """\
==============NVSMI LOG==============

Timestamp                           : Mon Jan  4 10:00:00 2021
Driver Version                      : 450.80.02

Attached GPUs                       : 2
GPU 00000000:3B:00.0
    Product Name                    : Tesla T4
    Persistence Mode                : Disabled
    GPU UUID                        : GPU-aaaaaaaa-0000-0000-0000-000000000001
    PCI
        Bus Id                      : 00000000:3B:00.0
        GPU Link Info
            PCIe Generation
                Max                 : 3
                Current             : 1
            Link Width
                Max                 : 16x
                Current             : 8x
    FB Memory Usage
        Total                       : 15109 MiB
    Ecc Mode
        Current                     : Enabled
    Power Readings
        Power Limit                 : 70.00 W
        Enforced Power Limit        : 65.00 W
    Max Clocks
        SM                          : [Not Supported]
        Memory                      : fast MHz
"""


def test_older_query_layout_and_odd_values() -> None:
    machine = import_text(OLD_QUERY, "t4.txt")
    assert len(machine.gpus) == 1
    gpu = machine.gpus[0]
    assert gpu.name == "Tesla T4" and gpu.memory_total == 15109 * MiB
    assert gpu.power_limit_w == 65.0  # the enforced limit, what the card actually runs at
    assert (gpu.pcie_gen_current, gpu.pcie_width_current, gpu.pcie_width_max) == (1, 8, 16)
    assert gpu.ecc_enabled is True and gpu.persistence_mode is False
    assert gpu.max_sm_clock_mhz is None and gpu.unavailable["max_sm_clock_mhz"] == "Not Supported in nvidia-smi -q"
    assert gpu.max_mem_clock_mhz is None and "unreadable value 'fast MHz'" in gpu.unavailable["max_mem_clock_mhz"]
    assert gpu.mig_enabled is None and gpu.unavailable["mig_enabled"] == "not in nvidia-smi -q"
    assert machine.host.cuda_driver_version is None
    assert machine.host.unavailable["cuda_driver_version"] == "not in nvidia-smi -q"
    assert any(note.startswith("line 29: could not read Max Clocks/Memory") for note in machine.notes)
    # -i 0 style output: the header counts every GPU, the file holds one.
    assert any("1 of the 2 attached GPUs" in note for note in machine.notes)


def test_query_errors() -> None:
    with pytest.raises(MachineImportError, match="found no GPUs on that machine"):
        import_text("==============NVSMI LOG==============\n\nNo devices were found\n", "none.txt")
    with pytest.raises(MachineImportError, match="no GPU sections"):
        import_text("==============NVSMI LOG==============\n\nDriver Version : 550.54.14\n", "short.txt")


BOMB = """<?xml version="1.0"?>
<!DOCTYPE nvidia_smi_log [
 <!ENTITY lol "lol">
 <!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
]>
<nvidia_smi_log><gpu id="0:1:0.0"><product_name>&lol2;</product_name></gpu></nvidia_smi_log>
"""


def test_xml_entities_are_refused() -> None:
    with pytest.raises(MachineImportError, match=r"bomb\.xml: line 3: refusing XML that declares entities"):
        import_text(BOMB, "bomb.xml")


def test_xml_errors() -> None:
    with pytest.raises(MachineImportError, match=r"x\.xml: line 3: not well-formed XML \(mismatched tag\)"):
        import_text('<?xml version="1.0"?>\n<nvidia_smi_log>\n<gpu><product_name>A</gpu>\n', "x.xml")
    with pytest.raises(MachineImportError, match="no <gpu> elements"):
        import_text("<nvidia_smi_log><driver_version>1</driver_version></nvidia_smi_log>", "x.xml")


def test_xml_without_values_falls_back_to_the_gpu_id() -> None:
    machine = import_text('<nvidia_smi_log><gpu id="00000000:01:00.0"></gpu></nvidia_smi_log>', "bare.xml")
    gpu = machine.gpus[0]
    assert gpu.pci_bus_id == "00000000:01:00.0"
    assert gpu.unavailable["name"] == "not in nvidia-smi -q -x"
    assert gpu.memory_total is None


def test_query_windows_powershell_utf16(smi_data: Path, tmp_path: Path) -> None:
    saved = tmp_path / "smi.txt"
    saved.write_bytes(_case(smi_data, "case23").read_text().encode("utf-16"))
    machine = import_machine(saved)
    assert [g.name for g in machine.gpus] == ["NVIDIA GeForce RTX 3090"] * 2


def test_non_utf8_text_is_refused(tmp_path: Path) -> None:
    latin = tmp_path / "latin.txt"
    latin.write_bytes("GPU0\tcaf\u00e9\n".encode("latin-1"))
    with pytest.raises(MachineImportError, match=r"latin\.txt: not a text file \(byte 0xe9 at offset 8 is not UTF-8\)"):
        import_machine(latin)


# -- nvlink --status ----------------------------------------------------------


def test_case26_nvlink_one_gpu_inactive(smi_data: Path) -> None:
    machine = import_machine(_case(smi_data, "case26"))
    assert [g.name for g in machine.gpus] == ["NVIDIA RTX A6000"] * 3
    assert [g.nvlink_links for g in machine.gpus] == [4, 4, 0]
    assert [g.nvlink_link_gbps for g in machine.gpus] == [14.062, 14.062, None]
    assert machine.gpus[2].unavailable["nvlink_link_gbps"] == "no active NVLink link"
    assert machine.gpus[1].uuid == "GPU-39fc2446-cb50-2067-2867-d95efd470a2c"


def test_case27_nvlink_twelve_links_two_space_indent(smi_data: Path) -> None:
    machine = import_machine(_case(smi_data, "case27"))
    (gpu,) = machine.gpus
    assert (gpu.index, gpu.name, gpu.nvlink_links, gpu.nvlink_link_gbps) == (0, "NVIDIA A100-SXM4-80GB", 12, 25.0)


def test_nvlink_inactive_links_and_mixed_speeds() -> None:
    text = (
        "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-1)\n"
        "\t Link 0: 25 GB/s\n\t Link 1: <inactive>\n\t Link 2: 20 GB/s\n"
        "GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-2)\n"
        "\t Link 0: <inactive>\n"
    )
    machine = import_text(text, "links.txt")
    assert [(g.nvlink_links, g.nvlink_link_gbps) for g in machine.gpus] == [(2, 20.0), (0, None)]
    assert any("different speeds (20, 25 GB/s)" in note for note in machine.notes)


def test_gpu_list_without_links_is_not_zero_links() -> None:
    text = "GPU 0: NVIDIA GeForce RTX 4090 (UUID: GPU-a)\nGPU 1: NVIDIA GeForce RTX 4090 (UUID: GPU-b)\n"
    machine = import_text(text, "list.txt")
    assert [g.name for g in machine.gpus] == ["NVIDIA GeForce RTX 4090"] * 2
    assert machine.gpus[0].nvlink_links is None
    assert "no NVLink links" in machine.gpus[0].unavailable["nvlink_links"]


def test_nvlink_errors() -> None:
    with pytest.raises(MachineImportError, match=r"line 2: cannot read the link speed 'fast'"):
        import_text("GPU 0: NVIDIA A100 (UUID: GPU-1)\n  Link 0: fast\n", "s.txt")
    with pytest.raises(MachineImportError, match=r"line 3: GPU 0 is listed twice"):
        import_text("GPU 0: NVIDIA A100 (UUID: GPU-1)\n  Link 0: 25 GB/s\nGPU 0: NVIDIA A100 (UUID: GPU-1)\n", "s.txt")
    with pytest.raises(MachineImportError, match=r"line 2: expected 'Link N: \.\.\.' or 'GPU N: \.\.\.'"):
        import_text("GPU 0: NVIDIA A100 (UUID: GPU-1)\nsomething else\n", "s.txt")


# -- merging ------------------------------------------------------------------

TOPO_4_A100 = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV12\tNV12\tNV12\t0-47\t0\t\tN/A
GPU1\tNV12\t X \tNV12\tNV12\t0-47\t0\t\tN/A
GPU2\tNV12\tNV12\t X \tNV12\t48-95\t1\t\tN/A
GPU3\tNV12\tNV12\tNV12\t X \t48-95\t1\t\tN/A
"""


def test_merge_topo_and_query(smi_data: Path, tmp_path: Path) -> None:
    topo = tmp_path / "topo.txt"
    topo.write_text(TOPO_4_A100)
    query = _case(smi_data, "case21")
    machine = import_machine([query, topo])  # order of the files does not matter

    assert [g.name for g in machine.gpus] == ["NVIDIA A100-SXM4-80GB"] * 4
    assert "name" not in machine.gpus[0].unavailable
    assert machine.gpus[3].pci_bus_id == "00000000:D4:00.0"
    assert machine.gpus[3].memory_total == 81920 * MiB
    assert [g.numa_node for g in machine.gpus] == [0, 0, 1, 1]
    assert {p.nvlink_count for p in machine.pairs} == {12} and len(machine.pairs) == 6
    assert machine.host.driver_version == "555.42.02"
    assert "driver_version" not in machine.host.unavailable
    assert [n.id for n in machine.host.numa_nodes] == [0, 1]
    assert NOTE_NO_TOPOLOGY not in machine.notes and NOTE_NO_GPU_NAMES not in machine.notes
    assert machine.origin == f"{query.name}, topo.txt"
    assert machine.label.startswith("imported: 4×A100-SXM4-80GB")


def test_merge_topo_and_nvlink_status(smi_data: Path) -> None:
    machine = import_machine([_case(smi_data, "case07"), _case(smi_data, "case26")])
    assert machine.pair(0, 1).nvlink_count == 4
    assert machine.pair(0, 2).pcie is PciePath.NODE
    assert [g.nvlink_links for g in machine.gpus] == [4, 4, 0]
    assert [g.name for g in machine.gpus] == ["NVIDIA RTX A6000"] * 3


def test_merge_query_text_and_xml_of_the_same_gpus(smi_data: Path, tmp_path: Path) -> None:
    xml = tmp_path / "q.xml"
    xml.write_text(
        "<nvidia_smi_log><cuda_version>12.5</cuda_version>"
        '<gpu id="00000000:68:00.0"><uuid>GPU-31515c3d-1414-7c2c-004a-f86a898946ac</uuid></gpu>'
        '<gpu id="00000000:9E:00.0"/><gpu id="00000000:C2:00.0"/><gpu id="00000000:D4:00.0"/></nvidia_smi_log>'
    )
    machine = import_machine([_case(smi_data, "case21"), xml])
    assert machine.gpus[0].name == "NVIDIA A100-SXM4-80GB"
    assert machine.host.cuda_driver_version == "12.5"


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (("case07", "case21"), "shows 4 GPUs but case07_"),
        (("case21", "case25"), "shows 8 GPUs but case21_"),
        (("case12", "case26"), "line 11: GPU 2 is not on the machine the other files describe (GPUs 0, 1)"),
        (("case21", "case27"), "GPU 0 has UUID GPU-370ec676-e407-3115-836a-8ebcb3c4f62a here but GPU-31515c3d"),
        (("case24", "case26"), "GPU 0 has UUID GPU-5baec991-de63-c196-1766-04c38407e133 here but GPU-806f8ea2"),
    ],
)
def test_files_that_disagree_are_refused(smi_data: Path, files: tuple[str, str], message: str) -> None:
    with pytest.raises(MachineImportError) as err:
        import_machine([_case(smi_data, name) for name in files])
    assert message in str(err.value)


def test_nvlink_status_naming_another_gpu_is_refused(smi_data: Path, tmp_path: Path) -> None:
    status = tmp_path / "status.txt"
    status.write_text("GPU 0: NVIDIA RTX A6000 (UUID: GPU-806f8ea2-6428-1096-a076-bb687fb45fb0)\n  Link 0: 14 GB/s\n")
    with pytest.raises(MachineImportError) as err:
        import_machine([_case(smi_data, "case24"), status])
    assert str(err.value) == (
        "status.txt: line 1: GPU 0 is a NVIDIA RTX A6000 here but a NVIDIA H100 NVL in another file; "
        "are they from the same machine?"
    )
