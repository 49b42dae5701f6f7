"""The Planner page's Nodes and Link between nodes controls: what they ask the engine, and what the page shows."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QSettings

from rigpilot.app.planner.page import TABLE_COLUMNS, PlannerPage
from rigpilot.engine.planner.cluster import NODE_LINKS

from support.gui_fakes import FakeLink, isolated_config, real_plan_reply

GPUS_COLUMN = TABLE_COLUMNS.index("GPUs")


@pytest.fixture(autouse=True)
def _private_settings(tmp_path, monkeypatch):
    yield from isolated_config(tmp_path, monkeypatch)


def open_page(qtbot) -> tuple[PlannerPage, FakeLink]:
    link = FakeLink("8x-h100-sxm")
    link.replies["plan"] = real_plan_reply(link.machine_obj)
    page = PlannerPage(link)
    qtbot.addWidget(page)
    page.resize(1130, 780)
    page.show()
    qtbot.waitExposed(page)
    link.connect_engine()
    return page, link


def plan(qtbot, page: PlannerPage) -> dict:
    with qtbot.waitSignal(page.sig_plan_ready, timeout=20000) as ready:
        page.plan_button.click()
    return ready.args[0]


def test_nodes_and_link_reach_the_planner_and_the_page_shows_both_nodes(qtbot):
    page, link = open_page(qtbot)
    page.picker.set_model("llama-3.1-8b", chosen=False)
    page.batch.setValue(64)
    # One node: the link does not apply, so its row is hidden and nothing about nodes is asked.
    assert page.nodes.isVisibleTo(page) and not page.internode.isVisibleTo(page)
    plan(qtbot, page)
    assert "nodes" not in (link.requests("plan")[-1]["options"] or {})

    page.nodes.setValue(2)
    assert page.internode.isVisibleTo(page)
    assert [page.internode.itemData(i) for i in range(page.internode.count())] == list(NODE_LINKS)
    page.internode.setCurrentIndex(page.internode.findData("ndr"))
    result = plan(qtbot, page)
    assert link.requests("plan")[-1]["options"] == {"nodes": 2, "internode": "ndr"}
    best = result["best"]
    assert best["parallelism"]["nodes"] == 2
    text = page.explanation.toPlainText()
    assert "Across two nodes joined by InfiniBand NDR" in text and "of linear scaling" in text
    assert page.table.item(0, GPUS_COLUMN).text().endswith("on each of 2 nodes")
    # One bar per GPU of both nodes, named by node.
    assert len(page.chart.heights("weights")) == 16
    ticks = page.chart.plot.getPlotItem().getAxis("bottom")._tickLevels[0]
    assert ticks[0][1] == "n1:0" and ticks[8][1] == "n2:0"
    assert page.chart.readout.text().startswith("Fullest node ")

    # A slow link: the page says why one node is used.
    page.internode.setCurrentIndex(page.internode.findData("10gbe"))
    result = plan(qtbot, page)
    assert result["best"]["parallelism"]["nodes"] == 1
    assert "Planned on one of your 2 nodes" in page.explanation.toPlainText()


def test_nodes_are_for_training_and_are_remembered(qtbot):
    page, _ = open_page(qtbot)
    page.nodes.setValue(3)
    page.internode.setCurrentIndex(page.internode.findData("25gbe"))
    page.task.setCurrentIndex(page.task.findData("infer"))
    assert not page.nodes.isVisibleTo(page) and not page.internode.isVisibleTo(page)
    assert "nodes" not in page.plan_request().options_args()
    page.task.setCurrentIndex(page.task.findData("train"))
    assert page.internode.isVisibleTo(page)
    settings = QSettings()
    page.save_state(settings, "planner")
    again, _ = open_page(qtbot)
    again.restore_state(settings, "planner")
    assert again.nodes.value() == 3 and again.internode.currentData() == "25gbe"
