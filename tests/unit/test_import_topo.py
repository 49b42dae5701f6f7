"""`nvidia-smi topo -m` import: the real files in shared/testdata and synthetic variants of what drivers print."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from rigpilot.engine.hardware.importers import MachineImportError, import_machine, import_text, sniff
from rigpilot.engine.hardware.importers.topo_text import GPU_PLACEHOLDER_NAME, NOTE_NO_GPU_NAMES, parse_topo
from rigpilot.engine.hardware.machine import Machine, PciePath, Source, format_cpu_list


def _case(smi_data: Path, prefix: str) -> Path:
    (path,) = smi_data.glob(f"{prefix}_*")
    return path


def _codes(machine: Machine) -> dict[str, int]:
    return dict(Counter(p.topo_code for p in machine.pairs))


def _numa(machine: Machine) -> dict[int, str]:
    return {n.id: format_cpu_list(n.cpus) for n in machine.host.numa_nodes}


# What shared/testdata/nvidia-smi/README.md says each real file must yield:
# GPUs, pair counts by code, NIC labels -> devices, NUMA nodes -> CPUs, each GPU's (CPU affinity, NUMA node).
TOPO_CASES = {
    "case01": (2, {"PHB": 1}, {}, {}, ["0-11"] * 2, [None] * 2),
    "case02": (
        8,
        {"NV12": 28},
        {f"NIC{i}": f"mlx5_{i + 2}" for i in range(16)} | {"NIC16": "mlx5_bond_0"},
        {0: "0-103"},
        ["0-103"] * 8,
        [0] * 8,
    ),
    "case03": (4, {"SYS": 6}, {"NIC0": "mlx5_0", "NIC1": "mlx5_1"}, {0: "0-127"}, ["0-127"] * 4, [0] * 4),
    "case04": (
        8,
        {"NV1": 8, "NV2": 8, "SYS": 12},
        {"mlx5_0": "mlx5_0"},
        {},
        ["0-11,24-35"] * 4 + ["12-23,36-47"] * 4,
        [None] * 8,
    ),
    "case05": (
        8,
        {"NV1": 8, "NV2": 8, "SYS": 12},
        {"mlx5_0": "mlx5_0", "mlx5_1": "mlx5_1"},
        {0: "0-23,48-71", 1: "24-47,72-95"},
        ["0-23,48-71"] * 4 + ["24-47,72-95"] * 4,
        [0] * 4 + [1] * 4,
    ),
    "case06": (3, {"NODE": 2, "NV6": 1}, {}, {0: "0-63"}, ["0-63"] * 3, [0] * 3),
    "case07": (3, {"NV4": 1, "NODE": 2}, {}, {0: "0-31,64-95"}, ["0-31,64-95"] * 3, [0] * 3),
    "case08": (
        4,
        {"NODE": 2, "SYS": 4},
        {f"NIC{i}": f"mlx5_{i}" for i in range(4)},
        {0: "0-31", 1: "32-63"},
        ["0-31", "0-31", "32-63", "32-63"],
        [0, 0, 1, 1],
    ),
    "case09": (2, {"PHB": 1}, {"NIC0": "mlx5_0", "NIC1": "mlx5_1"}, {0: "0-23"}, ["0-23"] * 2, [0] * 2),
    "case10": (
        8,
        {"NV18": 28},
        {},
        {0: "0-51,104-155", 1: "52-103,156-207"},
        ["0-51,104-155"] * 4 + ["52-103,156-207"] * 4,
        [0] * 4 + [1] * 4,
    ),
    "case11": (8, {"NV12": 28}, {}, {0: "0-23", 1: "24-47"}, ["0-23"] * 4 + ["24-47"] * 4, [0] * 4 + [1] * 4),
    "case12": (2, {"NV2": 1}, {}, {}, ["0-23"] * 2, [None] * 2),
}


@pytest.mark.parametrize("case", sorted(TOPO_CASES))
def test_real_topo_files(smi_data: Path, case: str) -> None:
    n_gpus, codes, nics, numa, cpus, nodes = TOPO_CASES[case]
    path = _case(smi_data, case)
    machine = import_machine(path)

    assert machine.source is Source.IMPORTED
    assert machine.origin == path.name
    assert [g.index for g in machine.gpus] == list(range(n_gpus))
    assert len(machine.pairs) == n_gpus * (n_gpus - 1) // 2
    assert _codes(machine) == codes
    assert {n.label: n.device for n in machine.nics} == nics
    assert _numa(machine) == numa
    assert [format_cpu_list(g.cpu_affinity) for g in machine.gpus] == cpus
    assert [g.numa_node for g in machine.gpus] == nodes
    for gpu in machine.gpus:
        assert gpu.name == GPU_PLACEHOLDER_NAME
        assert "name" in gpu.unavailable
        assert gpu.memory_total is None and gpu.unavailable["memory_total"] == "not in topo -m"
        if gpu.numa_node is None:
            assert gpu.unavailable["numa_node"]
    for pair in machine.pairs:
        # An NVLink cell says nothing about the PCIe path under it.
        assert (pair.pcie is None) == (pair.nvlink_count > 0)
    assert NOTE_NO_GPU_NAMES in machine.notes


def test_case04_hybrid_cube_mesh_pairs_and_old_nic_column(smi_data: Path) -> None:
    machine = import_machine(_case(smi_data, "case04"))
    assert machine.pair(0, 1).nvlink_count == 1
    assert machine.pair(0, 3).nvlink_count == 2
    assert machine.pair(0, 4).nvlink_count == 2
    assert machine.pair(0, 5).pcie is PciePath.SYS
    assert machine.pair(3, 7).nvlink_count == 1
    (nic,) = machine.nics
    assert nic.gpu_paths == {0: "NODE", 1: "NODE", 2: "PIX", 3: "PIX", 4: "SYS", 5: "SYS", 6: "SYS", 7: "SYS"}
    assert "no NUMA Affinity column" in machine.gpus[0].unavailable["numa_node"]
    assert any("probably 2 NUMA nodes" in note for note in machine.notes)
    assert machine.host.sockets is None


def test_case02_nic_paths(smi_data: Path) -> None:
    machine = import_machine(_case(smi_data, "case02"))
    nic0 = machine.nics[0]
    assert nic0.gpu_paths == {0: "PXB", 1: "PXB", 2: "SYS", 3: "SYS", 4: "SYS", 5: "SYS", 6: "SYS", 7: "SYS"}
    assert set(machine.nics[16].gpu_paths.values()) == {"SYS"}


def test_case06_ansi_escapes_do_not_hide_columns(smi_data: Path) -> None:
    machine = import_machine(_case(smi_data, "case06"))
    assert machine.pair(1, 2).nvlink_count == 6
    assert machine.pair(0, 1).pcie is PciePath.NODE
    assert machine.gpus[2].numa_node == 0


def test_case08_dual_socket_guess_is_recorded(smi_data: Path) -> None:
    machine = import_machine(_case(smi_data, "case08"))
    assert machine.pair(0, 1).pcie is PciePath.NODE
    assert machine.pair(2, 3).pcie is PciePath.NODE
    assert {machine.pair(a, b).pcie for a in (0, 1) for b in (2, 3)} == {PciePath.SYS}
    assert machine.host.sockets == 2
    assert any("guessed 2 CPU sockets" in note for note in machine.notes)


def test_one_numa_node_guesses_no_sockets(smi_data: Path) -> None:
    machine = import_machine(_case(smi_data, "case03"))
    assert machine.host.sockets is None
    assert machine.host.unavailable["sockets"] == "not in topo -m"


def test_imported_machine_round_trips_through_json(smi_data: Path) -> None:
    machine = import_machine(_case(smi_data, "case05"))
    again = Machine.from_dict(machine.to_dict())
    assert _codes(again) == _codes(machine)
    assert [n.gpu_paths for n in again.nics] == [n.gpu_paths for n in machine.nics]
    assert again.label.startswith("imported: ")


# -- synthetic variants -------------------------------------------------------

TWO_NV18 = """\
\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\t0-55,112-167\t0\t\tN/A
GPU1\tNV18\t X \t56-111,168-223\t1\t\tN/A
"""


def test_warnings_above_the_matrix_and_no_legend() -> None:
    text = (
        "WARNING: infoROM is corrupted at gpu 0000:41:00.0\n"
        "Failed to initialize NVML: Driver/library version mismatch\n"
        "\n" + TWO_NV18
    )
    machine = import_text(text, "warned.txt")
    assert machine.pair(0, 1).nvlink_count == 18
    assert machine.pair(0, 1).pcie is None
    assert [g.numa_node for g in machine.gpus] == [0, 1]
    assert machine.origin == "warned.txt"


def test_crlf_line_endings(smi_data: Path) -> None:
    text = _case(smi_data, "case08").read_text().replace("\n", "\r\n")
    machine = import_text(text, "crlf.txt")
    assert _codes(machine) == {"NODE": 2, "SYS": 4}
    assert [n.device for n in machine.nics] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]


def test_gpu_numa_id_column_with_values_grace_hopper() -> None:
    text = """\
        GPU0    NIC0    CPU Affinity    NUMA Affinity   GPU NUMA ID
GPU0     X      SYS     0-71    0               1
NIC0    SYS      X

NIC Legend:

  NIC0: mlx5_0
"""
    machine = import_text(text, "gh200.txt")
    assert machine.gpus[0].numa_node == 0
    assert format_cpu_list(machine.gpus[0].cpu_affinity) == "0-71"
    assert machine.nics[0].gpu_paths == {0: "SYS"}
    assert "GPU 0 memory is NUMA node 1 (GPU NUMA ID in topo -m)" in machine.notes
    assert machine.pairs == []


def test_single_spaces_and_lower_case_cells() -> None:
    text = (
        "GPU0 GPU1 GPU2 CPU Affinity NUMA Affinity\nGPU0 X pix phb 0-7 0\nGPU1 pix X phb 0-7 0\nGPU2 phb phb X 8-15 1\n"
    )
    machine = import_text(text, "compact.txt")
    assert machine.pair(0, 1).pcie is PciePath.PIX
    assert machine.pair(1, 2).pcie is PciePath.PHB
    assert _numa(machine) == {0: "0-7", 1: "8-15"}


def test_copied_escapes_without_esc_character() -> None:
    text = "\t[4mGPU0\tGPU1\tCPU Affinity[0m\nGPU0\t X \tPXB\t0-15\nGPU1\tPXB\t X \t0-15\n"
    machine = import_text(text, "pasted.txt")
    assert machine.pair(0, 1).pcie is PciePath.PXB
    assert "no NUMA Affinity column" in machine.gpus[0].unavailable["numa_node"]


def test_old_soc_code_reads_as_sys() -> None:
    machine = import_text("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tSOC\t0-9\nGPU1\tSOC\t X \t10-19\n", "old.txt")
    assert machine.pair(0, 1).pcie is PciePath.SYS
    assert "read the old code SOC as SYS" in machine.notes


def test_na_cells_and_affinities() -> None:
    text = "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tN/A\tN/A\tN/A\nGPU1\tN/A\t X \tN/A\tN/A\n"
    machine = import_text(text, "vm.txt")
    pair = machine.pair(0, 1)
    assert pair.pcie is None and pair.nvlink_count == 0 and pair.topo_code == "N/A"
    assert machine.gpus[0].cpu_affinity is None
    assert machine.gpus[0].unavailable["cpu_affinity"] == "N/A in topo -m"
    assert machine.host.numa_nodes == []


def test_single_gpu() -> None:
    machine = import_text("\tGPU0\tCPU Affinity\tNUMA Affinity\nGPU0\t X \t0-31\t0\n\nLegend:\n", "one.txt")
    assert len(machine.gpus) == 1 and machine.pairs == []
    assert _numa(machine) == {0: "0-31"}


def test_nic_columns_without_legend_have_unknown_devices() -> None:
    text = "\tGPU0\tNIC0\tCPU Affinity\nGPU0\t X \tPIX\t0-7\nNIC0\tPIX\t X \n"
    machine = import_text(text, "nolegend.txt")
    assert machine.nics[0].label == "NIC0" and machine.nics[0].device is None
    assert any("NIC Legend" in note for note in machine.notes)


def test_sniffed_as_topo_whatever_the_name(smi_data: Path, tmp_path: Path) -> None:
    disguised = tmp_path / "gpus.xml"
    disguised.write_bytes(_case(smi_data, "case11").read_bytes())
    assert _codes(import_machine(disguised)) == {"NV12": 28}
    assert str(sniff(disguised.read_text())) == "nvidia-smi topo -m"


# -- errors name the line -----------------------------------------------------

RAGGED = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tNIC1\tNIC2\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV4\tSYS\tSYS\tPIX\tSYS\tSYS\t0-15\t0
GPU1\tNV4\t X \tSYS\tSYS\tPIX\tSYS\tSYS\t0-15\t0
GPU2\tSYS\tSYS\t X \tNV4\tSYS\tPIX\tSYS
"""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (RAGGED, "line 4: expected 9 cells after 'GPU2', found 7"),
        (
            "\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tFOO\t X \n",
            "line 3: unknown cell 'FOO' in column 'GPU0' of row 'GPU1'",
        ),
        ("\tGPU0\tGPU1\nGPU0\t X \tNV1\nGPU1\tNV2\t X \n", "line 3: 'GPU1' to 'GPU0' is NV2 but line 2 says"),
        ("\tGPU0\tGPU1\nGPU0\tPIX\tPIX\nGPU1\tPIX\t X \n", "line 2: 'GPU0' to itself must be X, found 'PIX'"),
        ("\tGPU0\tGPU1\nGPU0\t X \tX\nGPU1\tX\t X \n", "line 2: X between 'GPU0' and 'GPU1'"),
        ("\tGPU0\tGPU1\nGPU0\t X \tNV0\nGPU1\tNV0\t X \n", "line 2: unknown cell 'NV0'"),
        ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tPIX\t0-7\n", "line 3: expected the row for 'GPU1', found the end"),
        ("\tGPU0\tGPU1\nGPU0\t X \tPIX\n\nGPU1\tPIX\t X \n", "line 3: expected the row for 'GPU1', found a blank line"),
        ("\tGPU0\tGPU1\nGPU1\tPIX\t X \nGPU0\t X \tPIX\n", "line 2: expected the row for 'GPU0', found 'GPU1'"),
        ("\tGPU0\tGPU0\nGPU0\t X \tPIX\n", "line 1: column 'GPU0' appears twice"),
        (
            "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tPIX\t0-x\nGPU1\tPIX\t X \t0-7\n",
            "line 2: CPU Affinity '0-x' of 'GPU0' is not a CPU list",
        ),
        (
            "\tGPU0\tGPU1\tNUMA Affinity\nGPU0\t X \tPIX\tzero\nGPU1\tPIX\t X \t0\n",
            "line 2: NUMA Affinity 'zero' of 'GPU0' is not a NUMA node number",
        ),
        (
            "WARNING: something\n\tGPU0\tNIC0\nGPU0\t X \tPIX\nNIC0\tPIX\t X \tPIX\n",
            "line 4: expected 2 cells after 'NIC0', found 3",
        ),
    ],
)
def test_unreadable_matrix_names_the_line(text: str, message: str) -> None:
    with pytest.raises(MachineImportError) as err:
        import_text(text, "bad.txt")
    assert str(err.value).startswith("bad.txt: ")
    assert message in str(err.value)


def test_no_matrix_at_all() -> None:
    with pytest.raises(MachineImportError, match="no `nvidia-smi topo -m` matrix found"):
        parse_topo("Legend:\n\n  X    = Self\n")
    with pytest.raises(MachineImportError, match="not a recognised nvidia-smi output"):
        import_text("hello, this is not nvidia-smi\n", "notes.txt")


def test_empty_and_binary_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(MachineImportError, match=r"empty\.txt: the file is empty"):
        import_machine(empty)
    junk = tmp_path / "junk.txt"
    junk.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(MachineImportError, match=r"junk\.txt: not a text file \(byte 0x80 at offset 128"):
        import_machine(junk)
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"\tGPU0\tGPU1\nGPU0\t X \tPIX\x00\n")
    with pytest.raises(MachineImportError, match=r"nul\.txt: line 2: binary data \(control character 0x00\)"):
        import_machine(nul)
    with pytest.raises(MachineImportError, match="the file is empty"):
        import_text(" \n\t\n", "blank")


def test_missing_file_and_folder(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(MachineImportError) as err:
        import_machine(missing)
    assert str(err.value) == f"nvidia-smi output {missing} does not exist"
    with pytest.raises(MachineImportError, match="is a folder"):
        import_machine(tmp_path)
    with pytest.raises(MachineImportError, match="no files to import"):
        import_machine([])


def test_two_topo_files_are_refused(smi_data: Path) -> None:
    with pytest.raises(MachineImportError, match="both `topo -m` outputs"):
        import_machine([_case(smi_data, "case01"), _case(smi_data, "case09")])


DATA = Path(__file__).resolve().parent / "data"


def test_blank_cpu_affinity_cells_inside_a_slurm_allocation_are_read_by_position() -> None:
    # `srun nvidia-smi topo -m`, space-aligned: srun's lines above, GPU2 and GPU3 with no CPU Affinity.
    machine = import_machine(DATA / "topo_slurm_empty_cpu_affinity.txt")
    assert [format_cpu_list(g.cpu_affinity) if g.cpu_affinity else None for g in machine.gpus] == [
        "0-15", "0-15", None, None
    ]  # fmt: skip
    assert [g.numa_node for g in machine.gpus] == [0, 0, 1, 1]  # the cells after the blank one stay in place
    assert "blank in topo -m" in machine.gpus[2].unavailable["cpu_affinity"]
    assert _codes(machine) == {"NV4": 6}
    assert {n.label: n.device for n in machine.nics} == {"NIC0": "mlx5_0", "NIC1": "mlx5_1"}
    assert machine.nics[1].gpu_paths == {0: "SYS", 1: "SYS", 2: "PXB", 3: "PXB"}


def test_a_blank_matrix_cell_is_still_refused_by_line() -> None:
    text = (DATA / "topo_slurm_empty_cpu_affinity.txt").read_text().replace("GPU1    NV4      X      NV4", "GPU1            X      NV4")
    with pytest.raises(MachineImportError, match="line 5: expected 9 cells after 'GPU1', found 8"):
        parse_topo(text)


def test_tab_separated_rows_still_count_cells() -> None:
    text = "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tNV2\t1\nGPU1\tNV2\t X \t0-7\t0\n"
    with pytest.raises(MachineImportError, match="line 2: expected 4 cells after 'GPU0', found 3"):
        parse_topo(text)


def test_a_nic_legend_shorter_than_the_matrix_names_what_it_lists() -> None:
    machine = import_machine(DATA / "topo_short_nic_legend.txt")
    assert {n.label: n.device for n in machine.nics} == {"NIC0": "mlx5_0", "NIC1": None}
    assert "the NIC Legend of topo -m does not list NIC1: their device names are unknown" in machine.notes
    assert not any(note.startswith("no NIC Legend") for note in machine.notes)
    assert [format_cpu_list(g.cpu_affinity) for g in machine.gpus] == ["0-15", "0-15", "16-31", "16-31"]


def test_a_gpu_model_chosen_for_a_topo_file_gives_its_gpus_the_tables_name_and_memory() -> None:
    from rigpilot.engine.errors import UserError
    from rigpilot.engine.hardware.importers import unknown_model_gpus, with_gpu_model
    from rigpilot.engine.hardware.specs import load_specs, match_spec

    topo = import_machine([DATA / "topo_short_nic_legend.txt"])
    assert unknown_model_gpus(topo) == [0, 1, 2, 3]
    for spec in load_specs():  # every row: the name given maps back onto the row chosen, at its memory
        gpu = with_gpu_model(topo, spec.key).gpus[0]
        assert gpu.memory_total == int(spec.memory_gib * 2**30)
        assert match_spec(gpu.name, gpu.memory_total) == spec, (spec.key, gpu.name)
    chosen = with_gpu_model(topo, "rtx-4090")
    assert chosen.label == "imported: 4×RTX 4090 (topo_short_nic_legend.txt)" and unknown_model_gpus(chosen) == []
    assert chosen.pairs == topo.pairs and chosen.host == topo.host  # only the GPUs' model changes
    assert "GPU 0, 1, 2, 3: GeForce RTX 4090 as chosen by the user (topo -m names no model)" in chosen.notes
    assert not any(n.startswith("topo -m does not name the GPUs") for n in chosen.notes)
    assert Machine.from_dict(chosen.to_dict()).gpus == chosen.gpus  # kept as the app keeps imported machines
    with pytest.raises(UserError, match="did you mean rtx-4090") as typo:
        with_gpu_model(topo, "rtx4090")
    assert typo.value.reason == "unknown_gpu_model"
    with pytest.raises(UserError, match="name every GPU's model already") as known:
        with_gpu_model(chosen, "h100-sxm5")
    assert known.value.reason == "gpu_model_known"


def test_planning_for_a_topo_file_alone_asks_for_the_gpu_model_and_plans_with_it(capsys) -> None:
    from rigpilot.engine.cli.entry import main

    topo = str(DATA / "topo_short_nic_legend.txt")
    assert main(["plan", "--import", topo, "--model", "gpt2", "--no-verify"]) == 2
    assert capsys.readouterr().err == (
        "rigpilot: error: the model of GPU 0, 1, 2, 3 is unknown (topo -m names none), so neither is its memory: "
        "give it with --gpu-model KEY (e.g. rtx-4090, a100-sxm4-80gb, h100-sxm5), or import the machine's "
        "`nvidia-smi -q` output too\n"
    )
    assert main(["plan", "--import", topo, "--gpu-model", "rtx-4090", "--model", "gpt2", "--no-verify"]) == 0
    assert "imported: 4×RTX 4090 (topo_short_nic_legend.txt), GPUs 0,1,2,3" in capsys.readouterr().out
    assert main(["plan", "--gpu-model", "rtx-4090", "--model", "gpt2"]) == 2
    assert "add --import FILE" in capsys.readouterr().err
