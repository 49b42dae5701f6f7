"""The Topology page: the drawn graph, the topo -m matrix, imports, selection. No engine, no GPU."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QPoint, QSettings, Qt
from PySide6.QtGui import QColor, QPalette
from PySide6.QtTest import QTest

from rigpilot.app.topology.imported import ImportedMachines
from rigpilot.app.topology.model import build_graph, measured_bandwidth, nvlink_link_gbs, topo_matrix
from rigpilot.app.topology.page import TopologyPage
from rigpilot.engine.hardware.importers import import_machine
from rigpilot.engine.hardware.simulated import list_profiles, load_profile

from support.gui_fakes import FakeLink, focusable_widgets, isolated_config, make_job, real_plan_reply, tab_through

PROFILES = [p["id"] for p in list_profiles()]
# NVLink edges as drawn: one per bridged pair, or one spoke per GPU into an NVSwitch.
NVLINK_EDGES = {
    "1x-rtx4090": 0, "2x-rtx3090-nvlink": 1, "4x-rtx4090": 0, "4x-rtxa6000-bridged": 2,
    "8x-a100-pcie": 4, "8x-h100-sxm": 8, "mixed-4090-3090": 0,
}  # fmt: skip


@pytest.fixture(autouse=True)
def _private_settings(tmp_path, monkeypatch):
    # Imported machines are kept in QSettings: never the user's, never another test's.
    yield from isolated_config(tmp_path, monkeypatch)


def open_page(qtbot, link: FakeLink) -> TopologyPage:
    page = TopologyPage(link)
    qtbot.addWidget(page)
    page.resize(1280, 900)
    page.show()
    qtbot.waitExposed(page)
    link.connect_engine()
    return page


def expected_nvlink_edges(profile: str) -> int:
    if profile in NVLINK_EDGES:
        return NVLINK_EDGES[profile]
    m = load_profile(profile)  # a profile added later: count from its machine
    if any(p.nvswitch for p in m.pairs):
        return len({i for p in m.pairs if p.nvswitch for i in p.key})
    return sum(1 for p in m.pairs if p.nvlink_count)


@pytest.mark.parametrize("profile", PROFILES)
def test_renders_every_profile_with_its_nvlink_edges_and_matrix(qtbot, profile):
    link = FakeLink(profile)
    page = open_page(qtbot, link)
    machine = link.machine_obj
    assert page.title.text() == machine.label
    assert len(page.graph.nvlink_edges) == expected_nvlink_edges(profile)
    assert sorted(page.graph_view.gpu_items) == [g.index for g in machine.gpus]
    # The matrix cells are the engine's own topo codes (as the `topology` request returns them).
    cells = link._topology()["matrix"]["cells"]
    for a, row in enumerate(cells):
        for b, code in enumerate(row):
            assert page.matrix.code(a, b) == code
    assert page.summary.text().lstrip("• ").startswith(("NVLink", "NVSwitch", "No NVLink", "One GPU"))


def test_nvlink_edges_carry_link_count_and_bandwidth():
    a100 = build_graph(load_profile("8x-a100-pcie"))
    assert [e.label for e in a100.nvlink_edges] == ["NV12 · 300 GB/s"] * 4  # 12 links × 25 GB/s each way
    rtx = build_graph(load_profile("2x-rtx3090-nvlink"))
    assert rtx.nvlink_edges[0].label == "NV4 · 56 GB/s"  # the spec's 112.5 GB/s over 4 links, both ways
    h100 = build_graph(load_profile("8x-h100-sxm"))
    assert {e.b for e in h100.nvlink_edges} == {"nvswitch"}
    assert h100.nvlink_edges[0].label == "NV18 · 450 GB/s"


def test_reported_link_speed_wins_over_the_spec_table():
    machine = load_profile("2x-rtx3090-nvlink")
    machine.gpus[0].nvlink_link_gbps = 14.062
    speed, why = nvlink_link_gbs(machine, machine.gpus[0])
    assert speed == 14.062 and "driver" in why


def test_pcie_paths_become_switches_bridges_and_sockets():
    graph = build_graph(load_profile("8x-a100-pcie"))
    kinds = [n.kind for n in graph.nodes]
    assert kinds.count("cpu") == 2 and kinds.count("switch") == 4 and kinds.count("bridge") == 4
    assert [b.gpus for b in graph.boxes] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [e for e in graph.edges if e.kind == "smp"]  # SYS pairs cross the socket interconnect
    switch_of = {e.a: e.b for e in graph.edges if e.kind == "pcie" and e.a.startswith("gpu")}
    assert switch_of["gpu0"] == switch_of["gpu1"] != switch_of["gpu2"]  # PIX pairs share a switch
    flat = build_graph(load_profile("4x-rtx4090"))
    assert not [n for n in flat.nodes if n.kind == "switch"]


def test_live_nvlink_throughput_on_the_edges(qtbot):
    link = FakeLink("8x-h100-sxm")
    page = open_page(qtbot, link)
    link.feed.set_load(0, utilization=90)
    link.push_telemetry(3)
    labels = {edge.gpus: text.text() for edge, _, text in page.graph_view.edge_items if edge.kind == "nvlink"}
    assert "⇄" in labels[(0,)] and "GB/s" in labels[(0,)].splitlines()[1]
    assert float(labels[(0,)].splitlines()[1].split("⇄")[0]) > 1.0


def test_live_pcie_traffic_beside_each_gpus_link(qtbot):
    from rigpilot.app.topology.model import pcie_link_gbs

    link = FakeLink("4x-rtx4090")  # no NVLink: every transfer crosses PCIe
    page = open_page(qtbot, link)
    view = page.graph_view
    pcie = {edge.gpus[0]: (edge, item, text) for edge, item, text in view.edge_items if edge.kind == "pcie" and edge.gpus}
    assert sorted(pcie) == [0, 1, 2, 3]
    gpu0 = link.machine_obj.gpu(0)
    assert pcie[0][0].gbs == pytest.approx(pcie_link_gbs(gpu0)) and 25 < pcie[0][0].gbs < 33  # Gen4 x16
    link.feed.set_load(0, utilization=95)
    last = link.push_telemetry(3)[-1]
    text = pcie[0][2]
    assert text.parentItem().isVisible() and text.text().startswith("↓") and text.text().endswith("GB/s")
    rx = float(text.text()[1:].split()[0])
    sample = next(g for g in last["gpus"] if g["index"] == 0)
    assert rx == pytest.approx(sample["pcie_rx_bps"] / 1e9, abs=0.05)
    # The idle GPU 3 shows its trickle; its line keeps the resting colour.
    assert pcie[3][2].text().startswith("↓0.")
    assert pcie[3][1].pen().color() == pcie[3][1].data(0)


def test_busy_gpus_are_marked(qtbot):
    link = FakeLink("4x-rtx4090")
    page = open_page(qtbot, link)
    link.push_job(make_job("j1", [1, 2], name="bert"))
    assert page.graph_view.busy == {1: ["bert"], 2: ["bert"]}
    assert "In use by: bert" in page.graph_view.gpu_items[1].toolTip()
    assert "●" in page.graph_view.gpu_items[1].text.text()
    link.push_job(make_job("j1", [1, 2], name="bert", state="completed"))
    assert page.graph_view.busy == {}


def test_clicking_gpus_selects_them(qtbot):
    link = FakeLink("4x-rtxa6000-bridged")
    page = open_page(qtbot, link)
    view = page.graph_view
    with qtbot.waitSignal(page.sig_gpus_selected) as selected:
        item = view.gpu_items[2]
        point = view.mapFromScene(item.sceneBoundingRect().center())
        QTest.mouseClick(view.viewport(), Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, QPoint(point))
    assert selected.args == [[2]]
    assert page.selected_gpus() == [2] and "GPU 2" in page.selection_label.text()


def test_keyboard_selects_gpus(qtbot):
    link = FakeLink("4x-rtx4090")
    page = open_page(qtbot, link)
    view = page.graph_view
    view.setFocus()
    qtbot.waitUntil(view.hasFocus)
    QTest.keyClick(view, Qt.Key.Key_Right)
    QTest.keyClick(view, Qt.Key.Key_Space)
    assert page.selected_gpus() == [1]
    QTest.keyClick(view, Qt.Key.Key_A, Qt.KeyboardModifier.ControlModifier)
    assert page.selected_gpus() == [0, 1, 2, 3]
    with qtbot.waitSignal(page.sig_gpus_selected) as selected:
        QTest.keyClick(view, Qt.Key.Key_Escape)
    assert selected.args == [[]]


def test_import_topo_file_shows_that_machine_and_back(qtbot, smi_data):
    link = FakeLink("4x-rtx4090")
    page = open_page(qtbot, link)
    with qtbot.waitSignal(page.sig_machine_shown, timeout=10000) as shown:
        page.import_files([smi_data / "case08_4xRTX6000Ada_dual_socket_genoa_4nics.txt"])
    assert shown.args[0]["source"] == "imported"
    assert page.imported and page.title.text().startswith("imported:")
    assert page.back_button.isVisible() and not page.error.isVisible()
    expected = import_machine(smi_data / "case08_4xRTX6000Ada_dual_socket_genoa_4nics.txt")
    matrix = topo_matrix(expected)
    assert page.matrix.rowCount() == len(matrix.rows) == 4 + len(expected.nics)
    assert page.matrix.code(0, 1) == "NODE" and page.matrix.code(0, 2) == "SYS"
    assert [b.gpus for b in page.graph.boxes] == [[0, 1], [2, 3]]
    # Telemetry of this machine does not paint the imported one.
    link.push_telemetry(1)
    page.back_button.click()
    assert not page.imported and page.title.text() == link.machine_obj.label
    assert not page.back_button.isVisible()


def test_import_xml_file(qtbot, smi_data):
    link = FakeLink("1x-rtx4090")
    page = open_page(qtbot, link)
    with qtbot.waitSignal(page.sig_machine_shown, timeout=10000):
        page.import_files([smi_data / "case25_smiqx_8xV100S_pcie_nvidia-smi-q-x_xml.txt"])
    assert len(page.graph_view.gpu_items) == 8
    assert "V100S" in page.graph_view.gpu_items[0].text.text()


def test_garbage_file_shows_an_error(qtbot, tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("this is a shopping list\neggs\nmilk\n")
    link = FakeLink("4x-rtx4090")
    page = open_page(qtbot, link)
    with qtbot.waitSignal(page.sig_import_failed, timeout=10000) as failed:
        page.import_files([bad])
    assert "notes.txt" in failed.args[0]
    assert page.error.isVisible() and page.error.text() == failed.args[0]
    assert not page.imported and page.title.text() == link.machine_obj.label
    assert page.import_button.isEnabled()


def test_measured_bandwidth_heat_map(qtbot):
    link = FakeLink("4x-rtx4090")
    page = open_page(qtbot, link)
    assert not page.heat_map.isVisible()
    d = link.machine_obj.to_dict()
    d["calibration"] = {"bus_bandwidth_gbs": {"0,1": 21.5, "2,3": 20.0, "0,1,2,3": 9.0}}
    assert measured_bandwidth(d) == {(0, 1): 21.5, (2, 3): 20.0}
    link.sig_machine.emit(d)
    assert page.heat_map.isVisible()
    assert page.heat_map.item(0, 1).text() == "21.5" and page.heat_map.item(1, 0).text() == "21.5"
    assert page.heat_map.item(0, 2).text() == ""


def test_tab_reaches_every_control(qtbot):
    link = FakeLink("8x-a100-pcie")
    page = open_page(qtbot, link)
    expected = focusable_widgets(page)
    visited = tab_through(page, qtbot)
    assert not [w.objectName() or type(w).__name__ for w in expected if w not in visited]
    assert {"importMachine", "topologyGraph", "topoMatrix"} <= {w.objectName() for w in visited}


def test_drawing_follows_a_dark_palette(qtbot):
    link = FakeLink("2x-rtx3090-nvlink")
    page = open_page(qtbot, link)
    dark = QPalette(page.palette())
    dark.setColor(QPalette.ColorRole.Base, QColor("#17181a"))
    dark.setColor(QPalette.ColorRole.Text, QColor("#e8eaed"))
    page.setPalette(dark)
    assert page.graph_view.scene().backgroundBrush().color() == QColor("#17181a")
    assert page.graph_view.gpu_items[0].text.brush().color() == QColor("#e8eaed")


@pytest.mark.parametrize("dark", [False, True])
def test_each_link_kind_has_its_own_colour_and_the_legend_shows_the_matrixs(qtbot, dark):
    from rigpilot.app.topology.matrix import TopoLegend, TopoMatrixTable
    from rigpilot.app.topology.model import Matrix

    codes = ["NV4", "PIX", "PHB", "NODE", "SYS"]  # PXB is a switch path like PIX
    matrix, legend = TopoMatrixTable(), TopoLegend()
    for w in (matrix, legend):
        qtbot.addWidget(w)
        if dark:
            pal = QPalette(w.palette())
            pal.setColor(QPalette.ColorRole.Base, QColor("#17181a"))
            w.setPalette(pal)
    matrix.show_matrix(Matrix(codes, ["GPU0"], [codes]))
    cells = [matrix.item(0, c).background().color().name() for c in range(len(codes))]
    assert len(set(cells)) == len(codes), dict(zip(codes, cells, strict=True))  # NODE is not PHB's colour
    swatches = {}
    for (swatch, _), code in zip(legend._swatches, legend_codes(), strict=True):
        swatches[code] = swatch.pixmap().toImage().pixelColor(7, 7).name()
    assert [swatches[c if not c.startswith("NV") else "NV#"] for c in codes] == cells


def legend_codes() -> list[str]:
    from rigpilot.engine.hardware.machine import PCIE_LEGEND

    return list(PCIE_LEGEND)


TOPO_ONLY = "case08_4xRTX6000Ada_dual_socket_genoa_4nics.txt"
SMI_Q = "case21_smiq_4xA100_sxm4_80gb_nvidia-smi-q.txt"


def test_a_long_file_name_elides_and_never_widens_the_window(qtbot, smi_data, tmp_path):
    long_name = tmp_path / ("nvidia-smi-q-of-the-big-training-box-in-the-basement-" * 4)[:196]
    long_name = long_name.with_suffix(".txt")
    assert len(long_name.name) == 200
    long_name.write_text((smi_data / SMI_Q).read_text())
    link = FakeLink("4x-rtx4090")
    page = open_page(qtbot, link)
    width = page.width()
    assert width == 1280
    with qtbot.waitSignal(page.sig_machine_shown, timeout=10000):
        page.import_files([long_name])
    qtbot.wait(50)  # layouts settle on the next turn of the event loop
    assert page.width() == width and page.minimumSizeHint().width() < width
    assert long_name.name in page.title.text() and long_name.name in page.title.toolTip()
    assert "…" in page.title.shown_text() and long_name.name not in page.title.shown_text()
    assert page.back_button.isVisible() and page.back_button.geometry().right() <= page.width()
    assert page.plan_button.isVisible() and page.plan_button.geometry().right() <= page.width()
    # The same for a file that cannot be read: the message wraps, the window keeps its width.
    bad = tmp_path / ("x" * 196 + ".txt")
    bad.write_text("eggs\nmilk\n")
    with qtbot.waitSignal(page.sig_import_failed, timeout=10000):
        page.import_files([bad])
    qtbot.wait(50)
    assert page.error.isVisible() and page.width() == width


def test_gpus_from_topo_m_alone_say_their_name_is_unknown(qtbot, smi_data):
    link = FakeLink("4x-rtx4090")
    page = open_page(qtbot, link)
    with qtbot.waitSignal(page.sig_machine_shown, timeout=10000):
        page.import_files([smi_data / TOPO_ONLY])
    labels = [item.text.text() for item in page.graph_view.gpu_items.values()]
    assert labels and all("name unknown" in t and "from topo" not in t for t in labels)
    tip = next(n.tooltip for n in page.graph.nodes if n.gpu == 0)
    assert tip.splitlines()[0] == "GPU 0 (name unknown: topo -m lists no model)"
    assert page.title.text() == f"imported: 4 GPUs, models unknown (topo -m lists none) ({TOPO_ONLY})"
    # Nothing to plan against without the GPUs' memory: the button says what to choose or import.
    assert not page.plan_button.isEnabled() and "nvidia-smi -q" in page.plan_button.toolTip()
    assert page.gpu_model.isVisible() and "names no model for its GPUs" in page.gpu_model.label.text()
    assert not page.gpu_model.use.isEnabled()  # nothing chosen yet


def test_choosing_the_gpu_model_of_a_topo_file_makes_it_plannable_and_kept(qtbot, smi_data, tmp_path):
    from rigpilot.app.main_window import MainWindow

    link = FakeLink("4x-rtx4090")
    link.replies["plan"] = real_plan_reply(link.machine_obj)
    w = MainWindow(link)
    qtbot.addWidget(w)
    w.show()
    link.connect_engine()
    topology, planner = w.show_page("topology"), w.pages["planner"]
    with qtbot.waitSignal(topology.sig_machine_shown, timeout=10000):
        topology.import_files([smi_data / TOPO_ONLY])
    key = topology.shown_key
    choice = topology.gpu_model
    choice.models.setCurrentIndex(choice.models.findData("rtx-4090"))
    assert choice.models.currentText() == "NVIDIA GeForce RTX 4090 (24 GB)"
    with qtbot.waitSignal(topology.sig_machine_shown):
        qtbot.mouseClick(choice.use, Qt.MouseButton.LeftButton)
    assert not choice.isVisible() and topology.plan_button.isEnabled() and topology.shown_key == key
    assert topology.title.text() == f"imported: 4×RTX 4090 ({TOPO_ONLY})"
    # kept in the one list, replacing the entry without a model: the Planner plans for it at once
    (entry,) = [m for m in topology.machines.items() if m.key == key]
    assert {g["memory_total"] for g in entry.machine["gpus"]} == {24 * 2**30}
    planner.picker.set_model("llama-2-7b", chosen=False)
    with qtbot.waitSignal(planner.sig_plan_ready, timeout=20000):
        topology.plan_button.click()
    assert link.requests("plan")[-1]["machine"]["gpus"][0]["name"] == "NVIDIA GeForce RTX 4090"
    assert planner.target_key() == "import:" + key
    w.close()


def test_imports_are_kept_in_one_list_and_shown_again(qtbot, smi_data, tmp_path):
    settings = QSettings(str(tmp_path / "m.ini"), QSettings.Format.IniFormat)
    link = FakeLink("4x-rtx4090")
    page = TopologyPage(link, machines=ImportedMachines(settings))
    qtbot.addWidget(page)
    page.show()
    link.connect_engine()
    assert not page.choice.isVisible()  # nothing imported yet
    for name in (SMI_Q, TOPO_ONLY, SMI_Q):  # the same file twice: one entry
        with qtbot.waitSignal(page.sig_machine_shown, timeout=10000):
            page.import_files([smi_data / name])
    assert [m.machine["origin"] for m in page.machines.items()] == [SMI_Q, TOPO_ONLY]
    # Another window (or the next start) reads the same list.
    again = ImportedMachines(QSettings(str(tmp_path / "m.ini"), QSettings.Format.IniFormat))
    later = TopologyPage(link, machines=again)
    qtbot.addWidget(later)
    later.show()
    assert later.choice.isVisible() and later.choice.count() == 3
    assert later.choice.itemData(2, Qt.ItemDataRole.ToolTipRole) == later.machines.items()[1].title
    with qtbot.waitSignal(later.sig_machine_shown) as shown:
        later.choice.activated.emit(2)
    assert shown.args[0]["origin"] == TOPO_ONLY and later.imported and later.back_button.isVisible()
    later.choice.activated.emit(0)
    assert not later.imported and later.title.text() == link.machine_obj.label


def test_plan_for_this_machine_opens_the_planner_with_it(qtbot, smi_data):
    from rigpilot.app.main_window import MainWindow

    link = FakeLink("4x-rtx4090")
    link.replies["plan"] = real_plan_reply(link.machine_obj)
    w = MainWindow(link)
    qtbot.addWidget(w)
    w.show()
    link.connect_engine()
    topology, planner = w.show_page("topology"), w.pages["planner"]
    assert planner.machines is topology.machines
    with qtbot.waitSignal(topology.sig_machine_shown, timeout=10000):
        topology.import_files([smi_data / SMI_Q])
    assert topology.plan_button.isEnabled()
    planner.picker.set_model("llama-2-7b", chosen=False)
    planner.method.setCurrentIndex(planner.method.findData("lora"))
    with qtbot.waitSignal(planner.sig_plan_ready, timeout=20000) as ready:
        topology.plan_button.click()  # the model in the form is planned for that machine at once
    assert "A100" in ready.args[0]["explanation"][0]
    assert link.requests("plan")[-1]["machine"]["origin"] == SMI_Q
    assert w.current_page_key() == "planner"
    assert planner.target_key() == "import:" + topology.shown_key
    assert "A100" in planner.gpus.boxes[0].text()
    topology.show_local()
    w.show_page("topology")
    topology.plan_button.click()
    assert w.current_page_key() == "planner" and planner.target_key() == "here"
    w.close()
