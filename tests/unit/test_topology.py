from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.hardware.topology import describe, render_matrix, summarize


def test_describe_names_islands_switches_and_socket_crossings():
    text = "\n".join(describe(load_profile("8x-a100-pcie")))
    assert "NVLink islands: GPU 0, 1 (NV12); GPU 2, 3 (NV12); GPU 4, 5 (NV12); GPU 6, 7 (NV12)." in text
    assert "Share a PCIe switch: GPU 0, 1; GPU 2, 3; GPU 4, 5; GPU 6, 7." in text
    assert "16 of 28 pairs" in text
    assert "P2P not supported: 0–4" in text


def test_describe_no_nvlink_no_p2p():
    text = "\n".join(describe(load_profile("4x-rtx4090")))
    assert "No NVLink" in text
    assert "not supported: every transfer is staged through host memory" in text
    assert "node 0: GPU 0, 1; node 1: GPU 2, 3" in text


def test_describe_partial_nvlink_lists_the_gpus_left_out():
    m = load_profile("4x-rtxa6000-bridged")
    m.pairs = [p for p in m.pairs if p.key != (2, 3)] + [
        type(m.pairs[0])(2, 3, pcie=m.pair(2, 3).pcie)
    ]
    text = "\n".join(describe(m))
    assert "NVLink islands: GPU 0, 1 (NV4)." in text
    assert "No NVLink: GPU 2, 3." in text


def test_single_gpu():
    assert describe(load_profile("1x-rtx4090")) == ["One GPU: nothing to connect."]


def test_matrix_is_in_nvidia_smi_notation():
    text = render_matrix(load_profile("8x-h100-sxm"))
    lines = text.splitlines()
    assert lines[0].split() == [f"GPU{i}" for i in range(8)] + ["CPU", "Affinity", "NUMA", "Affinity"]
    row4 = lines[5].split()
    assert row4[0] == "GPU4" and row4[5] == "X" and row4[1] == "NV18"
    assert row4[-2:] == ["56-111,168-223", "1"]
    assert "NV#  = Connection traversing a bonded set of # NVLinks" in text


def test_summary_serialises():
    d = summarize(load_profile("2x-rtx3090-nvlink")).to_dict()
    assert d["nvlink_islands"] == [[0, 1]] and d["p2p_ok_pairs"] == [[0, 1]] and not d["nvswitch"]
